// astrai_cpu::linear_packed: y = x @ w.T (+ bias) for bf16 rows, the decode (and prefill) GEMM.
//
// The weight is packed once (`linear_pack`) into tiles of 16 output rows by pairs of k,
// [ceil(N/16), ceil(K/2), 16, 2], so that one 64-byte load feeds one AVX512-BF16 dot instruction
// (16 outputs x one pair of k) per row of x, the pair of x broadcast: no horizontal sums, weights
// read strictly in sequence, two tiles at a time for independent dependency chains, each stream
// prefetched 3 KB ahead. Rows go in blocks of 8 against a pair of tiles, which the first block
// reads from memory and the others from the cache. On a 2-core AVX512-BF16 machine (no AMX),
// SmolLM2's 120 layer GEMMs, against oneDNN's packed linear in the same script: 5.0 vs 6.3 ms at one
// row, 5.7 vs 7.2 at 8, 6.8 vs 8.7 at 16, 9.9 vs 12.1 at 32, 17 vs 20 at 64, equal from 256 rows
// (both at the dot instructions' peak, about 0.9 TFLOP/s). Each output is one float32 sum over k
// in order, the bias added, then rounded to bf16 once (as F.linear rounds), whatever the number
// of rows: a row's result never depends on the other rows. Built only where the compiler targets
// AVX512-BF16 (`has_linear_packed()`); elsewhere oneDNN keeps the linears.
#include <torch/library.h>

#include "kernels.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;
// Pairs of k (64 bytes of a tile each) ahead that the two weight streams are prefetched: 3 KB.
// The hardware prefetcher alone left 8 rows at 29 GB/s; with this, 39 GB/s (1 row: 40 -> 42).
constexpr int64_t PF = 48;

#if defined(__AVX512BF16__)
// Tiles [t0, t1) of the output for M rows of x (row stride ldx, an even number of columns K2 * 2);
// w: the packed data of tile t0, the others after it.
// The outputs are rounded to bf16 once, or stored in float32 (OutT float: an LM head's logits).
template <int M, typename OutT>
void tiles(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, const at::BFloat16* bias,
           OutT* out, int64_t N, int64_t K2, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; t += 2) {
    const int u_count = t + 1 < t1 ? 2 : 1;
    __m512 acc[2][M];
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    const at::BFloat16* w0 = w + (t - t0) * K2 * 2 * TILE;
    const at::BFloat16* w1 = w0 + K2 * 2 * TILE;
    if (u_count == 2) {
      for (int64_t kp = 0; kp < K2; ++kp) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (kp + PF) * 2 * TILE), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + (kp + PF) * 2 * TILE), _MM_HINT_T0);
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + kp * 2 * TILE);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w1 + kp * 2 * TILE);
        for (int m = 0; m < M; ++m) {
          int32_t pair;
          std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
          acc[0][m] = _mm512_dpbf16_ps(acc[0][m], v0, xb);
          acc[1][m] = _mm512_dpbf16_ps(acc[1][m], v1, xb);
        }
      }
    } else {
      for (int64_t kp = 0; kp < K2; ++kp) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (kp + PF) * 2 * TILE), _MM_HINT_T0);
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + kp * 2 * TILE);
        for (int m = 0; m < M; ++m) {
          int32_t pair;
          std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
          acc[0][m] = _mm512_dpbf16_ps(acc[0][m], v0, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    for (int u = 0; u < u_count; ++u) {
      const int64_t n0 = (t + u) * TILE, count = std::min<int64_t>(TILE, N - n0);
      const __mmask16 keep = count == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
      __m512 b = _mm512_setzero_ps();
      if (bias != nullptr) {
        const __m256i bits = _mm256_maskz_loadu_epi16(keep, bias + n0);
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
      }
      for (int m = 0; m < M; ++m) {
        const __m512 v = _mm512_add_ps(acc[u][m], b);
        if constexpr (std::is_same_v<OutT, float>) {
          _mm512_mask_storeu_ps(out + m * N + n0, keep, v);
        } else {
          _mm256_mask_storeu_epi16(out + m * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even
        }
      }
    }
  }
}
#endif

}  // namespace

