// astrai_cpu::linear_1row: y = x @ w.T (+ bias) for one bf16 row, the batch-1 decode GEMV.
//
// At batch 1 every linear of a decode step streams its weight once; oneDNN's packed bf16 GEMV
// reached about 36 GB/s on a 2-core AVX512-BF16 machine, this loop 45 GB/s (the measured read
// bandwidth): four weight rows at a time against the row of x (which stays in L1), 32 products
// per AVX512-BF16 dot instruction into float32 accumulators, one rounding to bf16 at the end
// (after the bias, in float32), as F.linear rounds. Weights in their original [N, K] row-major
// layout: no packed copy. Built only where the compiler targets AVX512-BF16
// (`has_linear_1row()` says whether it was); elsewhere oneDNN keeps the linears.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

bool has_linear_1row() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
constexpr int64_t PREFETCH_ROWS = 4;

inline __m512bh load32(const at::BFloat16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
}

void rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
          int64_t K, int64_t n0, int64_t n1) {
  const int64_t blocks = (K + 31) / 32;
  const __mmask32 tail = (K % 32) ? static_cast<__mmask32>((1u << (K % 32)) - 1) : ~static_cast<__mmask32>(0);
  auto finish = [&](int64_t n, __m512 acc) {
    float v = _mm512_reduce_add_ps(acc);
    if (bias != nullptr) v += static_cast<float>(bias[n]);
    out[n] = at::BFloat16(v);
  };
  // One row after another: the weights stream strictly sequentially (rows of a few KiB are too
  // short for the hardware prefetcher to ramp up on several interleaved streams); four
  // accumulators per row break the dependency chain of the dot instructions.
  const __mmask32 full = ~static_cast<__mmask32>(0);
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* wr = w + n * K;
    __builtin_prefetch(wr + PREFETCH_ROWS * K, 0, 0);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= blocks - 1; b += 4) {
      a0 = _mm512_dpbf16_ps(a0, load32(wr + b * 32, full), load32(x + b * 32, full));
      a1 = _mm512_dpbf16_ps(a1, load32(wr + (b + 1) * 32, full), load32(x + (b + 1) * 32, full));
      a2 = _mm512_dpbf16_ps(a2, load32(wr + (b + 2) * 32, full), load32(x + (b + 2) * 32, full));
      a3 = _mm512_dpbf16_ps(a3, load32(wr + (b + 3) * 32, full), load32(x + (b + 3) * 32, full));
    }
    for (; b < blocks; ++b) {
      const __mmask32 m = b + 1 == blocks ? tail : full;
      a0 = _mm512_dpbf16_ps(a0, load32(wr + b * 32, m), load32(x + b * 32, m));
    }
    finish(n, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}
#endif

at::Tensor linear_1row(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_linear_1row(), "linear_1row: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "linear_1row: x must be one contiguous bf16 row [1, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16, "linear_1row: weight must be contiguous bf16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const at::BFloat16* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kBFloat16, "linear_1row: bias must be bf16 [N]");
    bp = b.data_ptr<at::BFloat16>();
  }
  auto out = at::empty({1, N}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t quads = (N + 3) / 4;
  // grain: 64 quads (256 rows, >= 288 KiB of weights at K 576) per thread's share at least
  at::parallel_for(0, quads, 64, [&](int64_t begin, int64_t end) {
    rows(xp, wp, bp, op, K, begin * 4, std::min(N, end * 4));
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("has_linear_1row() -> bool", &has_linear_1row);
  m.def("linear_1row(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("linear_1row", &linear_1row); }
