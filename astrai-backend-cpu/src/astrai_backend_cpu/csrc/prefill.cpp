// astrai_cpu::prefill_attention: causal attention of a step's prefill chunks, bf16, K/V from the pool.
//
// Chunk b is q_lens[b] query rows of one request starting at row q_starts[b] of q [T, Hq, D]
// (rows may be strided: a slice of the fused QKV output), at positions prefix_lens[b] ..
// prefix_lens[b] + q_lens[b] - 1 of the request; its keys and values are positions 0 .. of that
// request, read from k_buffer/v_buffer [size, Hkv, D] through req_to_token[rows[b]] (this step's
// own K/V are in the pool already). A fresh prompt is the chunk with prefix 0; a chunk after a
// cached prefix attends to the prefix too. Query i attends to positions up to its own; in a
// sliding window (window > 0) only the last `window` of them (position p sees p - window + 1 ..
// p, HF's sliding_window), so only the keys from the first one the chunk's row 0 sees (rounded
// down to a block) are packed, and a work item starts at the block of its first row's first key.
// Grouped-query: query head h reads KV head h / (Hq / Hkv).
//
// Both products run on AVX512-BF16 dot instructions, 16 outputs x a pair of bf16 per
// instruction: each chunk's K and V are first repacked per KV head so that one 64-byte load
// holds 16 keys x 2 dims (for q.k) or 16 dims x 2 keys (for p.v), and the pair of the other
// operand is broadcast. A work item is 8 query rows of one head of one chunk against blocks of 32
// keys with an online softmax (float32 max, sum and output); the probabilities are rounded to
// bf16 for p.v, as PyTorch's flash attention does for bf16 inputs. Items go to threads one at a
// time, those with the most keys first. SmolLM2's shapes, one 512-token prompt: 1.2 ms against
// SDPA's 4-6 ms on 2 cores.
//
// An int8 pool (k_scale / v_scale [size, Hkv] given: astrai.kvcache.quant) is read as q * scale
// rounded once to bf16, the values torch_native's reference attends to, as each key is packed; K's
// and V's independently.
//
// astrai_cpu::encoder_attention is the same work items without causality, for an encoder (BERT):
// each sequence of a packed batch attends to all of its own tokens, q, k and v read in place from
// the fused QKV projection's rows (no padding, no mask; MiniLM's head dim of 32 too).
//
// Built where the compiler targets AVX512-BF16 (has_prefill_attention()), for head dims 64, 128 and
// 256 (Gemma 3's; 32, 64 and 128 for the encoder); the backend keeps torch_native's paths for everything else.
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

// One prefill chunk as prefill_attention checked it (outside the #if: the checks run on every build).
struct Chunk {
  int64_t q0, n, start, keys, offset;  // first row of q, rows, prefix, keys (prefix + rows), offset in the packs
  int64_t k0;                          // the first key packed (a multiple of BLOCK; 0 without a window)
  const int32_t* slots;                // the request's slots from position 0
};

// One KV head of a layer's K or V pool: bf16 rows, or int8 rows and their scales (q8 non-null).
struct PoolHead {
  const at::BFloat16* rows;
  const int8_t* q8;
  const float* scales;  // the head's scale of slot s at scales[s * heads]
  int64_t W, heads;

  // the head's D values of `slot` as bf16: in the pool, or (int8) q * scale rounded into tmp
  template <int D>
  const at::BFloat16* row(int64_t slot, at::BFloat16* tmp) const {
    if (q8 == nullptr) return rows + slot * W;
    const int8_t* src = q8 + slot * W;
    const float s = scales[slot * heads];
    for (int d = 0; d < D; ++d) tmp[d] = at::BFloat16(static_cast<float>(src[d]) * s);
    return tmp;
  }
};