namespace astrai_cpu {

bool has_linear_packed() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "linear_pack: weight must be a bf16 CPU matrix [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = (N + TILE - 1) / TILE * TILE, Kp = (K + 1) / 2 * 2;
  auto padded = at::zeros({Np, Kp}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({Np / TILE, TILE, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

template <typename OutT>
void packed_rows_as(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, const at::BFloat16* bias,
                    OutT* out, int64_t N, int64_t K2, int64_t t0, int64_t t1);

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                         bool float_out) {
  TORCH_CHECK(has_linear_packed(), "linear_packed: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_packed: x must be bf16 rows [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == TILE && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && n > 0 && n <= packed.size(0) * TILE &&
                  (x.size(1) + 1) / 2 == packed.size(1),
              "linear_packed: packed must come from linear_pack of an [n, K] weight");
  const at::BFloat16* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == at::kBFloat16, "linear_packed: bias must be bf16 [n]");
    bp = b.data_ptr<at::BFloat16>();
  }
  // an even number of contiguous columns: the pairs of k are read as 32-bit words
  const at::Tensor xs = x.size(1) % 2 ? at::constant_pad_nd(x, {0, 1}) : x.contiguous();
  const int64_t M = xs.size(0), K2 = packed.size(1), n_tiles = (n + TILE - 1) / TILE;
  // float_out: float32 outputs, the sums not rounded to bf16 (an LM head's logits)
  auto out = float_out ? logits_out(M, n) : at::empty({M, n}, x.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = xs.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const int64_t ldx = xs.stride(0);
  // in pairs of tiles; at least 8 pairs (256 outputs) per thread's share. Rows in blocks of 8: a
  // pair of tiles (two 16-row slices of the weight, K x 64 bytes) is read from memory for the
  // first block and from the cache for the second.
  at::parallel_for(0, (n_tiles + 1) / 2, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * 2; t < std::min(n_tiles, end * 2); t += 2) {
      if (float_out) {
        packed_rows_as(xp, ldx, M, wp + t * K2 * 2 * TILE, bp, out.data_ptr<float>(), n, K2, t, std::min(n_tiles, t + 2));
      } else {
        packed_rows_as(xp, ldx, M, wp + t * K2 * 2 * TILE, bp, out.data_ptr<at::BFloat16>(), n, K2, t, std::min(n_tiles, t + 2));
      }
    }
  });
#endif
  return out;
}

template <typename OutT>
void packed_rows_as(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, const at::BFloat16* bias,
                    OutT* out, int64_t N, int64_t K2, int64_t t0, int64_t t1) {
#if defined(__AVX512BF16__)
  for (int64_t r = 0; r < M; r += 8) {
    const at::BFloat16* xr = x + r * ldx;
    OutT* orow = out + r * N;
    switch (std::min<int64_t>(8, M - r)) {
      case 1: tiles<1, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      case 2: tiles<2, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      case 3: tiles<3, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      case 4: tiles<4, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      case 5: tiles<5, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      case 6: tiles<6, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      case 7: tiles<7, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
      default: tiles<8, OutT>(xr, ldx, w, bias, orow, N, K2, t0, t1); break;
    }
  }
#endif
}

void packed_rows(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, const at::BFloat16* bias,
                 at::BFloat16* out, int64_t N, int64_t K2, int64_t t0, int64_t t1) {
  packed_rows_as(x, ldx, M, w, bias, out, N, K2, t0, t1);
}


}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("has_linear_packed() -> bool", &astrai_cpu::has_linear_packed);
  m.def("linear_pack(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed, int n, Tensor? bias, bool float_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("linear_pack", &astrai_cpu::linear_pack);
  m.impl("linear_packed", &astrai_cpu::linear_packed);
}
