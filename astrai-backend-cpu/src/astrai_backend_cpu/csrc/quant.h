// The tile layout of the quantized linears (astrai.model.quant documents it), shared by quant.cpp
// (the ops, and their AVX512-BF16 code) and quant_avx2.cpp (their float32 code for AVX2 + FMA
// CPUs without AVX512-BF16).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The float32 kernels of quant_avx2.cpp: compiled where the compiler targets AVX2, FMA and F16C
// but not AVX512-BF16 (which has kernels of its own, for bf16 and float32 rows).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#define ASTRAI_QUANT_AVX2 1
#endif
// The 8-bit activation kernels of quant_q8_avx512.cpp: AVX512-BF16 builds whose CPU has AVX512-VNNI.
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ASTRAI_QUANT_VNNI 1
#endif

namespace astrai_cpu::quant {

constexpr int64_t TILE = 16;
// Bytes ahead that each tile's stream of group records is prefetched: into L1 3 KB ahead
// (linear.cpp's distance), and by the AVX-512 kernels (quant.cpp) into L2 12 KB ahead too, so
// that more of the stream is in flight from memory than L1's fill buffers hold (on an AMX Xeon,
// 2 cores, weights from memory: a whole decode step of the default model 7.7 -> 6.3 ms for 1 row,
// 12.7 -> 11.0 ms for 3). The AVX2 kernels (record_at) leave the far prefetch out: on 2 Zen 3
// cores it made the streams slower (gemma3-270m's 178 MB LM head, one int8 row: 7.1-7.3 ms with
// it, 5.8-6.4 without; 34.5 GB/s streams there), its targets being the next tiles' own streams.
constexpr int64_t PF_BYTES = 3072;
constexpr int64_t PF_FAR_BYTES = 12288;

// The layout's parameters, as astrai.model.quant.QuantLayout.ints(): n, k, bits, group, has_min,
// f16_scales, signed (4-bit codes read as -8..7 instead of 0..15; 8-bit codes are always int8),
// and int8_rows (float32 rows quantized to 8 bits per group for the products: quant_q8_avx2.cpp;
// an optional eighth integer, 0 where it is left out).
//
// f16 == 2 (K_SCALES): a K-quant's scales and mins as the file holds them (astrai.model.quant.
// narrow_scales; quant_linear on int8 rows only): per record one int8 factor a row for the scales
// (and one for the mins), and before each super-block's records (256 columns) a header of a float16
// factor a row for each: scale = header factor * record factor, exactly (both are small integers
// times a float16).
struct Layout {
  static constexpr int64_t K_SCALES = 2, SUPER = 256;
  int64_t n, k, bits, group, has_min, f16, sign, int8_rows = 0;
  int64_t groups() const { return k / group; }
  int64_t scale_bytes() const { return TILE * (f16 == K_SCALES ? 1 : f16 ? 2 : 4); }
  int64_t code_bytes() const { return TILE * group * bits / 8; }
  int64_t record() const { return scale_bytes() * (1 + has_min) + code_bytes(); }
  int64_t tiles() const { return (n + TILE - 1) / TILE; }
  // K_SCALES: a super-block's header, and its groups
  int64_t header() const { return f16 == K_SCALES ? TILE * 2 * (1 + has_min) : 0; }
  int64_t per_super() const { return SUPER / group; }
  int64_t tile_bytes() const {
    return groups() * record() + (f16 == K_SCALES ? groups() / per_super() * header() : 0);
  }
  // group g's record of tile t within packed, and (K_SCALES) its super-block's header
  const uint8_t* record_at(const uint8_t* packed, int64_t t, int64_t g) const {
    const uint8_t* tile = packed + t * tile_bytes();
    return f16 == K_SCALES ? tile + (g / per_super() + 1) * header() + g * record() : tile + g * record();
  }
  const uint8_t* header_at(const uint8_t* packed, int64_t t, int64_t g) const {
    return packed + t * tile_bytes() + (g / per_super()) * (header() + per_super() * record());
  }
};

// body(u0, u1) over units [0, units) of unit_cols output columns each (n in all): shared out by
// at::parallel_for (grain units at least per thread), or with around (kernels.h) in one region of
// the intra-op threads, each its even share, around's work before and after it.
template <typename Body>
void share(int64_t units, int64_t grain, int64_t unit_cols, int64_t n, const Around* around, const Body& body) {
  if (around == nullptr) {
    at::parallel_for(0, units, grain, body);
    return;
  }
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
    const int64_t c0 = std::min(n, u0 * unit_cols), c1 = std::min(n, u1 * unit_cols);
    around->before(t, nt, c0, c1);
#pragma omp barrier
    if (u0 < u1) body(u0, u1);
    around->after(c0, c1);
  }
}

#if defined(ASTRAI_QUANT_AVX2)
// 8 scales (or mins) of rows 8h .. 8h + 7 of a record's 16
inline __m256 load8(const uint8_t* p, bool f16, int h) {
  return f16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)))
             : _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
}

