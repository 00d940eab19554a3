// astrai_cpu::paged_decode: one query token per request, K/V read straight from the pool.
//
// For each request b, attention of q[b] (all query heads) over the slots listed in
// req_to_token[rows[b], starts[b]:seq_lens[b]] of k_buffer/v_buffer ([size, n_kv_heads, head_dim]);
// starts (optional, int64 [B]; none: 0) is where a sliding-window layer's view begins.
// Nothing is gathered: each pool row (all KV heads of one slot) is read once for the scores
// and once for the values, prefetched ahead (pages are scattered, so the hardware prefetcher
// cannot follow them): the key rows into L2 three blocks of 16 positions ahead of their scores
// and into L1 one block ahead, and each block's value rows into L2 while its scores are
// computed, so that the values pass finds them there. Against key rows one block ahead into L1
// alone and values from memory, for 30 layers of 32 requests of 550 positions: 37 -> 26 ms with
// the pages scattered over the pool (a long-running server's), 29 -> 25 ms with each request's
// pages in order (a fresh pool's); 8% more with all rows in the cache (one layer's). bf16 scores (head dims that are a
// multiple of 32, AVX512-BF16 compilers) use dot instructions on the bf16 values, 16 positions
// at a time with their sums in one transposing reduction; otherwise rows are converted to
// float32. Values are always accumulated in float32.
// Grouped-query attention: every query head of a group uses the same row.
// An int8 pool (k_scale / v_scale given: astrai.kvcache.quant) keeps each slot's head as 8-bit
// values and one float32 scale; its rows are widened to float32 times their scale as they are
// read (a quarter of float32's bytes, half of bf16's, from memory), K's and V's independently.
//
// Work is cut into items of CHUNK positions of one request (split-K); each item keeps its
// own max, sum and weighted values, and a second pass combines them. The cut depends only on
// the request's own length, never on the batch: a request's result is the same alone or in
// any batch. float32 accumulation and softmax; output in the input dtype.
#include <torch/library.h>

#include "kernels.h"
#include "simd.h"
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t CHUNK = 128;    // positions per work item
constexpr int64_t PREFETCH = 16;  // rows ahead
constexpr int64_t FAR = 2;  // key rows go to L2 FAR + 1 blocks of 16 positions ahead of their scores

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An int8 row of `heads` heads of D values, each head times its scale (astrai.kvcache.quant).
inline void load_q8(const int8_t* __restrict src, const float* __restrict scale, float* __restrict dst, int64_t heads,
                    int64_t D) {
  for (int64_t g = 0; g < heads; ++g) {
    const float s = scale[g];
    for (int64_t d = 0; d < D; ++d) dst[g * D + d] = static_cast<float>(src[g * D + d]) * s;
  }
}

