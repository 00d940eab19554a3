// quant_linear with 8-bit activations on AVX2 (llama.cpp's Q8 activations, on astrai's tile
// layout as it is): each row of x is quantized per group of the weight's columns to int8 codes
// with one float32 scale (amax / 127, round to nearest), the dot products run in integers on the
// weight's own codes, and each group's int32 sum is scaled once in float32: y[n] = sum_g (ws[n,g] *
// xs[g] * S[n,g] + min[n,g] * X[g]), X[g] the float32 sum of the row's unquantized group (as the
// float32 kernel takes it). 4-bit codes stay bytes: `vpmaddubsw` multiplies a chunk's 16 rows by
// two columns of the row's int8 codes an instruction (signed Q4_0 codes read as code + 8, 0..15,
// and 8 times the row's code sum taken off S). 8-bit codes are widened to 16 bits and multiplied
// by pairs of the row's codes with `vpmaddwd` (8 rows by two columns an instruction). Every sum is
// exact in integers, so against quant_avx2.cpp's float32 kernel no code is converted to float32
// and an instruction covers two to four times the products; the price is the activations'
// rounding (at most half a step of amax / 127 per value), which is why it is an option. A row's
// result depends on that row alone.
#include "quant.h"

#if defined(ASTRAI_QUANT_AVX2)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace astrai_cpu::quant {
namespace {

// Tiles t .. t + U - 1 for M (<= 4) rows: q / q8 the first row's codes as int16 / int8 (stride ldq), d [M, groups]
// their scales, isum [M, groups] their code sums, xsum [M, groups] (mins only), out stride ldo.
template <int M, int U, int BITS, bool SIGNED>
void tiles(const int16_t* q, const int8_t* q8, int64_t ldq, const float* d, const int32_t* isum, const float* xsum,
           const uint8_t* packed, const Layout& L, const float* bias, float* out, int64_t ldo, int64_t t) {
  const int64_t G = L.group, n_groups = L.groups(), sb = L.scale_bytes();
  const int64_t code_off = sb * (1 + L.has_min);
  const bool f16 = L.f16 != 0;
  alignas(32) float acc[U][M][TILE] = {};  // in L1 (touched once a group): the registers hold the sums
  const __m256i mask = _mm256_set1_epi8(0x0F), flip8 = _mm256_set1_epi8(static_cast<char>(0x88));
  for (int64_t g = 0; g < n_groups; ++g) {
    const uint8_t* r[U];
    for (int u = 0; u < U; ++u) r[u] = record_at(packed, L, t + u, g);
    __m256i s[U][M][2];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) s[u][m][0] = s[u][m][1] = _mm256_setzero_si256();
    const int16_t* qg = q + g * G;
    // two columns (k, k + 1) of every tile's rows 0-7 (a) and 8-15 (b) as 16-bit pairs
    const auto pair = [&](int u, int64_t k, __m256i a, __m256i b) {
      for (int m = 0; m < M; ++m) {
        int32_t word;
        std::memcpy(&word, qg + m * ldq + k, sizeof(word));
        const __m256i xv = _mm256_set1_epi32(word);
        s[u][m][0] = _mm256_add_epi32(s[u][m][0], _mm256_madd_epi16(a, xv));
        s[u][m][1] = _mm256_add_epi32(s[u][m][1], _mm256_madd_epi16(b, xv));
      }
    };
    if constexpr (BITS == 4) {
      // The codes as bytes against the row's int8 codes by `vpmaddubsw`: 16-bit word j of a chunk
      // is row j's pair of columns (4dp + e, e = 0, 1: low nibbles; 4dp + 2 + e: high), so one
      // instruction takes two columns of all 16 rows. Words sum at most 2 x 2 x 15 x 127 = 7,620 a
      // chunk: four chunks fit int16, then they are widened into the int32 sums.
      const int8_t* xg = q8 + g * G;
      for (int64_t d0 = 0; d0 < G / 4; d0 += 4) {
        __m256i w16[U][M];
        for (int u = 0; u < U; ++u)
          for (int m = 0; m < M; ++m) w16[u][m] = _mm256_setzero_si256();
        for (int64_t dp = d0; dp < std::min<int64_t>(d0 + 4, G / 4); ++dp) {
          for (int u = 0; u < U; ++u) {
            __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[u] + code_off + dp * 32));
            if constexpr (SIGNED) v = _mm256_xor_si256(v, flip8);  // code + 8 in each nibble
            const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int m = 0; m < M; ++m) {
              int16_t x01, x23;
              std::memcpy(&x01, xg + m * ldq + 4 * dp, sizeof(x01));
              std::memcpy(&x23, xg + m * ldq + 4 * dp + 2, sizeof(x23));
              const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi16(x01)),
                                                    _mm256_maddubs_epi16(hi, _mm256_set1_epi16(x23)));
              w16[u][m] = _mm256_add_epi16(w16[u][m], both);
            }
          }
        }
        for (int u = 0; u < U; ++u)
          for (int m = 0; m < M; ++m) {
            s[u][m][0] = _mm256_add_epi32(s[u][m][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(w16[u][m])));
            s[u][m][1] = _mm256_add_epi32(s[u][m][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(w16[u][m], 1)));
          }
      }
    } else {
      for (int64_t p = 0; p < G / 2; ++p) {
        for (int u = 0; u < U; ++u) {
          const uint8_t* c = r[u] + code_off + p * 32;
          pair(u, 2 * p, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))),
               _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
        }
      }
    }
    for (int u = 0; u < U; ++u) {
      for (int h = 0; h < 2; ++h) {
        const __m256 sc = load8(r[u], f16, h);
        const __m256 mn = L.has_min ? load8(r[u] + sb, f16, h) : _mm256_setzero_ps();
        for (int m = 0; m < M; ++m) {
          __m256i si = s[u][m][h];
          if constexpr (SIGNED) si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * isum[m * n_groups + g]));
          const __m256 w = _mm256_mul_ps(sc, _mm256_set1_ps(d[m * n_groups + g]));
          __m256 a = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(si), _mm256_load_ps(acc[u][m] + 8 * h));
          if (L.has_min) a = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * n_groups + g]), a);
          _mm256_store_ps(acc[u][m] + 8 * h, a);
        }
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    const int64_t n0 = (t + u) * TILE, count = std::min<int64_t>(TILE, L.n - n0);
    for (int m = 0; m < M; ++m) {
      float* o = out + m * ldo + n0;
      for (int64_t j = 0; j < count; ++j) o[j] = acc[u][m][j] + (bias != nullptr ? bias[n0 + j] : 0.f);
    }
  }
}

