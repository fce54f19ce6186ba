// Which BLAS serves the main job (issue 34): one rank's sgemm calls of a GPT step, timed through
// any BLAS loaded at run time, so that Debian's OpenBLAS, a newer OpenBLAS and oneMKL (both from
// PyPI) run the same calls in one program without being linked into the project.
//
//   blas_sgemm LIBRARY [SYMBOL]     SYMBOL: the library's cblas_sgemm (default "cblas_sgemm")
//
// The calls: 4 layers of 512 rows (the main job's 16 sequences of 64 bytes over 2 ranks), each
// layer's qkv (3C x C), proj (C x C), fc (4C x C), out (C x 4C) and the head (256 x C), each as
// forward (N x T), input gradient (N x N) and weight gradient (T x N), accumulating (beta = 1),
// as examples/gpt/kernels.hpp calls them. Prints the median of 5 repetitions per width, in ms and
// GFLOP/s. One thread: set OPENBLAS_NUM_THREADS=1 or MKL_NUM_THREADS=1 (and
// MKL_THREADING_LAYER=SEQUENTIAL) as the main job runs its BLAS.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {
enum { row_major = 101, no_trans = 111, trans = 112 };  // CBLAS's enumerators
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: blas_sgemm LIBRARY [SYMBOL]\n");
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    std::fprintf(stderr, "blas_sgemm: %s\n", dlerror());
    return 1;
  }
  const char* symbol = argc > 2 ? argv[2] : "cblas_sgemm";
  const auto sgemm = reinterpret_cast<sgemm_fn>(dlsym(lib, symbol));
  if (!sgemm) {
    std::fprintf(stderr, "blas_sgemm: %s has no %s\n", argv[1], symbol);
    return 1;
  }
  const int rows = 512, layers = 4, reps = 5;
  for (int C : {64, 128, 256, 512}) {
    const auto z = [](long v) { return static_cast<std::size_t>(v); };
    std::vector<float> a(z(rows) * z(4 * C), 0.01f), w(z(4 * C) * z(4 * C), 0.02f), out(z(rows) * z(4 * C), 0.0f),
        dw(z(4 * C) * z(4 * C), 0.0f);
    const int shapes[][2] = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}, {256, C}};  // {outputs, inputs}
    std::vector<double> seconds;
    for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
      const auto t0 = std::chrono::steady_clock::now();
      for (int l = 0; l < layers; ++l)
        for (const auto& s : shapes) {
          const int oc = s[0], k = s[1];
          sgemm(row_major, no_trans, trans, rows, oc, k, 1.0f, a.data(), k, w.data(), k, 1.0f, out.data(), oc);
          sgemm(row_major, no_trans, no_trans, rows, k, oc, 1.0f, out.data(), oc, w.data(), k, 1.0f, a.data(), k);
          sgemm(row_major, trans, no_trans, oc, k, rows, 1.0f, out.data(), oc, a.data(), k, 1.0f, dw.data(), k);
        }
      if (r > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(seconds.begin(), seconds.end());
    double flops = 0;
    for (const auto& s : shapes) flops += 3.0 * 2.0 * rows * s[0] * s[1] * layers;
    const double t = seconds[seconds.size() / 2];
    std::printf("dim %4d: %8.3f ms  %6.1f GFLOP/s\n", C, t * 1e3, flops / t / 1e9);
  }
}