// bfloat16 -> float32 is a 16-bit shift: written out so that the compiler vectorises it.
inline void load_row(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// One layer's K or V pool as the kernel reads it: the model dtype's rows, or int8 rows and scales.
template <typename T>
struct Pool {
  const T* rows;
  const int8_t* q8;     // non-null: an int8 pool
  const float* scales;  // [size, Hkv] with q8
  int64_t W, heads, D;

  // the slot's row (and scales) on its way into L1; into L2 with fetch_l2
  void fetch(int64_t slot) const;
  void fetch_l2(int64_t slot) const;
  void load(int64_t slot, float* dst) const {
    if (q8 != nullptr)
      load_q8(q8 + slot * W, scales + slot * heads, dst, heads, D);
    else
      load_row(rows + slot * W, dst, W);
  }
};

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

template <typename T>
void Pool<T>::fetch(int64_t slot) const {
  if (q8 == nullptr) {
    prefetch(rows + slot * W, W * static_cast<int64_t>(sizeof(T)));
  } else {
    prefetch(q8 + slot * W, W);
    __builtin_prefetch(scales + slot * heads, 0, 3);
  }
}

inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

template <typename T>
void Pool<T>::fetch_l2(int64_t slot) const {
  if (q8 == nullptr) {
    prefetch_l2(rows + slot * W, W * static_cast<int64_t>(sizeof(T)));
  } else {
    prefetch_l2(q8 + slot * W, W);
    __builtin_prefetch(scales + slot * heads, 0, 2);
  }
}

// softmax_numerators(s, n): in place, s[l] = exp(s[l] - max(s)) for l < n; returns (max, sum of
// the new s). AVX-512: 16 lanes at a time with exp_ps (a glibc expf call per score, with its AVX
// state transitions, had been most of the kernel's time); elsewhere std::exp.
#if defined(__AVX512F__)
inline std::pair<float, float> softmax_numerators(float* s, int64_t n) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 keep = n - l >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - l)) - 1);
    vm = _mm512_mask_max_ps(vm, keep, vm, _mm512_maskz_loadu_ps(keep, s + l));
  }
  const float m = _mm512_reduce_max_ps(vm);
  vm = _mm512_set1_ps(m);
  __m512 vz = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 keep = n - l >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - l)) - 1);
    const __m512 e = astrai_cpu::exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + l), vm));
    _mm512_mask_storeu_ps(s + l, keep, e);
    vz = _mm512_mask_add_ps(vz, keep, vz, e);
  }
  return {m, _mm512_reduce_add_ps(vz)};
}
#elif defined(__AVX2__) && defined(__FMA__)
inline std::pair<float, float> softmax_numerators(float* s, int64_t n) {
  float m = s[0];
  for (int64_t l = 1; l < n; ++l) m = std::max(m, s[l]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vz = _mm256_setzero_ps();
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    const __m256 e = astrai_cpu::exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + l), vm));
    _mm256_storeu_ps(s + l, e);
    vz = _mm256_add_ps(vz, e);
  }
  alignas(32) float tail[8] = {};
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vz);
  float z = 0.f;
  for (int i = 0; i < 8; ++i) z += lanes[i];
  if (l < n) {
    for (int64_t i = l; i < n; ++i) tail[i - l] = s[i] - m;
    _mm256_store_ps(tail, astrai_cpu::exp256_ps(_mm256_load_ps(tail)));
    for (int64_t i = l; i < n; ++i) {
      s[i] = tail[i - l];
      z += s[i];
    }
  }
  return {m, z};
}
#else
inline std::pair<float, float> softmax_numerators(float* s, int64_t n) {
  float m = s[0];
  for (int64_t l = 1; l < n; ++l) m = std::max(m, s[l]);
  float z = 0.f;
  for (int64_t l = 0; l < n; ++l) {
    s[l] = std::exp(s[l] - m);
    z += s[l];
  }
  return {m, z};
}
#endif

#if defined(__AVX512BF16__)
// The 16 horizontal sums of v[0..15], as the 16 lanes of one vector (in order): a transposing
// tree of unpacks and 128-bit shuffles, about 3 instructions per sum instead of ~9 for a
// separate reduction of each vector.
inline __m512 reduce16(const __m512* v) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#endif

// Scores of n positions for all Hq heads (scores[h * n + l] = scale * q_h . k_l) with AVX512-BF16
// dot instructions on the bf16 values themselves (exact products, float32 sums), 16 positions
// at a time, their sums by reduce16. Returns false (nothing written) where it does not apply:
// another dtype or head dim, or a compiler without AVX512-BF16.
template <typename T, int HD>
bool bf16_scores(const T* q, const T* k_pool, const T* v_pool, const int32_t* slots, int64_t n, int64_t Hq, int64_t Hkv,
                 float scale, float* scores) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 32 == 0) {
    constexpr int NV = HD / 32;
    const int64_t group = Hq / Hkv, W = Hkv * HD;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p = 0; p < std::min<int64_t>(n, 16); ++p)  // the first block's rows into L1, the next FAR into L2
      prefetch(k_pool + static_cast<int64_t>(slots[p]) * W, W * sizeof(T));
    for (int64_t p = 16; p < std::min<int64_t>(n, 16 * (FAR + 1)); ++p)
      prefetch_l2(k_pool + static_cast<int64_t>(slots[p]) * W, W * sizeof(T));
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
      const int64_t count = std::min<int64_t>(16, n - l0);
      for (int64_t p = 16; p < 32 && l0 + p < n; ++p)  // the next block's rows into L1
        prefetch(k_pool + static_cast<int64_t>(slots[l0 + p]) * W, W * sizeof(T));
      for (int64_t p = 16 * (FAR + 1); p < 16 * (FAR + 2) && l0 + p < n; ++p)  // the rows FAR + 1 blocks ahead into L2
        prefetch_l2(k_pool + static_cast<int64_t>(slots[l0 + p]) * W, W * sizeof(T));
      for (int64_t p = 0; p < count; ++p)  // this block's value rows, into L2 for the values pass
        prefetch_l2(v_pool + static_cast<int64_t>(slots[l0 + p]) * W, W * sizeof(T));
      for (int64_t g = 0; g < Hkv; ++g) {
        const T* rows[16];
        for (int64_t p = 0; p < 16; ++p)  // a short last block repeats its last row (lanes not stored)
          rows[p] = k_pool + static_cast<int64_t>(slots[l0 + std::min(p, count - 1)]) * W + g * HD;
        for (int64_t j = 0; j < group; ++j) {
          const int64_t h = g * group + j;
          __m512bh qv[NV];
          for (int v = 0; v < NV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(q + h * HD + v * 32);
          __m512 part[16];
          for (int p = 0; p < 16; ++p) {
            __m512 a = _mm512_setzero_ps();
            for (int v = 0; v < NV; ++v) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(rows[p] + v * 32), qv[v]);
            part[p] = a;
          }
          const __mmask16 keep = count == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
          _mm512_mask_storeu_ps(scores + h * n + l0, keep, _mm512_mul_ps(reduce16(part), vscale));
        }
      }
    }
    return true;
  }
