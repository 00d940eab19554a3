// quant_linear and quant_weight_t on float32 for CPUs with AVX2, FMA and F16C but no AVX512-BF16
// (most consumer and many cloud machines): the tile layout of quant.h, a 16-row tile as two
// __m256 of 8 rows. Per output row and group, one float32 sum of code * x over the group's
// columns in order (the codes expanded to float32 in registers, fused multiply-adds), then
// scale * sum (+ min * the group's sum of x) into the running sum: the dequantized model's
// float32 product up to the order of the sums, the same for a row whatever rows come with it
// (the order depends neither on the row block nor on how many tiles run together).
#include "quant.h"

#if defined(ASTRAI_QUANT_AVX2)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace astrai_cpu::quant {
namespace {

// A 4-bit chunk's bytes of 8 rows widened (dword j = byte 2j | byte 2j+1 << 16), column C (0-3) of
// its four: the nibble at bit 0, 16, 4 or 20 of each dword, as float32.
template <bool SIGNED, int C>
inline __m256 nibble(__m256i d) {
  constexpr int at = C == 0 ? 0 : C == 1 ? 16 : C == 2 ? 4 : 20;
  const __m256i top = _mm256_slli_epi32(d, 28 - at);  // the bits above it are zero (bytes widened)
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_srai_epi32(top, 28) : _mm256_srli_epi32(top, 28));
}

// An 8-bit chunk's bytes of 8 rows sign-extended to words (dword j = word 2j | word 2j+1 << 16),
// column E (0 or 1) of its two, as float32.
template <int E>
inline __m256 byte_code(__m256i d) {
  return _mm256_cvtepi32_ps(E == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(d, 16), 16) : _mm256_srai_epi32(d, 16));
}

inline __m256i widen(const uint8_t* p, bool bits8) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return bits8 ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