#if defined(__AVX512BF16__)
// r[0..15] (16 x 16 int32) transposed in place: unpacks within 128-bit lanes, then lane shuffles.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Keys 0 .. n - 1 of one KV head (pool rows through slots, head offset in) as K [tiles of 16
// keys][D / 2][16][2] and V [pairs of keys][D / 16][16][2], zero-padded to `padded` keys (padded
// keys are never attended: they follow every query). K: each tile's 16 rows, as pairs of dims,
// transposed in registers; V: each pair of rows interleaved 16 dims at a time.
template <int D>
void pack_kv(const PoolHead& kh, const PoolHead& vh, const int32_t* slots, int64_t n, int64_t padded, at::BFloat16* kp,
             at::BFloat16* vp) {
  alignas(64) at::BFloat16 tmp[16][D];  // an int8 pool's rows of one tile (K) or pair (V), as bf16
  for (int64_t tile = 0; tile < padded / 16; ++tile) {
    const at::BFloat16* rows[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t key = tile * 16 + i;
      rows[i] = key < n ? kh.row<D>(slots[key], tmp[i]) : nullptr;
    }
    for (int half = 0; half < D / 32; ++half) {  // 16 pairs of dims at a time
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_si512(rows[i] + half * 32) : _mm512_setzero_si512();
      transpose16(r);  // r[p]: pair p of the half for the 16 keys
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kp + ((tile * (D / 2) + half * 16 + p) * 16) * 2, r[p]);
    }
  }
  for (int64_t pair = 0; pair < padded / 2; ++pair) {
    const int64_t k0 = 2 * pair, k1 = k0 + 1;
    const at::BFloat16* a = k0 < n ? vh.row<D>(slots[k0], tmp[0]) : nullptr;
    const at::BFloat16* b = k1 < n ? vh.row<D>(slots[k1], tmp[1]) : nullptr;
    for (int t = 0; t < D / 16; ++t) {
      const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * t))) : _mm512_setzero_si512();
      const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * t))) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + ((pair * (D / 16) + t) * 16) * 2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// One item: rows r0 .. r0 + ROWS - 1 (those below n are stored) of one query head of a chunk whose
// row 0 is at position `start`; q and out point at that head of the chunk's row 0. kp/vp hold keys
// k0 onwards (k0 a multiple of BLOCK). window > 0: a row at position p sees p - window + 1 .. p only.
// causal false: every row sees all the chunk's keys, 0 .. start + n - 1 (an encoder's attention).
template <int D>
void attend_rows(const at::BFloat16* q, int64_t ldq, int64_t n, int64_t start, int64_t r0, const at::BFloat16* kp,
                 const at::BFloat16* vp, int64_t k0, int64_t window, bool causal, float scale, at::BFloat16* out,
                 int64_t ldo) {
  constexpr int NT = D / 16;                  // 16-wide tiles of an output row
  constexpr int TC = NT > 8 ? 8 : NT;         // tiles per p.v pass (D 256: two passes of 128 dims)
  constexpr int HALF = TC >= 8 ? 2 : 4;       // rows per p.v pass: HALF x TC accumulators
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
  const int64_t last = start + (causal ? std::min(n, r0 + ROWS) : n) - 1;  // the last key any stored row sees
  // a row at position p sees keys > p - span (no limit without a window); the first block holds the
  // first key row r0 sees
  const int64_t span = window > 0 ? window : int64_t{1} << 40;
  const int64_t b_first = std::max(k0, (start + r0 - span + 1) / BLOCK * BLOCK);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b0 = b_first; b0 <= last; b0 += BLOCK) {
    // scores of the block: s[r][t] holds keys b0 + 16 t .. + 15 of row r
    __m512 s[ROWS][2];
    for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const at::BFloat16* kt0 = kp + ((b0 - k0) / 16) * (D / 2) * 32;
    const at::BFloat16* kt1 = kt0 + (D / 2) * 32;
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(kt0 + p * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(kt1 + p * 32);
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, qb[r] + 2 * p, sizeof(pair));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], w0, x);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], w1, x);
      }
    }
    // online softmax; keys after the row are masked (causal; also every padded key), and keys
    // before its window
    for (int r = 0; r < ROWS; ++r) {
      const int64_t own = (causal ? start + r0 + r : start + n - 1) - b0;  // its last key, in block lanes
      const __m512i row = _mm512_set1_epi32(static_cast<int32_t>(own));
      const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(std::max<int64_t>(own - span, -1)));
      const __m512i lanes1 = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
      const __mmask16 keep0 = _mm512_cmple_epi32_mask(lanes, row) & _mm512_cmpgt_epi32_mask(lanes, lo);
      const __mmask16 keep1 = _mm512_cmple_epi32_mask(lanes1, row) & _mm512_cmpgt_epi32_mask(lanes1, lo);
      const __m512 v0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep0, _mm512_mul_ps(s[r][0], vscale));
      const __m512 v1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep1, _mm512_mul_ps(s[r][1], vscale));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(v0, v1)));
      // a row may see no key of this block yet (its window starts in a later one): m stays -inf,
      // its probabilities 0 (masked), and the exponents are taken from 0 instead of -inf - -inf
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;
      const __m512 vm = _mm512_set1_ps(m_ref);
      const __m512 p0 = _mm512_maskz_mov_ps(keep0, astrai_cpu::exp_ps(_mm512_sub_ps(v0, vm)));
      const __m512 p1 = _mm512_maskz_mov_ps(keep1, astrai_cpu::exp_ps(_mm512_sub_ps(v1, vm)));
      const float alpha = std::exp(m[r] - m_ref);  // 0 while m = -inf
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = m_new;
      if (alpha != 1.f) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (int t = 0; t < NT; ++t) _mm512_store_ps(o[r] + 16 * t, _mm512_mul_ps(_mm512_load_ps(o[r] + 16 * t), va));
      }
      _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys in order, rounded to bf16
    }
    // o += p . v over the block's 16 pairs of keys
    const at::BFloat16* vb = vp + ((b0 - k0) / 2) * NT * 32;
    for (int tc = 0; tc < NT; tc += TC)
      for (int r = 0; r < ROWS; r += HALF) {
        __m512 acc[HALF][TC];
        for (int i = 0; i < HALF; ++i)
          for (int t = 0; t < TC; ++t) acc[i][t] = _mm512_setzero_ps();
        for (int c = 0; c < BLOCK / 2; ++c) {
          __m512bh w[TC];
          for (int t = 0; t < TC; ++t) w[t] = (__m512bh)_mm512_loadu_si512(vb + (c * NT + tc + t) * 32);
          for (int i = 0; i < HALF; ++i) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pb[r + i][c]);
            for (int t = 0; t < TC; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], w[t], x);
          }
        }
        for (int i = 0; i < HALF; ++i)
          for (int t = 0; t < TC; ++t) {
            float* dst = o[r + i] + 16 * (tc + t);
            _mm512_store_ps(dst, _mm512_add_ps(_mm512_load_ps(dst), acc[i][t]));
          }
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