#endif
  (void)q; (void)k_pool; (void)v_pool; (void)slots; (void)n; (void)Hq; (void)Hkv; (void)scale; (void)scores;
  return false;
}

#if defined(__AVX512F__)
// The weighted values of HC query heads of one KV group (h0 .. h0 + HC - 1; their segment of each
// row starts at off) over n positions, NV x 16 dims of them, in HC x NV float32 registers: each
// bf16 value row is converted once for the heads that share it, and no accumulator goes through
// memory. Head h's dims land at acc + h * ld.
template <int HC, int NV>
void values_chunk(const float* scores, int64_t h0, int64_t n, const c10::BFloat16* v_pool, const int32_t* slots,
                  int64_t W, int64_t off, bool first_pass, float* acc, int64_t ld) {
  __m512 a[HC][NV];
  for (int j = 0; j < HC; ++j)
    for (int i = 0; i < NV; ++i) a[j][i] = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    if (first_pass && l + PREFETCH < n)  // later passes find the rows in the cache
      prefetch(v_pool + static_cast<int64_t>(slots[l + PREFETCH]) * W, W * sizeof(c10::BFloat16));
    const auto* vr = reinterpret_cast<const __m256i*>(v_pool + static_cast<int64_t>(slots[l]) * W + off);
    __m512 v[NV];
    for (int i = 0; i < NV; ++i)  // bf16 -> float32: widen and shift into the high half
      v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(vr + i)), 16));
    for (int j = 0; j < HC; ++j) {
      const __m512 p = _mm512_set1_ps(scores[(h0 + j) * n + l]);
      for (int i = 0; i < NV; ++i) a[j][i] = _mm512_fmadd_ps(p, v[i], a[j][i]);
    }
  }
  for (int j = 0; j < HC; ++j)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + (h0 + j) * ld + i * 16, a[j][i]);
}
#endif

// acc [Hq, HD] = the probability-weighted sum of the n value rows, for bf16 pools and head dims
// that are a multiple of 16 up to 128, or of 128 (Gemma's 256: two passes of 128 dims), on AVX-512
// (heads in register-sized chunks of one KV group); false (nothing written) elsewhere.
template <typename T, int HD>
bool bf16_values(const float* scores, const T* v_pool, const int32_t* slots, int64_t n, int64_t Hq, int64_t Hkv,
                 float* acc) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 16 == 0 && (HD <= 128 || HD % 128 == 0)) {
    constexpr int DC = HD <= 128 ? HD : 128;  // dims a pass
    constexpr int NV = DC / 16;
    constexpr int MAX_HEADS = NV >= 4 ? 16 / NV : 4;  // at most 16 accumulators, at most 4 heads (the cases below)
    const int64_t group = Hq / Hkv, W = Hkv * HD;
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t d0 = 0; d0 < HD; d0 += DC) {
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += MAX_HEADS) {
          const bool first = g == 0 && d0 == 0 && h0 == 0;
          const int64_t off = g * HD + d0;
          float* at = acc + d0;
          switch (std::min<int64_t>(MAX_HEADS, (g + 1) * group - h0)) {
            case 1: values_chunk<1, NV>(scores, h0, n, v_pool, slots, W, off, first, at, HD); break;
            case 2: values_chunk<2, NV>(scores, h0, n, v_pool, slots, W, off, first, at, HD); break;
            case 3: if constexpr (MAX_HEADS >= 3) values_chunk<3, NV>(scores, h0, n, v_pool, slots, W, off, first, at, HD); break;
            default: if constexpr (MAX_HEADS >= 4) values_chunk<4, NV>(scores, h0, n, v_pool, slots, W, off, first, at, HD); break;
          }
        }
      }
    }
    return true;
  }