// Tiles t .. t + U - 1 for M (<= 4) float32 rows: x the first row (stride ldx), xsum [M, groups]
// (nullptr without mins), out the first row's outputs (stride ldo). The group sums s (U x M x 2
// registers: at most 8, with the codes and a broadcast x within AVX2's 16) give each output one
// chain of fused multiply-adds per group; callers take U = 4, 2, 1 for M = 1, 2, 3-4, so that
// eight chains hide the latency whatever the rows. The running sums stay in L1 (touched once a group).
template <int M, int U, int BITS, bool SIGNED>
void tiles(const float* x, int64_t ldx, const float* xsum, const uint8_t* packed, const Layout& L,
           const float* bias, float* out, int64_t ldo, int64_t t) {
  const int64_t G = L.group, n_groups = L.groups(), sb = L.scale_bytes();
  const int64_t code_off = sb * (1 + L.has_min);
  const bool f16 = L.f16 != 0;
  alignas(32) float acc[U][M][TILE] = {};
  for (int64_t g = 0; g < n_groups; ++g) {
    const uint8_t* r[U];
    for (int u = 0; u < U; ++u) r[u] = record_at(packed, L, t + u, g);
    __m256 s[U][M][2];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) s[u][m][0] = s[u][m][1] = _mm256_setzero_ps();
    const float* xg = x + g * G;
    // one column of every tile: a (rows 0-7) and b (rows 8-15) of tile u, times x[m][k]
    const auto column = [&](int u, int64_t k, __m256 a, __m256 b) {
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(xg + m * ldx + k);
        s[u][m][0] = _mm256_fmadd_ps(a, xv, s[u][m][0]);
        s[u][m][1] = _mm256_fmadd_ps(b, xv, s[u][m][1]);
      }
    };
    if constexpr (BITS == 4) {
      for (int64_t dp = 0; dp < G / 4; ++dp) {
        for (int u = 0; u < U; ++u) {
          const uint8_t* c = r[u] + code_off + dp * 32;
          const __m256i lo = widen(c, false), hi = widen(c + 16, false);
          column(u, 4 * dp, nibble<SIGNED, 0>(lo), nibble<SIGNED, 0>(hi));
          column(u, 4 * dp + 1, nibble<SIGNED, 1>(lo), nibble<SIGNED, 1>(hi));
          column(u, 4 * dp + 2, nibble<SIGNED, 2>(lo), nibble<SIGNED, 2>(hi));
          column(u, 4 * dp + 3, nibble<SIGNED, 3>(lo), nibble<SIGNED, 3>(hi));
        }
      }
    } else {
      for (int64_t p = 0; p < G / 2; ++p) {
        for (int u = 0; u < U; ++u) {
          const uint8_t* c = r[u] + code_off + p * 32;
          const __m256i lo = widen(c, true), hi = widen(c + 16, true);
          column(u, 2 * p, byte_code<0>(lo), byte_code<0>(hi));
          column(u, 2 * p + 1, byte_code<1>(lo), byte_code<1>(hi));
        }
      }
    }
    for (int u = 0; u < U; ++u) {
      for (int h = 0; h < 2; ++h) {
        const __m256 sc = load8(r[u], f16, h);
        const __m256 mn = L.has_min ? load8(r[u] + sb, f16, h) : _mm256_setzero_ps();
        for (int m = 0; m < M; ++m) {
          __m256 a = _mm256_fmadd_ps(sc, s[u][m][h], _mm256_load_ps(acc[u][m] + 8 * h));
          if (L.has_min) a = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(xsum + m * n_groups + g), a);
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
void run(const float* x, int64_t M, const float* xsum, const uint8_t* packed, const Layout& L, const float* bias,
         float* out, const Around* around) {
  const int64_t ldx = L.k, G = L.groups();
  for_tiles(M, L, [&](auto m, auto u, int64_t r, int64_t t) {
    tiles<decltype(m)::value, decltype(u)::value, BITS, SIGNED>(
        x + r * ldx, ldx, xsum == nullptr ? nullptr : xsum + r * G, packed, L, bias, out + r * L.n, L.n, t);
  }, around);
}

// scale * code rounded, then + min rounded: gguf-py's order. The empty asm keeps the compiler
// (-ffast-math contracts) from fusing the two into one rounding.
inline __m256 weight(__m256 code, __m256 sc, __m256 mn, bool has_min) {
  __m256 v = _mm256_mul_ps(code, sc);
  __asm__("" : "+x"(v));
  return has_min ? _mm256_add_ps(v, mn) : v;
}

template <bool SIGNED>
void weight_t_tile(const uint8_t* tile, const Layout& L, float* out, int64_t n0) {
  const int64_t G = L.group, rec = L.record(), sb = L.scale_bytes(), n = L.n;
  const int64_t count = std::min<int64_t>(TILE, n - n0);
  const bool f16 = L.f16 != 0;
  for (int64_t g = 0; g < L.groups(); ++g) {
    const uint8_t* r = tile + g * rec;
    const uint8_t* codes = r + sb * (1 + L.has_min);
    __m256 sc[2], mn[2];
    for (int h = 0; h < 2; ++h) {
      sc[h] = load8(r, f16, h);
      mn[h] = L.has_min ? load8(r + sb, f16, h) : _mm256_setzero_ps();
    }
    const auto put = [&](int64_t k, __m256 a, __m256 b) {
      float* o = out + (g * G + k) * n + n0;
      a = weight(a, sc[0], mn[0], L.has_min), b = weight(b, sc[1], mn[1], L.has_min);
      if (count == TILE) {
        _mm256_storeu_ps(o, a);
        _mm256_storeu_ps(o + 8, b);
      } else {
        alignas(32) float tmp[TILE];
        _mm256_store_ps(tmp, a);
        _mm256_store_ps(tmp + 8, b);
        std::memcpy(o, tmp, count * sizeof(float));
      }
    };
    if (L.bits == 4) {
      for (int64_t dp = 0; dp < G / 4; ++dp) {
        const __m256i lo = widen(codes + dp * 32, false), hi = widen(codes + dp * 32 + 16, false);
        put(4 * dp, nibble<SIGNED, 0>(lo), nibble<SIGNED, 0>(hi));
        put(4 * dp + 1, nibble<SIGNED, 1>(lo), nibble<SIGNED, 1>(hi));
        put(4 * dp + 2, nibble<SIGNED, 2>(lo), nibble<SIGNED, 2>(hi));
        put(4 * dp + 3, nibble<SIGNED, 3>(lo), nibble<SIGNED, 3>(hi));
      }
    } else {
      for (int64_t p = 0; p < G / 2; ++p) {
        const __m256i lo = widen(codes + p * 32, true), hi = widen(codes + p * 32 + 16, true);
        put(2 * p, byte_code<0>(lo), byte_code<0>(hi));
        put(2 * p + 1, byte_code<1>(lo), byte_code<1>(hi));
      }
    }
  }
}

}  // namespace

void linear_f32_avx2(const float* x, int64_t M, const float* xsum, const uint8_t* packed, const Layout& L,
                     const float* bias, float* out, const Around* around) {
  if (L.bits == 8) run<8, false>(x, M, xsum, packed, L, bias, out, around);
  else if (L.sign) run<4, true>(x, M, xsum, packed, L, bias, out, around);
  else run<4, false>(x, M, xsum, packed, L, bias, out, around);
}

void weight_t_f32_avx2(const uint8_t* packed, const Layout& L, float* out) {
  at::parallel_for(0, L.tiles(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (L.sign && L.bits == 4) weight_t_tile<true>(packed + t * L.tile_bytes(), L, out, t * TILE);
      else weight_t_tile<false>(packed + t * L.tile_bytes(), L, out, t * TILE);
    }
  });
}

}  // namespace astrai_cpu::quant
#endif