struct Item {
  int64_t chunk, r0, head, keys;
};

// Attention of `chunks` (query head h of chunk c's row r at q + (c.q0 + r) * ldq + h * D; out the
// same at ldo) over keys whose KV head g is head(g, false) for K and head(g, true) for V.
template <int D, typename Head>
void attend_chunks(const at::BFloat16* qp, int64_t ldq, int64_t Hq, int64_t Hkv, const std::vector<Chunk>& chunks,
                   const Head& head, int64_t window, bool causal, double scale, at::BFloat16* op, int64_t ldo,
                   const at::TensorOptions& options) {
  const int64_t group = Hq / Hkv, B = static_cast<int64_t>(chunks.size());
  const auto packed_keys = [](const Chunk& c) { return (c.keys - c.k0 + BLOCK - 1) / BLOCK * BLOCK; };
  const int64_t total = chunks.empty() ? 0 : chunks.back().offset + packed_keys(chunks.back());
  auto packed = at::empty({2, Hkv, total * D}, options);
  auto* kp = packed.data_ptr<at::BFloat16>();
  auto* vp = kp + Hkv * total * D;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i / Hkv];
      const int64_t g = i % Hkv;
      pack_kv<D>(head(g, false), head(g, true), c.slots + c.k0, c.keys - c.k0, packed_keys(c),
                 kp + (g * total + c.offset) * D, vp + (g * total + c.offset) * D);
    }
  });
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r0 = 0; r0 < chunks[b].n; r0 += ROWS) {
      // up to its last row's key (every key of the chunk without causality)
      const int64_t keys = chunks[b].start + (causal ? std::min(chunks[b].n, r0 + ROWS) : chunks[b].n);
      const int64_t seen = window > 0 ? std::min(keys, window + ROWS - 1) : keys;
      for (int64_t h = 0; h < Hq; ++h) items.push_back({b, r0, h, seen});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n_items; i = next++) {
      const Item& it = items[i];
      const Chunk& c = chunks[it.chunk];
      const int64_t g = it.head / group;
      attend_rows<D>(qp + c.q0 * ldq + it.head * D, ldq, c.n, c.start, it.r0, kp + (g * total + c.offset) * D,
                     vp + (g * total + c.offset) * D, c.k0, window, causal, static_cast<float>(scale),
                     op + c.q0 * ldo + it.head * D, ldo);
    }
  });
}