#endif
  (void)scores; (void)v_pool; (void)slots; (void)n; (void)Hq; (void)Hkv; (void)acc;
  return false;
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 values of a pool row from element `at`, as float32: float32 rows as they are, bf16 ones widened,
// int8 ones converted (their scale is applied by the caller).
template <typename T, bool Q8>
inline __m256 row8(const Pool<T>& pool, int64_t slot, int64_t at) {
  if constexpr (Q8) {
    const auto* p = reinterpret_cast<const __m128i*>(pool.q8 + slot * pool.W + at);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p)));
  } else if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(pool.rows + slot * pool.W + at);
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(pool.rows + slot * pool.W + at);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
  }
}

// scores[h * n + l] = qf_h . k_l (times an int8 row's scale) for head dims that are a multiple of 8:
// each block of 8 positions leaves one 8-lane product per (head, position) in tmp [Hq, 8, 8], whose
// sums reduce8 turns into the block's 8 scores of a head at once. A key row's chunks are converted
// once for the query heads of its group (head dims up to 64; longer rows chunk by chunk per head).
template <typename T, int HD, bool Q8>
void avx2_scores(const float* qf, const Pool<T>& kp, const Pool<T>& vp, const int32_t* slots, int64_t n, int64_t Hq,
                 int64_t Hkv, float* scores, float* tmp) {
  constexpr int NV = HD / 8;
  const int64_t group = Hq / Hkv;
  for (int64_t l0 = 0; l0 < n; l0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - l0);
    for (int64_t p = 0; p < 8; ++p) {
      const int64_t l = l0 + std::min(p, count - 1);  // a short block repeats its last row
      if (p < count) {  // the key row PREFETCH positions ahead into L1; this value row into L2, for avx2_values
        if (l + PREFETCH < n) kp.fetch(slots[l + PREFETCH]);
        vp.fetch_l2(slots[l]);
      }
      const int64_t slot = slots[l];
      for (int64_t g = 0; g < Hkv; ++g) {
        if constexpr (NV <= 8) {
          __m256 k[NV];
          for (int i = 0; i < NV; ++i) k[i] = row8<T, Q8>(kp, slot, g * HD + 8 * i);
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const float* q = qf + h * HD;
            __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), k[0]), a1 = _mm256_setzero_ps();
            for (int i = 1; i < NV; ++i) {
              if (i % 2) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), k[i], a1);
              else a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), k[i], a0);
            }
            _mm256_storeu_ps(tmp + (h * 8 + p) * 8, _mm256_add_ps(a0, a1));
          }
        } else {
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const float* q = qf + h * HD;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int i = 0; i < NV; i += 2) {
              a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), row8<T, Q8>(kp, slot, g * HD + 8 * i), a0);
              a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i + 8), row8<T, Q8>(kp, slot, g * HD + 8 * i + 8), a1);
            }
            _mm256_storeu_ps(tmp + (h * 8 + p) * 8, _mm256_add_ps(a0, a1));
          }
        }
      }
    }
    alignas(32) float out[8];
    alignas(32) float scale[8];
    for (int64_t g = 0, h = 0; g < Hkv; ++g) {
      if constexpr (Q8)  // the 8 rows' scales of KV group g, gathered once for the group's heads
        for (int64_t p = 0; p < 8; ++p) scale[p] = kp.scales[static_cast<int64_t>(slots[l0 + std::min(p, count - 1)]) * Hkv + g];
      for (int64_t j = 0; j < group; ++j, ++h) {
        __m256 v[8];
        for (int p = 0; p < 8; ++p) v[p] = _mm256_loadu_ps(tmp + (h * 8 + p) * 8);
        __m256 sums = astrai_cpu::reduce8(v);
        if constexpr (Q8) sums = _mm256_mul_ps(sums, _mm256_load_ps(scale));
        if (count == 8) {
          _mm256_storeu_ps(scores + h * n + l0, sums);
        } else {
          _mm256_store_ps(out, sums);
          for (int64_t p = 0; p < count; ++p) scores[h * n + l0 + p] = out[p];
        }
      }
    }
  }
}

