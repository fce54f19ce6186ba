#pragma once
// gpt/cuda/token_rows.hpp: a batch's rows grouped by token, for the embedding's backward on the
// GPU. wte's gradient row v is the sum of dx's rows whose token is v; with the rows grouped, one
// thread per gradient element reads only those rows (N C reads in all), where scanning every
// row for its token read V N C (kernels::embedding_backward). Host code: the tokens come from the
// host, so the grouping is made there, once a step, in O(N + V), as llm.c buckets its tokens on
// the CPU before its wte backward kernel.

#include <cstddef>
#include <cstdint>
#include <span>

namespace gpt::cuda {

//! A stable counting sort of the rows of `tokens` by token: rows[starts[v] .. starts[v + 1]) are
//! the rows n with tokens[n] == v, in ascending n (so a sum over them adds in row order, as
//! gpt/model.hpp's embedding backward does). `starts` has vocab + 1 entries, `rows` tokens.size().
//! Every token must be < vocab (checked at the door: model::check_step).
inline void group_rows_by_token(std::span<const std::uint8_t> tokens, int vocab, std::span<std::int32_t> starts,
                                std::span<std::int32_t> rows) {
  for (std::int32_t& s : starts) s = 0;
  for (std::uint8_t t : tokens) ++starts[std::size_t{t} + 1];
  for (std::size_t v = 1; v <= static_cast<std::size_t>(vocab); ++v) starts[v] += starts[v - 1];
  // starts[v] is now where v's group begins: the cursor of its next row. Afterwards it is where
  // the group ends, that is where v + 1's begins, so a shift by one puts every start back.
  for (std::size_t n = 0; n < tokens.size(); ++n) rows[static_cast<std::size_t>(starts[tokens[n]]++)] = static_cast<std::int32_t>(n);
  for (std::size_t v = static_cast<std::size_t>(vocab); v > 0; --v) starts[v] = starts[v - 1];
  starts[0] = 0;
}

}  // namespace gpt::cuda
