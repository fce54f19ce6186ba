#pragma once
// A parameter handle whose dtype is known only at run time (as in a framework's tensor class),
// to feed shard_group dtypes it must reject.
#include <cstddef>
#include <string>
#include <vector>

#include "fsdp/core/param_traits.hpp"

namespace fsdp_test {

struct dyn_param {
  std::size_t numel = 0;
  fsdp::dtype type = fsdp::dtype::f32;
  std::string name;
  std::vector<unsigned char> init{};  // empty: no initial values
  void* data = nullptr;
  void* grad = nullptr;
  std::vector<std::size_t> shape{};  // param_traits contract 8; empty: {numel}
};

}  // namespace fsdp_test

template <>
struct fsdp::param_traits<fsdp_test::dyn_param> {
  static std::size_t numel(const fsdp_test::dyn_param& p) { return p.numel; }
  static fsdp::dtype type(const fsdp_test::dyn_param& p) { return p.type; }
  static std::string_view name(const fsdp_test::dyn_param& p) { return p.name; }
  static const void* initial_values(const fsdp_test::dyn_param& p) { return p.init.empty() ? nullptr : p.init.data(); }
  static void release_initial_values(fsdp_test::dyn_param& p) { p.init.clear(); }
  static void bind(fsdp_test::dyn_param& p, void* d, void* g) {
    p.data = d;
    p.grad = g;
  }
  static std::vector<std::size_t> shape(const fsdp_test::dyn_param& p) { return p.shape.empty() ? std::vector<std::size_t>{p.numel} : p.shape; }
};