// The probability-weighted values of HC query heads (h0 ..) of KV group g over dims [8 c0, 8 (c0 + NC)),
// in HC x NC registers; an int8 pool's probabilities come with each row's scale folded in
// (avx2_fold_scales).
template <typename T, int HC, int NC, bool Q8>
void avx2_values_chunk(const float* scores, const Pool<T>& vp, const int32_t* slots, int64_t n, int64_t h0, int64_t g,
                       int64_t off, bool first_pass, float* acc, int64_t HD) {
  __m256 a[HC][NC];
  for (int j = 0; j < HC; ++j)
    for (int i = 0; i < NC; ++i) a[j][i] = _mm256_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    if (first_pass && l + PREFETCH < n) vp.fetch(slots[l + PREFETCH]);
    const int64_t slot = slots[l];
    __m256 v[NC];
    for (int i = 0; i < NC; ++i) v[i] = row8<T, Q8>(vp, slot, g * HD + off + 8 * i);
    for (int j = 0; j < HC; ++j) {  // (an int8 row's scale is in its probabilities already)
      const __m256 p = _mm256_broadcast_ss(scores + (h0 + j) * n + l);
      for (int i = 0; i < NC; ++i) a[j][i] = _mm256_fmadd_ps(p, v[i], a[j][i]);
    }
  }
  for (int j = 0; j < HC; ++j)
    for (int i = 0; i < NC; ++i) _mm256_storeu_ps(acc + (h0 + j) * HD + off + 8 * i, a[j][i]);
}

// An int8 V pool's row scales folded into the probabilities: scores[h * n + l] *= scale of l's row
// for h's KV group (once per position and head, not once per pass of avx2_values).
template <typename T>
void avx2_fold_scales(float* scores, const Pool<T>& vp, const int32_t* slots, int64_t n, int64_t Hq, int64_t Hkv) {
  const int64_t group = Hq / Hkv;
  for (int64_t l = 0; l < n; ++l) {
    const float* s = vp.scales + static_cast<int64_t>(slots[l]) * Hkv;
    for (int64_t g = 0, h = 0; g < Hkv; ++g)
      for (int64_t j = 0; j < group; ++j, ++h) scores[h * n + l] *= s[g];
  }
}

template <typename T, int HD, bool Q8>
void avx2_values(const float* scores, const Pool<T>& vp, const int32_t* slots, int64_t n, int64_t Hq, int64_t Hkv,
                 float* acc) {
  constexpr int NC = 2;  // 16 dims a pass, for up to 4 heads of a group: each row converted about once
  const int64_t group = Hq / Hkv;
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t off = 0; off < HD; off += 8 * NC)
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
        const bool first = g == 0 && off == 0 && h0 == 0;
        switch (std::min<int64_t>(4, (g + 1) * group - h0)) {
          case 1: avx2_values_chunk<T, 1, NC, Q8>(scores, vp, slots, n, h0, g, off, first, acc, HD); break;
          case 2: avx2_values_chunk<T, 2, NC, Q8>(scores, vp, slots, n, h0, g, off, first, acc, HD); break;
          case 3: avx2_values_chunk<T, 3, NC, Q8>(scores, vp, slots, n, h0, g, off, first, acc, HD); break;
          default: avx2_values_chunk<T, 4, NC, Q8>(scores, vp, slots, n, h0, g, off, first, acc, HD);
        }
      }
}
#endif

// Whether the AVX2 paths take a pool of T (int8, float32 or bf16 rows) with head dim HD.
template <typename T, int HD>
constexpr bool avx2_takes() {
#if defined(__AVX2__) && defined(__FMA__)
  return HD > 0 && HD % 32 == 0 && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
#else
  return false;
#endif
}