template <int D>
void prefill(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& k_scale,
             const at::Tensor& v_scale, const std::vector<Chunk>& chunks, int64_t window, double scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), Hkv = k_buffer.size(1), W = Hkv * D;
  // KV head g of a pool: its bf16 rows, or its int8 rows and scales
  const auto head = [&](int64_t g, bool value) {
    const at::Tensor& buf = value ? v_buffer : k_buffer;
    const at::Tensor& s = value ? v_scale : k_scale;
    if (!s.defined()) return PoolHead{buf.data_ptr<at::BFloat16>() + g * D, nullptr, nullptr, W, Hkv};
    return PoolHead{nullptr, buf.data_ptr<int8_t>() + g * D, s.data_ptr<float>() + g, W, Hkv};
  };
  attend_chunks<D>(q.data_ptr<at::BFloat16>(), q.stride(0), Hq, Hkv, chunks, head, window, true, scale,
                   out.data_ptr<at::BFloat16>(), Hq * D, q.options());
}

// An encoder's attention: qkv [T, 3 * H * D], each row its token's q | k | v; sequence b is rows
// starts[b] .. + lengths[b] - 1 and sees exactly those keys.
template <int D>
void encoder(const at::Tensor& qkv, const std::vector<Chunk>& chunks, int64_t heads, double scale, at::Tensor& out) {
  const auto* base = qkv.data_ptr<at::BFloat16>();
  const int64_t W = qkv.stride(0);
  const auto head = [&](int64_t g, bool value) {
    return PoolHead{base + (value ? 2 : 1) * heads * D + g * D, nullptr, nullptr, W, heads};
  };
  attend_chunks<D>(base, W, heads, heads, chunks, head, 0, false, scale, out.data_ptr<at::BFloat16>(), heads * D,
                   qkv.options());
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

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                             const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& q_starts,
                             const at::Tensor& q_lens, const at::Tensor& prefix_lens, double scale, int64_t window,
                             const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(has_prefill_attention(), "prefill_attention: built without AVX512-BF16");
  TORCH_CHECK(window >= 0 && window <= (int64_t{1} << 30), "prefill_attention: window must be in [0, 2^30] (0: none)");
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes() && q.size(2) == k_buffer.size(2) &&
                  k_buffer.size(1) > 0 && q.size(1) % k_buffer.size(1) == 0,
              "prefill_attention: q [T, Hq, D], k_buffer/v_buffer [size, Hkv, D] with Hq a multiple of Hkv");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "prefill_attention: bf16 only");
  // a pool is bf16, or int8 with its float32 scales [size, Hkv]
  const auto scales_of = [&](const at::Tensor& buf, const c10::optional<at::Tensor>& s) {
    if (!s.has_value()) {
      TORCH_CHECK(buf.scalar_type() == at::kBFloat16, "prefill_attention: a pool is bf16, or int8 with its scales");
      return at::Tensor();
    }
    TORCH_CHECK(buf.scalar_type() == at::kChar && s->scalar_type() == at::kFloat && s->dim() == 2 &&
                    s->size(0) == buf.size(0) && s->size(1) == buf.size(1),
                "prefill_attention: an int8 pool needs float32 scales [size, Hkv]");
    return s->contiguous();
  };
  const at::Tensor ks = scales_of(k_buffer, k_scale), vs = scales_of(v_buffer, v_scale);
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256, "prefill_attention: head dim 64, 128 or 256");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_buffer.is_contiguous() && v_buffer.is_contiguous(),
              "prefill_attention: q's heads and the buffers must be contiguous (q's rows may be strided)");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "prefill_attention: req_to_token must be int32 [rows, max_ctx] with contiguous rows");
  const int64_t B = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && q_starts.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong &&
                  prefix_lens.scalar_type() == at::kLong && q_starts.numel() == B && q_lens.numel() == B &&
                  prefix_lens.numel() == B, "prefill_attention: rows, q_starts, q_lens, prefix_lens: int64 [B]");
  const auto rows_c = rows.contiguous(), q0_c = q_starts.contiguous(), n_c = q_lens.contiguous(), p_c = prefix_lens.contiguous();
  const int64_t *row_of = rows_c.data_ptr<int64_t>(), *q0 = q0_c.data_ptr<int64_t>(), *n = n_c.data_ptr<int64_t>(),
                *pre = p_c.data_ptr<int64_t>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t size = k_buffer.size(0);
  std::vector<Chunk> chunks;
  int64_t offset = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t keys = pre[b] + n[b];
    TORCH_CHECK(n[b] >= 0 && pre[b] >= 0 && q0[b] >= 0 && q0[b] + n[b] <= q.size(0) && row_of[b] >= 0 &&
                    row_of[b] < req_to_token.size(0) && keys <= req_to_token.size(1),
                "prefill_attention: chunk ", b, " lies outside q or req_to_token");
    const int32_t* slots = table + row_of[b] * req_to_token.stride(0);
    for (int64_t key = 0; key < keys; ++key)
      TORCH_CHECK(slots[key] >= 0 && slots[key] < size, "prefill_attention: chunk ", b, " has a slot outside the pool");
    if (n[b] == 0) continue;
    const int64_t k0 = window > 0 ? std::max<int64_t>(pre[b] - window + 1, 0) / BLOCK * BLOCK : 0;
    chunks.push_back({q0[b], n[b], pre[b], keys, offset, k0, slots});
    offset += (keys - k0 + BLOCK - 1) / BLOCK * BLOCK;
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#if defined(__AVX512BF16__)
  if (q.size(2) == 64) {
    prefill<64>(q, k_buffer, v_buffer, ks, vs, chunks, window, scale, out);
  } else if (q.size(2) == 128) {
    prefill<128>(q, k_buffer, v_buffer, ks, vs, chunks, window, scale, out);
  } else {
    prefill<256>(q, k_buffer, v_buffer, ks, vs, chunks, window, scale, out);
  }