template <int BITS, bool SIGNED>
void run(const int16_t* q, const int8_t* q8, const float* d, const int32_t* isum, int64_t M, const float* xsum,
         const uint8_t* packed, const Layout& L, const float* bias, float* out, const Around* around) {
  const int64_t ldq = L.k, G = L.groups();
  for_tiles(M, L, [&](auto m, auto u, int64_t r, int64_t t) {
    tiles<decltype(m)::value, decltype(u)::value, BITS, SIGNED>(q + r * ldq, q8 + r * ldq, ldq, d + r * G,
                                                                 isum + r * G, xsum == nullptr ? nullptr : xsum + r * G,
                                                                 packed, L, bias, out + r * L.n, L.n, t);
  }, around);
}

}  // namespace

void quantize_rows_q8(const float* x, int64_t M, int64_t k, int64_t group, int16_t* q, int8_t* q8, float* d,
                      int32_t* isum) {
  const int64_t G = k / group;
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xg = x + i * group;  // row i / G, group i % G: rows are contiguous
      float amax = 0.f;
      for (int64_t j = 0; j < group; ++j) amax = std::max(amax, std::fabs(xg[j]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < group; ++j) {
        const int16_t v = static_cast<int16_t>(std::nearbyint(xg[j] * inv));
        q[i * group + j] = v;
        q8[i * group + j] = static_cast<int8_t>(v);
        sum += v;
      }
      d[i] = scale;
      isum[i] = sum;
    }
  });
}

void linear_q8_avx2(const int16_t* q, const int8_t* q8, const float* d, const int32_t* isum, int64_t M, const float* xsum,
                    const uint8_t* packed, const Layout& L, const float* bias, float* out, const Around* around) {
  if (L.bits == 8) run<8, false>(q, q8, d, isum, M, xsum, packed, L, bias, out, around);
  else if (L.sign) run<4, true>(q, q8, d, isum, M, xsum, packed, L, bias, out, around);
  else run<4, false>(q, q8, d, isum, M, xsum, packed, L, bias, out, around);
}

}  // namespace astrai_cpu::quant
#endif