// HD: the head dim as a compile-time constant (inner loops fully unrolled), 0 = read at run time.
template <typename T, int HD>
void decode(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
            const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens,
            const int64_t* first, double scale, const at::Tensor& k_scale, const at::Tensor& v_scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k_buffer.size(1);
  const int64_t D = HD > 0 ? HD : q.size(2);
  const int64_t group = Hq / Hkv, W = Hkv * D;
  const int64_t* row_of = rows.data_ptr<int64_t>();
  // lens[b]: the positions request b attends (from first[b] on)
  std::vector<int64_t> lens(seq_lens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>() + B);
  if (first != nullptr)
    for (int64_t b = 0; b < B; ++b) lens[b] = std::max<int64_t>(lens[b] - first[b], 0);
  int64_t splits = 1;
  for (int64_t b = 0; b < B; ++b) splits = std::max(splits, (lens[b] + CHUNK - 1) / CHUNK);

  const T* qp = q.data_ptr<T>();
  const bool k8 = k_scale.defined(), v8 = v_scale.defined();
  const T* kp = k8 ? nullptr : k_buffer.data_ptr<T>();
  const T* vp = v8 ? nullptr : v_buffer.data_ptr<T>();
  const Pool<T> kpool{kp, k8 ? k_buffer.data_ptr<int8_t>() : nullptr, k8 ? k_scale.data_ptr<float>() : nullptr, W, Hkv, D};
  const Pool<T> vpool{vp, v8 ? v_buffer.data_ptr<int8_t>() : nullptr, v8 ? v_scale.data_ptr<float>() : nullptr, W, Hkv, D};
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t table_stride = req_to_token.stride(0);
  const float fscale = static_cast<float>(scale);
  // partials of item (b, s): acc [Hq, D], max [Hq], sum [Hq]; an empty item keeps sum 0
  // (acc and max are read only where an item wrote them, its sum > 0: not zero-filled, which was
  // 6% of a 32-row step's attention with the K/V in cache)
  const std::unique_ptr<float[]> part_acc(new float[B * splits * Hq * D]), part_max(new float[B * splits * Hq]);
  std::vector<float> part_sum(B * splits * Hq, 0.f);

  // The non-empty items, handed out one at a time (a static split of the item range left one
  // thread with the long requests); which thread computes an item never changes its result.
  std::vector<int64_t> work;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s * CHUNK < lens[b]; ++s) work.push_back(b * splits + s);
  const int64_t n_work = static_cast<int64_t>(work.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_work), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(Hq * D), row(W), scores, tmp;
    for (int64_t i = next++; i < n_work; i = next++) {
      const int64_t item = work[i];
      const int64_t b = item / splits, lo = (item % splits) * CHUNK;
      const int64_t n = std::min(lens[b], lo + CHUNK) - lo;
      const int32_t* slots = table + row_of[b] * table_stride + (first != nullptr ? first[b] : 0) + lo;
      load_row(qp + b * Hq * D, qf.data(), Hq * D);
      for (auto& x : qf) x *= fscale;
      scores.resize(Hq * n);
      if (k8 || v8 || !bf16_scores<T, HD>(qp + b * Hq * D, kp, vp, slots, n, Hq, Hkv, fscale, scores.data())) {
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (avx2_takes<T, HD>()) {
          tmp.resize(Hq * 64);
          if (k8)
            avx2_scores<T, HD, true>(qf.data(), kpool, vpool, slots, n, Hq, Hkv, scores.data(), tmp.data());
          else
            avx2_scores<T, HD, false>(qf.data(), kpool, vpool, slots, n, Hq, Hkv, scores.data(), tmp.data());
        } else
#endif
        for (int64_t l = 0; l < n; ++l) {
          if (l + PREFETCH < n) kpool.fetch(slots[l + PREFETCH]);
          kpool.load(slots[l], row.data());
          for (int64_t h = 0; h < Hq; ++h) {
            const float* __restrict k = row.data() + (h / group) * D;
            const float* __restrict qq = qf.data() + h * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qq[d] * k[d];
            scores[h * n + l] = dot;
          }
        }
      }
      for (int64_t l = 0; l < std::min(n, PREFETCH); ++l)  // the values' first rows, while the softmax runs
        vpool.fetch(slots[l]);
      float* mx = part_max.get() + item * Hq;
      float* sum = part_sum.data() + item * Hq;
      for (int64_t h = 0; h < Hq; ++h) std::tie(mx[h], sum[h]) = softmax_numerators(scores.data() + h * n, n);
      float* acc = part_acc.get() + item * Hq * D;
      if (!v8 && bf16_values<T, HD>(scores.data(), vp, slots, n, Hq, Hkv, acc)) continue;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (avx2_takes<T, HD>()) {
        if (v8) avx2_fold_scales<T>(scores.data(), vpool, slots, n, Hq, Hkv);
        if (v8)
          avx2_values<T, HD, true>(scores.data(), vpool, slots, n, Hq, Hkv, acc);
        else
          avx2_values<T, HD, false>(scores.data(), vpool, slots, n, Hq, Hkv, acc);
        continue;
      }
#endif
      std::fill(acc, acc + Hq * D, 0.f);
      for (int64_t l = 0; l < n; ++l) {
        if (l + PREFETCH < n) vpool.fetch(slots[l + PREFETCH]);
        vpool.load(slots[l], row.data());
        for (int64_t h = 0; h < Hq; ++h) {
          const float p = scores[h * n + l];
          const float* __restrict v = row.data() + (h / group) * D;
          float* __restrict a = acc + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
    }
  });

  T* op = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        float m = -INFINITY;
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t i = (b * splits + s) * Hq + h;
          if (part_sum[i] > 0.f) m = std::max(m, part_max[i]);
        }
        std::fill(o.begin(), o.end(), 0.f);
        float z = 0.f;
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t i = (b * splits + s) * Hq + h;
          if (part_sum[i] == 0.f) continue;
          const float w = std::exp(part_max[i] - m);
          z += w * part_sum[i];
          const float* a = part_acc.get() + i * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = z > 0.f ? 1.f / z : 0.f;  // an empty request (seq_len 0) gets zeros
        T* dst = op + (b * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
    }
  });
}

}  // namespace

