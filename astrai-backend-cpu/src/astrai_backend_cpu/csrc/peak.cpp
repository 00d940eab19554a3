// astrai_cpu::dot_peak: the CPU's multiply-add throughput, measured (benchmarks' compute floors).
//
// dot_peak(kind, iters) runs, on every intra-op thread at once, a register-only loop of 12
// independent accumulators of one instruction, iters times, and returns the multiply-adds' rate in
// G operations a second (a multiply-add counts two), all threads together: "fma" (float32 vfmadd,
// 16 lanes, or 8 on AVX2 builds), "bf16" (vdpbf16ps: 32 products), "int8" (vpdpbusd: 64
// products). -1 for a kind this build has no instruction for. No memory is touched: the limit a kernel's arithmetic can reach,
// against which a measured step is a fraction.
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <omp.h>

#include <chrono>
#include <string>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace astrai_cpu {
namespace {

#if defined(__AVX2__) && defined(__FMA__)
template <typename Step>
double run(int64_t iters, double ops_per_step, Step step) {
  double seconds = 0.0;
#pragma omp parallel num_threads(at::get_num_threads()) reduction(max : seconds)
  {
    const auto start = std::chrono::steady_clock::now();
    step(iters);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return at::get_num_threads() * iters * 12 * ops_per_step / seconds / 1e9;
}

// 12 chains of f in registers, each opaque to the compiler (which would otherwise merge equal chains)
template <typename V, typename F>
void twelve(int64_t iters, V init, F f) {
  V a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init;
  V a6 = init, a7 = init, a8 = init, a9 = init, a10 = init, a11 = init;
  for (int64_t i = 0; i < iters; ++i) {
    a0 = f(a0), a1 = f(a1), a2 = f(a2), a3 = f(a3), a4 = f(a4), a5 = f(a5);
    a6 = f(a6), a7 = f(a7), a8 = f(a8), a9 = f(a9), a10 = f(a10), a11 = f(a11);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
    asm volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
}
#endif

double dot_peak(const std::string& kind, int64_t iters) {
  TORCH_CHECK(iters > 0, "dot_peak: iters must be positive");
  TORCH_CHECK(kind == "fma" || kind == "bf16" || kind == "int8", "dot_peak: kind is fma, bf16 or int8");
#if defined(__AVX512F__)
  if (kind == "fma") {
    return run(iters, 2.0 * 16, [](int64_t n) {
      const __m512 b = _mm512_set1_ps(1e-7f), c = _mm512_set1_ps(0.999f);
      twelve(n, _mm512_set1_ps(1.f), [&](__m512 a) { return _mm512_fmadd_ps(a, c, b); });
    });
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (kind == "fma") {  // 8 lanes
    return run(iters, 2.0 * 8, [](int64_t n) {
      const __m256 b = _mm256_set1_ps(1e-7f), c = _mm256_set1_ps(0.999f);
      twelve(n, _mm256_set1_ps(1.f), [&](__m256 a) { return _mm256_fmadd_ps(a, c, b); });
    });
  }
#endif
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (kind == "bf16") {
    return run(iters, 2.0 * 32, [](int64_t n) {
      const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80);
      twelve(n, _mm512_setzero_ps(), [&](__m512 a) { return _mm512_dpbf16_ps(a, b, b); });
    });
  }
#endif
#if defined(__AVX512VNNI__)
  if (kind == "int8") {
    return run(iters, 2.0 * 64, [](int64_t n) {
      const __m512i b = _mm512_set1_epi8(1);
      twelve(n, _mm512_setzero_si512(), [&](__m512i a) { return _mm512_dpbusd_epi32(a, b, b); });
    });
  }
#endif
#endif
  return -1.0;
}

}  // namespace
}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("dot_peak(str kind, int iters) -> float", &astrai_cpu::dot_peak);
}
