// astrai_cpu::prefill_attention: causal attention of one fresh prompt (no cached prefix), bf16.
//
// q [n, Hq, D], k/v [n, Hkv, D] (rows may be strided: slices of the fused QKV output) ->
// o [n, Hq, D]; query i attends to keys 0..i. Grouped-query: query head h reads KV head
// h / (Hq / Hkv). Both products run on AVX512-BF16 dot instructions, 16 outputs x a pair of
// bf16 per instruction: K and V are first repacked (per KV head) so that one 64-byte load holds
// 16 keys x 2 dims (for q.k) or 16 dims x 2 keys (for p.v), and the pair of the other operand is
// broadcast. A work item is 8 query rows of one head against blocks of 32 keys with an online
// softmax (float32 max, sum and output); the probabilities are rounded to bf16 for p.v, as
// PyTorch's flash attention does for bf16 inputs. Items go to threads one at a time, the longest
// (last rows) first. SmolLM2's shapes, one 512-token prompt: about 4x PyTorch's SDPA on 2 cores.
//
// Built where the compiler targets AVX512-BF16 (has_prefill_attention()), for head dims 64 and
// 128; the backend keeps SDPA for everything else.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t ROWS = 8;   // query rows per work item
constexpr int64_t BLOCK = 32;  // keys per softmax block: two tiles of 16

#if defined(__AVX512BF16__)
// K of one KV head as [tiles of 16 keys][D / 2][16][2]; V as [pairs of keys][D / 16][16][2]; keys
// padded with zeros to a whole block (padded keys are never attended: they follow every query).
template <int D>
void pack_kv(const at::BFloat16* k, int64_t ldk, const at::BFloat16* v, int64_t ldv, int64_t n, int64_t padded,
             at::BFloat16* kp, at::BFloat16* vp) {
  std::memset(static_cast<void*>(kp), 0, padded * D * sizeof(at::BFloat16));
  std::memset(static_cast<void*>(vp), 0, padded * D * sizeof(at::BFloat16));
  for (int64_t key = 0; key < n; ++key) {
    const at::BFloat16* kr = k + key * ldk;
    const at::BFloat16* vr = v + key * ldv;
    const int64_t tile = key / 16, lane = key % 16, pair = key / 2, half = key % 2;
    for (int64_t d = 0; d < D; ++d) {
      kp[((tile * (D / 2) + d / 2) * 16 + lane) * 2 + d % 2] = kr[d];
      vp[((pair * (D / 16) + d / 16) * 16 + d % 16) * 2 + half] = vr[d];
    }
  }
}