namespace astrai_cpu {

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                        const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens,
                        double scale, const c10::optional<at::Tensor>& starts,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu(), "astrai_cpu::paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes(),
              "paged_decode: q [B, Hq, D], k_buffer/v_buffer [size, Hkv, D]");
  TORCH_CHECK(q.size(2) == k_buffer.size(2) && q.size(1) % k_buffer.size(1) == 0,
              "paged_decode: head dims differ or Hq is not a multiple of Hkv");
  // an int8 buffer comes with its scales [size, Hkv] (float32); any other is in q's dtype
  const auto scales_of = [&](const at::Tensor& buf, const c10::optional<at::Tensor>& s, const char* name) {
    if (buf.scalar_type() != at::kChar) {
      TORCH_CHECK(buf.scalar_type() == q.scalar_type() && !s.has_value(),
                  "paged_decode: ", name, " must be int8 with its scales, or in q's dtype without");
      return at::Tensor();
    }
    TORCH_CHECK(s.has_value() && s->scalar_type() == at::kFloat && s->dim() == 2 && s->size(0) == buf.size(0) &&
                    s->size(1) == buf.size(1),
                "paged_decode: an int8 ", name, " needs float32 scales [size, Hkv]");
    return s->contiguous();
  };
  const at::Tensor ks = scales_of(k_buffer, k_scale, "k_buffer"), vs = scales_of(v_buffer, v_scale, "v_buffer");
  TORCH_CHECK(q.is_contiguous() && k_buffer.is_contiguous() && v_buffer.is_contiguous(),
              "paged_decode: q, k_buffer and v_buffer must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "paged_decode: req_to_token must be int32 [rows, max_ctx] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: rows and seq_lens must be int64");
  const auto rows_c = rows.contiguous(), lens_c = seq_lens.contiguous();
  TORCH_CHECK(rows_c.numel() == q.size(0) && lens_c.numel() == q.size(0), "paged_decode: one row and length per request");
  at::Tensor starts_c;
  if (starts.has_value()) {
    TORCH_CHECK(starts->scalar_type() == at::kLong && starts->numel() == q.size(0),
                "paged_decode: starts must be int64, one per request");
    starts_c = starts->contiguous();
  }
  const int64_t* first = starts_c.defined() ? starts_c.data_ptr<int64_t>() : nullptr;
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    switch (q.size(2)) {
      case 64: decode<scalar_t, 64>(q, k_buffer, v_buffer, req_to_token, rows_c, lens_c, first, scale, ks, vs, out); break;
      case 128: decode<scalar_t, 128>(q, k_buffer, v_buffer, req_to_token, rows_c, lens_c, first, scale, ks, vs, out); break;
      case 256: decode<scalar_t, 256>(q, k_buffer, v_buffer, req_to_token, rows_c, lens_c, first, scale, ks, vs, out); break;
      default: decode<scalar_t, 0>(q, k_buffer, v_buffer, req_to_token, rows_c, lens_c, first, scale, ks, vs, out);
    }
  });
  return out;
}

}  // namespace astrai_cpu

TORCH_LIBRARY(astrai_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor rows, "
        "Tensor seq_lens, float scale, Tensor? starts=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("paged_decode", &astrai_cpu::paged_decode); }