// Group g's record of tile t, its stream prefetched PF_BYTES ahead (into L1).
inline const uint8_t* record_at(const uint8_t* packed, const Layout& L, int64_t t, int64_t g) {
  const uint8_t* r = packed + t * L.tile_bytes() + g * L.record();
  for (int64_t line = 0; line < L.record(); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(r + PF_BYTES + line), _MM_HINT_T0);
  }
  return r;
}

template <int V>
using Int = std::integral_constant<int, V>;

// The AVX2 kernels' work: blocks of four tiles (64 outputs) shared out over the threads, each
// thread's share of the weight read once per step and once from memory whatever the rows (the
// block stays in L2 while the row blocks pass over it); rows in blocks of up to 4. For each, in
// order, tiles(Int<M>, Int<U>, r, t): rows r .. r + M - 1 against tiles t .. t + U - 1, U = 4, 2,
// 1 for M = 1, 2, 3-4 (so that eight dependency chains hide the latency whatever the rows).
template <typename Tiles>
void for_tiles(int64_t M, const Layout& L, Tiles&& tiles, const Around* around) {
  const int64_t n_tiles = L.tiles();
  share((n_tiles + 3) / 4, 1, 4 * TILE, L.n, around, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin * 4; t0 < std::min(n_tiles, end * 4); t0 += 4) {
      const int64_t t1 = std::min(n_tiles, t0 + 4);
      for (int64_t r = 0; r < M; r += 4) {
        const int64_t m = std::min<int64_t>(4, M - r);
        for (int64_t t = t0; t < t1;) {
          const int64_t left = t1 - t;
          if (m == 1 && left == 4) {
            tiles(Int<1>{}, Int<4>{}, r, t), t += 4;
          } else if (m <= 2 && left >= 2) {
            if (m == 1) tiles(Int<1>{}, Int<2>{}, r, t);
            else tiles(Int<2>{}, Int<2>{}, r, t);
            t += 2;
          } else {
            switch (m) {
              case 1: tiles(Int<1>{}, Int<1>{}, r, t); break;
              case 2: tiles(Int<2>{}, Int<1>{}, r, t); break;
              case 3: tiles(Int<3>{}, Int<1>{}, r, t); break;
              default: tiles(Int<4>{}, Int<1>{}, r, t); break;
            }
            t += 1;
          }
        }
      }
    }
  });
}

// quant_linear on float32 rows: x [M, k] (contiguous), xsum [M, groups] the groups' sums of x
// (nullptr without mins), bias [n] or nullptr -> out [M, n] float32.
void linear_f32_avx2(const float* x, int64_t M, const float* xsum, const uint8_t* packed, const Layout& L,
                     const float* bias, float* out, const Around* around = nullptr);
// quant_weight_t in float32: the weight dequantized, transposed, out [k, n].
void weight_t_f32_avx2(const uint8_t* packed, const Layout& L, float* out);

// quant_q8_avx2.cpp: x [M, k] float32 -> per row and group of `group` columns, 8-bit codes as
// int16 (q) and int8 (q8) [M, k], their scales d [M, k / group] and code sums isum [M, k / group].
void quantize_rows_q8(const float* x, int64_t M, int64_t k, int64_t group, int16_t* q, int8_t* q8, float* d,
                      int32_t* isum);
// quant_linear on rows quantized by quantize_rows_q8 (xsum as linear_f32_avx2 takes it).
void linear_q8_avx2(const int16_t* q, const int8_t* q8, const float* d, const int32_t* isum, int64_t M, const float* xsum,
                    const uint8_t* packed, const Layout& L, const float* bias, float* out,
                    const Around* around = nullptr);
#endif

#if defined(ASTRAI_QUANT_VNNI)
// Rows quantized for quant_q8_avx512.cpp, per row and group of the weight's columns: int8 codes,
// their float32 scale, offset x their sum (what the weight codes' offset adds to the group's
// integer sum: 8 for signed 4-bit codes, 128 for 8-bit ones, else 0), and the float32 sum of the
// unquantized group (layouts with mins).
struct Rows8 {
  const int8_t* q;      // [M, k]
  const float* d;       // [M, groups]
  const int32_t* off;   // [M, groups]
  const float* xsum;    // [M, groups] or nullptr
  int64_t k;
};
struct Rows8Buffers {  // (not zero-filled: every value is written before it is read)
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, xsum;
  std::unique_ptr<int32_t[]> off;
  Rows8 rows(int64_t k) const { return {q.get(), d.get(), off.get(), xsum.get(), k}; }
};
// x [M, k] (float or c10::BFloat16, contiguous) quantized into b; sums: the groups' float32 sums too.
template <typename T>
void quantize_rows_q8_512(const T* x, int64_t M, int64_t k, int64_t group, int32_t offset, bool sums, Rows8Buffers& b);
// quant_linear on rows quantized so: out [M, n] (B: the bias's and the rows' type; O: float, or
// c10::BFloat16 rounded once after the bias), its region shared with around's work.
template <typename B, typename O>
void linear_q8_512(const Rows8& x, int64_t M, const uint8_t* packed, const Layout& L, const B* bias, O* out,
                   const Around* around = nullptr);
#endif

}  // namespace astrai_cpu::quant
