#pragma once
//! \file The type plumbing of shard_group<Params, Policies...>: each type argument is checked
//! to model exactly one kind (MixedPrecision, BucketPolicy, Communicator), with a sentence
//! naming the offending type when it does not, and each kind is picked with its default; and
//! the check of the run-time options that go together.

#include <string>
#include <type_traits>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/policy/mixed_precision.hpp"
#include "fsdp/policy/prefetch.hpp"

namespace fsdp::detail {

template <class P>
inline constexpr int policy_kinds = int(mixed_precision_policy<P>) + int(bucket_policy<P>) + int(full_communicator<P>);

//! Instantiated once per type argument so that the compiler names the offending type.
template <class P>
struct check_policy {
  static_assert(policy_kinds<P> != 0,
                "shard_group: this type argument is not a MixedPrecision, BucketPolicy or Communicator (see the "
                "numbered requirements in fsdp/policy/*.hpp and fsdp/comm/concepts.hpp; sharding and prefetch are "
                "values in shard_group::options)");
  static_assert(policy_kinds<P> <= 1, "shard_group: this type argument models more than one policy kind");
  static constexpr bool value = true;
};

//! The first of Ps for which Is<P> holds, else Default.
template <template <class> class Is, class Default, class... Ps>
struct pick;
template <template <class> class Is, class Default>
struct pick<Is, Default> {
  using type = Default;
};
template <template <class> class Is, class Default, class P, class... Ps>
struct pick<Is, Default, P, Ps...> {
  using type = std::conditional_t<Is<P>::value, P, typename pick<Is, Default, Ps...>::type>;
};
template <template <class> class Is, class... Ps>
inline constexpr int count_of = (0 + ... + int(Is<Ps>::value));

template <class P> struct is_precision : std::bool_constant<mixed_precision_policy<P>> {};
template <class P> struct is_bucket : std::bool_constant<bucket_policy<P>> {};
template <class P> struct is_comm : std::bool_constant<full_communicator<P>> {};

//! shard_group's options: prefetch depths >= 0; a plan gives the issue points and the buckets,
//! so it comes with the default prefetch and BucketPolicy (`default_buckets`).
template <class Options>
void check_options(const Options& o, bool default_buckets, error_site where) {
  if (o.prefetch.forward < 0 || o.prefetch.backward < 0) throw error(errc::invalid_argument, "prefetch depths must be >= 0", where);
  if (o.plan && o.prefetch != fsdp::prefetch{})
    throw error(errc::invalid_argument, "options: a plan gives the issue points; leave .prefetch at its default (got " +
                                            to_string(o.prefetch) + ")", where);
  if (o.plan && !default_buckets)
    throw error(errc::invalid_argument, "options: a plan gives the buckets; drop the BucketPolicy type argument", where);
}

}  // namespace fsdp::detail