#endif
  return out;
}

at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& lengths, int64_t heads, double scale) {
  TORCH_CHECK(has_prefill_attention(), "encoder_attention: built without AVX512-BF16");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 2 && qkv.stride(1) == 1,
              "encoder_attention: qkv must be bf16 [T, 3 * heads * head_dim] with contiguous rows");
  TORCH_CHECK(heads > 0 && qkv.size(1) % (3 * heads) == 0, "encoder_attention: qkv's width is not 3 * heads * head_dim");
  const int64_t D = qkv.size(1) / (3 * heads);
  TORCH_CHECK(D == 32 || D == 64 || D == 128, "encoder_attention: head dim 32, 64 or 128");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1, "encoder_attention: lengths must be int64 [B]");
  const auto lens = lengths.contiguous();
  const int64_t* n = lens.data_ptr<int64_t>();
  const int64_t T = qkv.size(0);
  std::vector<int32_t> slots(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) slots[t] = static_cast<int32_t>(t);
  std::vector<Chunk> chunks;
  int64_t row = 0, offset = 0;
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(n[b] >= 1 && row + n[b] <= T, "encoder_attention: lengths must be at least 1 and sum to qkv's rows");
    chunks.push_back({row, n[b], 0, n[b], offset, 0, slots.data() + row});
    row += n[b];
    offset += (n[b] + BLOCK - 1) / BLOCK * BLOCK;
  }
  TORCH_CHECK(row == T, "encoder_attention: lengths must be at least 1 and sum to qkv's rows");
  auto out = at::empty({T, heads * D}, qkv.options());
#if defined(__AVX512BF16__)
  if (D == 32) {
    encoder<32>(qkv, chunks, heads, scale, out);
  } else if (D == 64) {
    encoder<64>(qkv, chunks, heads, scale, out);
  } else {
    encoder<128>(qkv, chunks, heads, scale, out);
  }
#endif
  return out;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("encoder_attention(Tensor qkv, Tensor lengths, int heads, float scale) -> Tensor");
  m.def("has_prefill_attention() -> bool", &astrai_cpu::has_prefill_attention);
  m.def("prefill_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor rows, "
        "Tensor q_starts, Tensor q_lens, Tensor prefix_lens, float scale, int window=0, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("prefill_attention", &astrai_cpu::prefill_attention);
  m.impl("encoder_attention", &astrai_cpu::encoder_attention);
}