// One item: rows r0 .. r0 + ROWS - 1 (those below n are stored) of query head h.
template <int D>
void attend_rows(const at::BFloat16* q, int64_t ldq, int64_t n, int64_t r0, const at::BFloat16* kp,
                 const at::BFloat16* vp, float scale, at::BFloat16* out, int64_t ldo) {
  constexpr int NT = D / 16;                  // 16-wide tiles of an output row
  constexpr int HALF = NT >= 8 ? 2 : 4;       // rows per p.v pass: HALF x NT accumulators
  alignas(64) at::BFloat16 qb[ROWS][D];       // the rows, zero past n
  alignas(64) float o[ROWS][D];
  alignas(64) int32_t pb[ROWS][BLOCK / 2];    // a block's probabilities as bf16 pairs
  float m[ROWS], l[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    if (r0 + r < n) {
      std::memcpy(qb[r], q + (r0 + r) * ldq, D * sizeof(at::BFloat16));
    } else {
      std::memset(static_cast<void*>(qb[r]), 0, sizeof(qb[r]));
    }
    std::fill(o[r], o[r] + D, 0.f);
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const int64_t last = std::min(n, r0 + ROWS) - 1;  // the last key any stored row sees
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b0 = 0; b0 <= last; b0 += BLOCK) {
    // scores of the block: s[r][t] holds keys b0 + 16 t .. + 15 of row r
    __m512 s[ROWS][2];
    for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const at::BFloat16* k0 = kp + (b0 / 16) * (D / 2) * 32;
    const at::BFloat16* k1 = k0 + (D / 2) * 32;
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(k0 + p * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(k1 + p * 32);
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, qb[r] + 2 * p, sizeof(pair));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], w0, x);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], w1, x);
      }
    }
    // online softmax; keys after the row are masked (causal; also every padded key)
    for (int r = 0; r < ROWS; ++r) {
      const __m512i row = _mm512_set1_epi32(static_cast<int32_t>(r0 + r - b0));
      const __mmask16 keep0 = _mm512_cmple_epi32_mask(lanes, row);
      const __mmask16 keep1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(16)), row);
      const __m512 v0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep0, _mm512_mul_ps(s[r][0], vscale));
      const __m512 v1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep1, _mm512_mul_ps(s[r][1], vscale));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(v0, v1)));
      const __m512 vm = _mm512_set1_ps(m_new);
      const __m512 p0 = _mm512_maskz_mov_ps(keep0, astrai_cpu::exp_ps(_mm512_sub_ps(v0, vm)));
      const __m512 p1 = _mm512_maskz_mov_ps(keep1, astrai_cpu::exp_ps(_mm512_sub_ps(v1, vm)));
      const float alpha = std::exp(m[r] - m_new);  // 0 for the first block (m = -inf)
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
      if (alpha != 1.f) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (int t = 0; t < NT; ++t) _mm512_store_ps(o[r] + 16 * t, _mm512_mul_ps(_mm512_load_ps(o[r] + 16 * t), va));
      }
      _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys in order, rounded to bf16
    }
    // o += p . v over the block's 16 pairs of keys
    const at::BFloat16* vb = vp + (b0 / 2) * NT * 32;
    for (int r = 0; r < ROWS; r += HALF) {
      __m512 acc[HALF][NT];
      for (int i = 0; i < HALF; ++i)
        for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
      for (int c = 0; c < BLOCK / 2; ++c) {
        __m512bh w[NT];
        for (int t = 0; t < NT; ++t) w[t] = (__m512bh)_mm512_loadu_si512(vb + (c * NT + t) * 32);
        for (int i = 0; i < HALF; ++i) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(pb[r + i][c]);
          for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], w[t], x);
        }
      }
      for (int i = 0; i < HALF; ++i)
        for (int t = 0; t < NT; ++t)
          _mm512_store_ps(o[r + i] + 16 * t, _mm512_add_ps(_mm512_load_ps(o[r + i] + 16 * t), acc[i][t]));
    }
  }
  for (int64_t r = 0; r < ROWS && r0 + r < n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int t = 0; t < NT; ++t) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[r] + 16 * t), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * ldo + 16 * t), (__m256i)h);
    }
  }
}

template <int D>
void prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), Hkv = k.size(1), group = Hq / Hkv;
  const int64_t padded = (n + BLOCK - 1) / BLOCK * BLOCK;
  auto packed = at::empty({2, Hkv, padded * D}, q.options());
  auto* kp = packed.data_ptr<at::BFloat16>();
  auto* vp = kp + Hkv * padded * D;
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* kin = k.data_ptr<at::BFloat16>();
  const auto* vin = v.data_ptr<at::BFloat16>();
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      pack_kv<D>(kin + g * D, k.stride(0), vin + g * D, v.stride(0), n, padded, kp + g * padded * D, vp + g * padded * D);
  });
  // items (head, row block), the longest first, handed out one at a time
  const int64_t blocks = (n + ROWS - 1) / ROWS, items = Hq * blocks;
  std::atomic<int64_t> next{0};
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t block = blocks - 1 - i / Hq, h = i % Hq, g = h / group;
      attend_rows<D>(qp + h * D, q.stride(0), n, block * ROWS, kp + g * padded * D, vp + g * padded * D,
                     static_cast<float>(scale), op + h * D, Hq * D);
    }
  });
}
#endif

}  // namespace

namespace astrai_cpu {

bool has_prefill_attention() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(has_prefill_attention(), "prefill_attention: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "prefill_attention: q [n, Hq, D], k/v [n, Hkv, D] with Hq a multiple of Hkv");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 only");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "prefill_attention: head dim 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2),
              "prefill_attention: heads must be contiguous (rows may be strided)");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
#if defined(__AVX512BF16__)
  if (q.size(2) == 64) {
    prefill<64>(q, k, v, scale, out);
  } else {
    prefill<128>(q, k, v, scale, out);
  }
#endif
  return out;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("has_prefill_attention() -> bool", &astrai_cpu::has_prefill_attention);
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("prefill_attention", &astrai_cpu::prefill_attention); }
