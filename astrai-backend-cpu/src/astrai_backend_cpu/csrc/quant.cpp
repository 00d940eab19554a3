// astrai_cpu::quant_linear / quant_dequant: linears on GGUF-quantized weights, kept quantized.
//
// The weights come in astrai's tile layout of GGUF blocks (astrai.model.quant, which documents it
// and holds the reference implementation): per 16 output rows ("a tile") and per group of G input
// columns (G = 32, or 16 for Q6_K), a record [scales 16 x f16|f32][mins 16 x f16|f32, when the
// format has them][codes], the codes 4 bits (two per byte) or 8 bits, so that one 32-byte load
// expands to the operands of the AVX512-BF16 dot instruction for 16 outputs. The GGUF file's own
// codes and scales, rearranged: a row's weight k of group g is scale * code + min.
//
// quant_linear on bf16 rows: y[n] = sum_g (scale[n,g] * S[n,g] + min[n,g] * X[g]), where
// S[n,g] = sum over the group of code * x (the codes expanded to bf16 exactly in registers by a
// 32-entry table, dotted with the bf16 activations in float32: exact products) and X[g] = the
// group's sum of x; then the bias, and one rounding to bf16 (none with float_out: an LM head's
// logits, whose top two a bf16 rounding can tie). That is the dequantized model's
// product up to the order of the float32 sums (no 8-bit activations, unlike llama.cpp's CPU
// path), and a row's result never depends on the other rows. On float32 rows the same with the
// codes expanded to float32 and fused multiply-adds (the float32 model, for the oracle tests).
// A build for AVX2 + FMA without AVX512-BF16 has the float32 rows only, quant_avx2.cpp's kernels
// (bf16 rows are refused; has_quant_linear_bf16 says which build this is), and, where the layout's
// int8_rows says so, quant_q8_avx2.cpp's: the rows quantized to 8 bits first (llama.cpp's way).
// An AVX512-BF16 build on a CPU with AVX512-VNNI takes such layouts too, on bf16 and float32 rows
// (quant_q8_avx512.cpp).
//
// quant_dequant writes rows of the weights out (scale * code + min in float32, as gguf-py
// dequantizes, then rounded to the output dtype): the embedding rows, and the tests.
// quant_weight_t writes the whole weight transposed, [k, n], vectorised over the tile's rows: the
// prefill path (the dequantized bf16 weight into oneDNN's GEMM, many rows sharing the cost).
#include <torch/library.h>

#include "kernels.h"
#include "quant.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define ASTRAI_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using astrai_cpu::quant::Layout;
using astrai_cpu::quant::PF_BYTES;
using astrai_cpu::quant::PF_FAR_BYTES;
using astrai_cpu::quant::TILE;
using astrai_cpu::quant::share;
using astrai_cpu::Around;

// narrow: the caller reads 5- and 6-bit codes (quant_linear on int8 rows, VNNI builds: 5 bits in
// groups of 32, 6 bits signed in groups of 16, astrai.model.quant.narrow_codes' layouts)
#if defined(ASTRAI_QUANT_VNNI)
constexpr bool NARROW_BUILT = true;
#else
constexpr bool NARROW_BUILT = false;
#endif
Layout parse(const std::vector<int64_t>& v, const at::Tensor& packed, bool narrow = false) {
  TORCH_CHECK(v.size() == 7 || v.size() == 8,
              "quant: the layout is 7 or 8 integers (n, k, bits, group, has_min, f16_scales, signed[, int8_rows])");
  Layout L{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v.size() == 8 ? v[7] : 0};
  if (L.f16 == Layout::K_SCALES) {
    TORCH_CHECK(narrow && NARROW_BUILT && L.int8_rows,
                "quant: K-quant scales (float16 and int8 factors) are read by quant_linear on int8 rows only, on builds "
                "for AVX512-VNNI");
    TORCH_CHECK(L.k % Layout::SUPER == 0, "quant: K-quant scales come in super-blocks of 256 columns");
  }
  TORCH_CHECK(L.f16 >= 0 && L.f16 <= Layout::K_SCALES, "quant: f16_scales is 0, 1 or 2 (K-quant factors)");
  if (L.bits == 5 || L.bits == 6) {
    TORCH_CHECK(narrow && NARROW_BUILT && L.int8_rows,
                "quant: 5- and 6-bit codes are read by quant_linear on int8 rows only, on builds for AVX512-VNNI");
    TORCH_CHECK(L.bits == 5 ? L.group == 32 : (L.group == 16 && L.sign && !L.has_min),
                "quant: 5-bit codes come in groups of 32, 6-bit ones signed in groups of 16 without mins");
  }
  TORCH_CHECK(L.n > 0 && L.k > 0 && L.bits >= 4 && L.bits <= 8 && L.bits != 7 && (L.group == 16 || L.group == 32) &&
                  L.k % L.group == 0,
              "quant: a layout of 4- or 8-bit codes in groups of 16 or 32 columns that divide k");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.device().is_cpu() &&
                  packed.numel() == L.tiles() * L.tile_bytes(),
              "quant: packed must be the contiguous uint8 tile layout of its layout (astrai.model.quant)");
  return L;
}

inline float code_value(const uint8_t* codes, const Layout& L, int64_t j, int64_t kk) {
  // codes of one group record, row j of the tile, column kk of the group
  if (L.bits == 8) {
    return static_cast<float>(static_cast<int8_t>(codes[(kk / 2) * 32 + 2 * j + (kk % 2)]));
  }
  const int64_t dp = kk / 4, h = (kk % 4) / 2, e = kk % 2;
  int v = (codes[dp * 32 + 2 * j + e] >> (4 * h)) & 0xF;
  if (L.sign && v >= 8) v -= 16;
  return static_cast<float>(v);
}

inline float scale_at(const uint8_t* p, const Layout& L, int64_t j) {
  if (L.f16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * j, 2);
    return static_cast<float>(c10::detail::fp16_ieee_to_fp32_value(h));
  }
  float f;
  std::memcpy(&f, p + 4 * j, 4);
  return f;
}

#if defined(__AVX512BF16__)
inline __m512 load_scales(const uint8_t* p, bool f16) {
  return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
             : _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

// The 4-bit codes' values as float32 (0..15, or -8..7 for signed layouts).
inline __m512 code_table(const Layout& L) {
  alignas(64) float vals[16];
  for (int i = 0; i < 16; ++i) vals[i] = static_cast<float>(L.sign && i >= 8 ? i - 16 : i);
  return _mm512_load_ps(vals);
}

// One tile's weights, column pair by column pair: put(k, a, b) for each even column k, a and b
// the weights of columns k and k + 1 of the tile's 16 rows in float32, scale * code rounded, then
// + min rounded (gguf-py's order, no fused multiply-add: the dense model's weights). table:
// code_table(L).
template <class Put>
inline void tile_weights(const uint8_t* tile, const Layout& L, __m512 table, Put&& put) {
  const int64_t G = L.group, rec = L.record(), sb = L.scale_bytes();
  for (int64_t g = 0; g < L.groups(); ++g) {
    const uint8_t* r = tile + g * rec;
    const __m512 sc = load_scales(r, L.f16);
    const __m512 mn = L.has_min ? load_scales(r + sb, L.f16) : _mm512_setzero_ps();
    const auto w = [&](__m512 code) {
      const __m512 v = _mm512_mul_round_ps(code, sc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return L.has_min ? _mm512_add_round_ps(v, mn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) : v;
    };
    const uint8_t* codes = r + sb * (1 + L.has_min);
    const int64_t k0 = g * G;
    if (L.bits == 4) {  // dword j = byte 2j | byte 2j+1 << 16: nibbles at bits 0, 16, 4, 20 are columns 0-3
      for (int64_t dp = 0; dp < G / 4; ++dp) {
        const __m512i d = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + dp * 32)));
        put(k0 + 4 * dp, w(_mm512_permutexvar_ps(d, table)), w(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 16), table)));
        put(k0 + 4 * dp + 2, w(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table)),
            w(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 20), table)));
      }
    } else {
      for (int64_t p = 0; p < G / 2; ++p) {
        const __m512i d = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32)));
        put(k0 + 2 * p, w(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 16))),
            w(_mm512_cvtepi32_ps(_mm512_srai_epi32(d, 16))));
      }
    }
  }
}

inline uint16_t bf16_bits(float f) {  // exact for the small integers of the tables
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Tiles t .. t + U - 1 (U = 1 or 2) for M (<= 8) bf16 rows: x32 the rows as pairs of bf16 (row
// stride ldx pairs), xsum [M, groups] the groups' sums of x (when the layout has mins). Per
// group, one float32 sum per row and output of code * x (both k-pairs of a 4-column step into the
// same sum), then scale * sum (+ min * the group's sum of x) into the running sum. Each tile's
// stream of group records is prefetched PF_BYTES (and PF_FAR_BYTES) ahead: without it, one row read 96 MB of Q4_1
// at about 12 GB/s on 2 cores, with it the 120 layer GEMMs of SmolLM2 take 1.5-1.8x less time
// than the bf16 ones (they were 1.3x).
// The outputs are rounded to bf16 once, or stored in float32 (OutT float: an LM head's logits).
template <int M, int U, int BITS, typename OutT>
void tiles_bf16(const uint32_t* x32, int64_t ldx, const float* xsum, const uint8_t* packed, const Layout& L,
                __m512i table, const at::BFloat16* bias, OutT* out, int64_t ldo, int64_t t) {
  const int64_t G = L.group, n_groups = L.groups(), rec = L.record(), sb = L.scale_bytes();
  // The running sums, touched once per group: in registers for up to 4 rows; for more, in memory
  // (L1), so that the registers hold the group's dots of both tiles (2 x 8 of them) without spills.
  constexpr bool in_memory = M > 4;
  __m512 acc_r[U][in_memory ? 1 : M];
  alignas(64) float acc_m[U][in_memory ? M : 1][TILE];
  auto acc = [&](int u, int m) {
    if constexpr (in_memory) return _mm512_load_ps(acc_m[u][m]);
    else return acc_r[u][m];
  };
  auto set_acc = [&](int u, int m, __m512 v) {
    if constexpr (in_memory) _mm512_store_ps(acc_m[u][m], v);
    else acc_r[u][m] = v;
  };
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) set_acc(u, m, _mm512_setzero_ps());
  for (int64_t g = 0; g < n_groups; ++g) {
    const uint8_t* r[U];
    for (int u = 0; u < U; ++u) {
      r[u] = packed + (t + u) * L.tile_bytes() + g * rec;
      for (int64_t line = 0; line < rec; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(r[u] + PF_BYTES + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r[u] + PF_FAR_BYTES + line), _MM_HINT_T1);
      }
    }
    __m512 s[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) s[u][m] = _mm512_setzero_ps();
    const int64_t code_off = sb * (1 + L.has_min), kp0 = g * G / 2;
    if (BITS == 4) {
      for (int64_t dp = 0; dp < G / 4; ++dp) {
        __m512bh lo[U], hi[U];
        for (int u = 0; u < U; ++u) {
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[u] + code_off + dp * 32)));
          lo[u] = (__m512bh)_mm512_permutexvar_epi16(w, table);  // the index's low 5 bits: the low nibble, and a bit the table ignores
          hi[u] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        }
        for (int m = 0; m < M; ++m) {
          const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[m * ldx + kp0 + 2 * dp]));
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[m * ldx + kp0 + 2 * dp + 1]));
          for (int u = 0; u < U; ++u) {
            s[u][m] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s[u][m], lo[u], xa), hi[u], xb);
          }
        }
      }
    } else {
      for (int64_t p = 0; p < G / 2; p += 2) {
        __m512bh a[U], b[U];
        for (int u = 0; u < U; ++u) {
          const uint8_t* c = r[u] + code_off + p * 32;
          auto cvt = [](const uint8_t* q) {
            return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
          };
          a[u] = _mm512_cvtne2ps_pbh(cvt(c + 16), cvt(c));  // words 0-15 from bytes 0-15: exact (|code| <= 128)
          b[u] = _mm512_cvtne2ps_pbh(cvt(c + 48), cvt(c + 32));
        }
        for (int m = 0; m < M; ++m) {
          const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[m * ldx + kp0 + p]));
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[m * ldx + kp0 + p + 1]));
          for (int u = 0; u < U; ++u) {
            s[u][m] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s[u][m], a[u], xa), b[u], xb);
          }
        }
      }
    }
    for (int u = 0; u < U; ++u) {
      const __m512 sc = load_scales(r[u], L.f16);
      const __m512 mn = L.has_min ? load_scales(r[u] + sb, L.f16) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        __m512 a = _mm512_fmadd_ps(sc, s[u][m], acc(u, m));
        if (L.has_min) a = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * n_groups + g]), a);
        set_acc(u, m, a);
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    const int64_t n0 = (t + u) * TILE, count = std::min<int64_t>(TILE, L.n - n0);
    const __mmask16 keep = count == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i bits = _mm256_maskz_loadu_epi16(keep, bias + n0);
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 v = _mm512_add_ps(acc(u, m), bv);
      if constexpr (std::is_same_v<OutT, float>) {
        _mm512_mask_storeu_ps(out + m * ldo + n0, keep, v);
      } else {
        _mm256_mask_storeu_epi16(out + m * ldo + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// The same for float32 rows (x row stride ldx floats): codes expanded to float32.
template <int M, int U, int BITS>
void tiles_f32(const float* x, int64_t ldx, const float* xsum, const uint8_t* packed, const Layout& L, __m512 table,
               const float* bias, float* out, int64_t ldo, int64_t t) {
  const int64_t G = L.group, n_groups = L.groups(), rec = L.record(), sb = L.scale_bytes();
  __m512 acc[U][M];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < n_groups; ++g) {
    const uint8_t* r[U];
    for (int u = 0; u < U; ++u) r[u] = packed + (t + u) * L.tile_bytes() + g * rec;
    __m512 s0[U][M], s1[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) s0[u][m] = s1[u][m] = _mm512_setzero_ps();
    const int64_t code_off = sb * (1 + L.has_min), k0 = g * G;
    if (BITS == 4) {
      for (int64_t dp = 0; dp < G / 4; ++dp) {
        __m512 v[U][4];
        for (int u = 0; u < U; ++u) {
          // dword j = byte 2j | byte 2j+1 << 16: its nibbles at bits 0, 16, 4, 20 are columns 4dp + 0, 1, 2, 3
          const __m512i d = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[u] + code_off + dp * 32)));
          v[u][0] = _mm512_permutexvar_ps(d, table);  // the index's low 4 bits
          v[u][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 16), table);
          v[u][2] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
          v[u][3] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 20), table);
        }
        const int64_t k = k0 + 4 * dp;
        for (int m = 0; m < M; ++m) {
          const float* xr = x + m * ldx + k;
          for (int u = 0; u < U; ++u) {
            s0[u][m] = _mm512_fmadd_ps(v[u][0], _mm512_set1_ps(xr[0]), s0[u][m]);
            s1[u][m] = _mm512_fmadd_ps(v[u][1], _mm512_set1_ps(xr[1]), s1[u][m]);
            s0[u][m] = _mm512_fmadd_ps(v[u][2], _mm512_set1_ps(xr[2]), s0[u][m]);
            s1[u][m] = _mm512_fmadd_ps(v[u][3], _mm512_set1_ps(xr[3]), s1[u][m]);
          }
        }
      }
    } else {
      for (int64_t p = 0; p < G / 2; ++p) {
        __m512 v[U][2];
        for (int u = 0; u < U; ++u) {
          const __m512i d = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[u] + code_off + p * 32)));
          v[u][0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 16));
          v[u][1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 16));
        }
        const int64_t k = k0 + 2 * p;
        for (int m = 0; m < M; ++m) {
          const float* xr = x + m * ldx + k;
          for (int u = 0; u < U; ++u) {
            s0[u][m] = _mm512_fmadd_ps(v[u][0], _mm512_set1_ps(xr[0]), s0[u][m]);
            s1[u][m] = _mm512_fmadd_ps(v[u][1], _mm512_set1_ps(xr[1]), s1[u][m]);
          }
        }
      }
    }
    for (int u = 0; u < U; ++u) {
      const __m512 sc = load_scales(r[u], L.f16);
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_fmadd_ps(sc, _mm512_add_ps(s0[u][m], s1[u][m]), acc[u][m]);
      if (L.has_min) {
        const __m512 mn = load_scales(r[u] + sb, L.f16);
        for (int m = 0; m < M; ++m) acc[u][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * n_groups + g]), acc[u][m]);
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    const int64_t n0 = (t + u) * TILE, count = std::min<int64_t>(TILE, L.n - n0);
    const __mmask16 keep = count == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(out + m * ldo + n0, keep, _mm512_add_ps(acc[u][m], bv));
  }
}

template <typename F>
void by_rows(int64_t rows, F&& f) {  // f(M) for blocks of up to 4 rows
  for (int64_t r = 0; r < rows; r += 4) f(r, std::min<int64_t>(4, rows - r));
}

template <int BITS, typename OutT>
void run_bf16(const at::Tensor& xs, const float* xsum, const uint8_t* wp, const Layout& L, const at::BFloat16* bp,
              OutT* op, const Around* around) {
  const int64_t M = xs.size(0), ldx = xs.size(1) / 2, n_tiles = L.tiles(), G = L.groups();
  const auto* x32 = reinterpret_cast<const uint32_t*>(xs.const_data_ptr<at::BFloat16>());
  alignas(64) uint16_t words[32];
  for (int i = 0; i < 32; ++i) {
    int v = i & 15;
    if (L.sign && v >= 8) v -= 16;
    words[i] = bf16_bits(static_cast<float>(v));
  }
  const __m512i table = _mm512_load_si512(words);
  share((n_tiles + 1) / 2, 4, 2 * TILE, L.n, around, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * 2; t < std::min(n_tiles, end * 2); t += 2) {
      const bool pair = t + 1 < n_tiles;
      // rows in blocks of up to 8 against both tiles at once, the codes expanded once per block
      for (int64_t r = 0; r < M; r += 8) {
        const int64_t m = std::min<int64_t>(8, M - r);
        const uint32_t* xr = x32 + r * ldx;
        const float* sr = xsum == nullptr ? nullptr : xsum + r * G;
        OutT* orow = op + r * L.n;
#define ASTRAI_Q(MM)                                                                          \
  if (pair) tiles_bf16<MM, 2, BITS, OutT>(xr, ldx, sr, wp, L, table, bp, orow, L.n, t);       \
  else tiles_bf16<MM, 1, BITS, OutT>(xr, ldx, sr, wp, L, table, bp, orow, L.n, t);
        switch (m) {
          case 1: ASTRAI_Q(1) break;
          case 2: ASTRAI_Q(2) break;
          case 3: ASTRAI_Q(3) break;
          case 4: ASTRAI_Q(4) break;
          case 5: ASTRAI_Q(5) break;
          case 6: ASTRAI_Q(6) break;
          case 7: ASTRAI_Q(7) break;
          default: ASTRAI_Q(8) break;
        }
#undef ASTRAI_Q
      }
    }
  });
}

template <int BITS>
void run_f32(const at::Tensor& xs, const float* xsum, const uint8_t* wp, const Layout& L, const float* bp, float* op,
             const Around* around) {
  const int64_t M = xs.size(0), ldx = xs.size(1), n_tiles = L.tiles(), G = L.groups();
  const float* xp = xs.const_data_ptr<float>();
  alignas(64) float vals[16];
  for (int i = 0; i < 16; ++i) vals[i] = static_cast<float>(L.sign && i >= 8 ? i - 16 : i);
  const __m512 table = _mm512_load_ps(vals);
  share((n_tiles + 1) / 2, 4, 2 * TILE, L.n, around, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * 2; t < std::min(n_tiles, end * 2); t += 2) {
      const bool pair = t + 1 < n_tiles;
      by_rows(M, [&](int64_t r, int64_t m) {
        const float* xr = xp + r * ldx;
        const float* sr = xsum == nullptr ? nullptr : xsum + r * G;
        float* orow = op + r * L.n;
#define ASTRAI_Q(MM)                                                                    \
  if (pair) tiles_f32<MM, 2, BITS>(xr, ldx, sr, wp, L, table, bp, orow, L.n, t);        \
  else tiles_f32<MM, 1, BITS>(xr, ldx, sr, wp, L, table, bp, orow, L.n, t);
        switch (m) {
          case 1: ASTRAI_Q(1) break;
          case 2: ASTRAI_Q(2) break;
          case 3: ASTRAI_Q(3) break;
          default: ASTRAI_Q(4) break;
        }
#undef ASTRAI_Q
      });
    }
  });
}
#endif

#if defined(ASTRAI_AMX)
// AMX tile GEMMs for quant_linear_amx. Linux lets a process use the tile registers once it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN asks the same, asking twice is harmless.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the float32 sums of `rows` rows x 16 outputs of up to four weight tiles; 4: `rows`
// rows of x, 32 columns; 5-7: 16 pairs of columns x 16 outputs x 2 of a weight tile, in turn.
inline void configure_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// The most pairs of columns in a pass over the weight tiles: 128 (256 columns), so that four
// tiles' share (4 x 8 KB) stays in L1 while every 16-row block of x passes over it; the passes
// of a weight are made even (576 columns: three of 192).
constexpr int64_t AMX_KC2 = 128;

// Every row of x [M, 2 K2] (row stride ldx elements) against U weight tiles in linear_pack's
// layout ([K2][16][2] bf16 each, one after the other in w): outputs n0 .. n0 + 16 U - 1 of out
// [M, N], the float32 sums plus the bias rounded to bf16 once. K2 % 16 == 0. sums: [M][4][16]
// float32 scratch, the running sums between passes. `configured`: the rows this thread's tiles
// are configured for, updated. The columns go in passes of AMX_KC2 pairs, each over every 16-row
// block (in alternate directions, so that a partial last block costs one reconfiguration a
// pass): each block's rows of x are loaded once per U tile products, the tiles' share of the
// weight comes from L1.
template <int U>
void amx_rows(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, int64_t K2,
              const at::BFloat16* bias, at::BFloat16* out, int64_t N, int64_t n0, float* sums, int& configured) {
  const int64_t step = K2 * 2 * TILE;  // elements from one weight tile to the next
  const int64_t blocks = (M + 15) / 16;
  constexpr int64_t LDS = 4 * TILE * sizeof(float);  // bytes from one row of sums to the next
  const int64_t passes = (K2 + AMX_KC2 - 1) / AMX_KC2, kc2 = (K2 / 16 + passes - 1) / passes * 16;  // even passes
  for (int64_t kc = 0, pass = 0; kc < K2; kc += kc2, ++pass) {
    const int64_t kend = std::min(K2, kc + kc2);
    const bool first = kc == 0, last = kend == K2;
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t m0 = 16 * (pass % 2 ? blocks - 1 - i : i);
      const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
      if (rows != configured) {
        configure_tiles(rows);
        configured = rows;
      }
      float* sb = sums + m0 * 4 * TILE;
      if (first) {
        _tile_zero(0);
        if (U > 1) _tile_zero(1);
        if (U > 2) _tile_zero(2);
        if (U > 3) _tile_zero(3);
      } else {
        _tile_loadd(0, sb, LDS);
        if (U > 1) _tile_loadd(1, sb + TILE, LDS);
        if (U > 2) _tile_loadd(2, sb + 2 * TILE, LDS);
        if (U > 3) _tile_loadd(3, sb + 3 * TILE, LDS);
      }
      for (int64_t kp = kc; kp < kend; kp += 16) {
        const at::BFloat16* b = w + kp * 2 * TILE;
        _tile_loadd(4, x + m0 * ldx + 2 * kp, ldx * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (U > 1) {
          _tile_loadd(6, b + step, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (U > 2) {
          _tile_loadd(7, b + 2 * step, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (U > 3) {
          _tile_loadd(5, b + 3 * step, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, sb, LDS);
      if (U > 1) _tile_stored(1, sb + TILE, LDS);
      if (U > 2) _tile_stored(2, sb + 2 * TILE, LDS);
      if (U > 3) _tile_stored(3, sb + 3 * TILE, LDS);
      if (!last) continue;
      for (int u = 0; u < U; ++u) {
        const int64_t nu = n0 + u * TILE, count = std::min<int64_t>(TILE, N - nu);
        const __mmask16 keep = count == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
        __m512 bv = _mm512_setzero_ps();
        if (bias != nullptr) {
          bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + nu)), 16));
        }
        for (int r = 0; r < rows; ++r) {
          const __m512 v = _mm512_add_ps(_mm512_load_ps(sb + r * 4 * TILE + u * TILE), bv);
          _mm256_mask_storeu_epi16(out + (m0 + r) * N + nu, keep, (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
  }
}
#endif

}  // namespace

namespace astrai_cpu {

bool has_quant_linear() {
#if defined(__AVX512BF16__) || defined(ASTRAI_QUANT_AVX2)
  return true;
#else
  return false;
#endif
}

bool has_quant_linear_int8() {  // layouts with int8_rows: AVX2 builds (float32 rows), VNNI ones (both)
#if defined(ASTRAI_QUANT_AVX2) || defined(ASTRAI_QUANT_VNNI)
  return true;
#else
  return false;
#endif
}

bool has_quant_narrow_codes() {  // 5- and 6-bit codes on int8 rows (quant_q8_avx512.cpp)
#if defined(ASTRAI_QUANT_VNNI)
  return true;
#else
  return false;
#endif
}

bool has_quant_linear_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                        const c10::optional<at::Tensor>& bias, bool float_out) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be bf16 or float32 rows [M, k] on the CPU");
  // float_out: float32 outputs whatever x's dtype (bf16 rows: the sums are not rounded to bf16)
  const int64_t n = parse(layout, packed, true).n;
  at::Tensor out = float_out ? logits_out(x.size(0), n) : at::empty({x.size(0), n}, x.options());
  quant_linear_into(x, packed, layout, bias, out, nullptr);
  return out;
}

void quant_linear_into(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                       const c10::optional<at::Tensor>& bias, at::Tensor& out, const Around* around) {
  TORCH_CHECK(has_quant_linear(), "quant_linear: built without AVX512-BF16 or AVX2");
  const Layout L = parse(layout, packed, true);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == L.k && x.device().is_cpu() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "quant_linear: x must be bf16 or float32 rows [M, k] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || has_quant_linear_bf16(),
              "quant_linear: bf16 rows need a build for AVX512-BF16 (this one takes float32 rows)");
  const bool float_out = out.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == L.n && out.is_contiguous() &&
                  (out.scalar_type() == x.scalar_type() || float_out),
              "quant_linear: out must be contiguous [M, n] in x's dtype or float32");
  const at::Tensor xs = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == L.n && b.scalar_type() == x.scalar_type(), "quant_linear: bias must be [n] in x's dtype");
  }
  const int64_t M = xs.size(0), G = L.groups();
  if (M == 0) return;
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
#if defined(ASTRAI_QUANT_VNNI)
  if (L.int8_rows) {  // the rows quantized (and their groups' sums taken) in one pass
    quant::Rows8Buffers q8;
    // what the unsigned operand adds to a signed code: 128 for int8, 8, 16, 32 for 4-6 bits
    const int32_t offset = L.bits == 8 ? 128 : (L.sign ? 1 << (L.bits - 1) : 0);
    if (x.scalar_type() == at::kFloat) {
      quant::quantize_rows_q8_512(xs.const_data_ptr<float>(), M, L.k, L.group, offset, L.has_min != 0, q8);
      const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
      quant::linear_q8_512(q8.rows(L.k), M, wp, L, bp, out.data_ptr<float>(), around);
      return;
    }
    quant::quantize_rows_q8_512(xs.const_data_ptr<at::BFloat16>(), M, L.k, L.group, offset, L.has_min != 0, q8);
    const at::BFloat16* bp = b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr;
    if (float_out) quant::linear_q8_512(q8.rows(L.k), M, wp, L, bp, out.data_ptr<float>(), around);
    else quant::linear_q8_512(q8.rows(L.k), M, wp, L, bp, out.data_ptr<at::BFloat16>(), around);
    return;
  }
#endif
  std::vector<float> xsum;
  if (L.has_min) {  // each row's sum over each group, in float32 and in order
    xsum.assign(M * G, 0.f);
    const at::Tensor xf = xs.scalar_type() == at::kFloat ? xs : xs.to(at::kFloat);
    const float* p = xf.const_data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        for (int64_t i = 0; i < L.group; ++i) s += p[m * L.k + g * L.group + i];
        xsum[m * G + g] = s;
      }
  }
  const float* sp = L.has_min ? xsum.data() : nullptr;
#if defined(ASTRAI_QUANT_AVX2)
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  if (L.int8_rows) {
    std::vector<int16_t> q(M * L.k);
    std::vector<int8_t> q8(M * L.k);
    std::vector<float> d(M * G);
    std::vector<int32_t> isum(M * G);
    quant::quantize_rows_q8(xs.const_data_ptr<float>(), M, L.k, L.group, q.data(), q8.data(), d.data(), isum.data());
    quant::linear_q8_avx2(q.data(), q8.data(), d.data(), isum.data(), M, sp, wp, L, bp, out.data_ptr<float>(), around);
  } else {
    quant::linear_f32_avx2(xs.const_data_ptr<float>(), M, sp, wp, L, bp, out.data_ptr<float>(), around);
  }
#elif defined(__AVX512BF16__)
  TORCH_CHECK(!L.int8_rows, "quant_linear: 8-bit activations need AVX512-VNNI on a CPU with AVX512-BF16");
  if (x.scalar_type() == at::kBFloat16) {
    const at::BFloat16* bp = b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr;
    if (float_out) {
      if (L.bits == 4) run_bf16<4>(xs, sp, wp, L, bp, out.data_ptr<float>(), around);
      else run_bf16<8>(xs, sp, wp, L, bp, out.data_ptr<float>(), around);
    } else if (L.bits == 4) {
      run_bf16<4>(xs, sp, wp, L, bp, out.data_ptr<at::BFloat16>(), around);
    } else {
      run_bf16<8>(xs, sp, wp, L, bp, out.data_ptr<at::BFloat16>(), around);
    }
  } else {
    const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
    if (L.bits == 4) run_f32<4>(xs, sp, wp, L, bp, out.data_ptr<float>(), around);
    else run_f32<8>(xs, sp, wp, L, bp, out.data_ptr<float>(), around);
  }
#endif
}

at::Tensor quant_dequant(const at::Tensor& packed, const std::vector<int64_t>& layout, const c10::optional<at::Tensor>& rows,
                         at::ScalarType dtype) {
  const Layout L = parse(layout, packed);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quant_dequant: float32, bfloat16 or float16 out");
  at::Tensor ids;
  if (rows.has_value() && rows->defined()) {
    ids = rows->to(at::kLong).contiguous().view(-1);
  } else {
    ids = at::arange(L.n, at::kLong);
  }
  const int64_t R = ids.numel();
  const int64_t* ip = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < L.n, "quant_dequant: row ", ip[i], " outside [0, ", L.n, ")");
  auto out = at::empty({R, L.k}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const int64_t G = L.groups(), rec = L.record(), sb = L.scale_bytes();
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = ip[i], t = row / TILE, j = row % TILE;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* r = wp + t * L.tile_bytes() + g * rec;
        const float s = scale_at(r, L, j), mn = L.has_min ? scale_at(r + sb, L, j) : 0.f;
        const uint8_t* codes = r + sb * (1 + L.has_min);
        float* o = op + i * L.k + g * L.group;
        for (int64_t kk = 0; kk < L.group; ++kk) {
          // scale * code, rounded, then + min, rounded: gguf-py's order (no fused multiply-add)
          volatile float prod = s * code_value(codes, L, j, kk);
          o[kk] = L.has_min ? prod + mn : prod;
        }
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor quant_weight_t(const at::Tensor& packed, const std::vector<int64_t>& layout, at::ScalarType dtype) {
  TORCH_CHECK(has_quant_linear(), "quant_weight_t: built without AVX512-BF16 or AVX2");
  const Layout L = parse(layout, packed);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_weight_t: float32 or bfloat16 out");
#if defined(ASTRAI_QUANT_AVX2)
  auto wt = at::empty({L.k, L.n}, at::TensorOptions().dtype(at::kFloat));
  quant::weight_t_f32_avx2(packed.const_data_ptr<uint8_t>(), L, wt.data_ptr<float>());
  return dtype == at::kFloat ? wt : wt.to(dtype);
#endif
  auto out = at::empty({L.k, L.n}, at::TensorOptions().dtype(dtype));
#if defined(__AVX512BF16__)
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const int64_t n = L.n;
  const __m512 table = code_table(L);
  const bool bf16 = dtype == at::kBFloat16;
  char* base = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, L.tiles(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE, count = std::min<int64_t>(TILE, n - n0);
      const __mmask16 keep = count == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
      const auto store = [&](int64_t k, __m512 w) {
        if (bf16) {
          _mm256_mask_storeu_epi16(base + 2 * (k * n + n0), keep, (__m256i)_mm512_cvtneps_pbh(w));
        } else {
          _mm512_mask_storeu_ps(base + 4 * (k * n + n0), keep, w);
        }
      };
      tile_weights(wp + t * L.tile_bytes(), L, table, [&](int64_t k, __m512 a, __m512 b) {
        store(k, a);
        store(k + 1, b);
      });
    }
  });
#endif
  return out;
}

namespace {

// quant_linear_wide and quant_linear_amx: each thread's pairs of tiles dequantized in turn into
// linear_pack's layout (the bf16 model's weights, L2-sized), then every row against them on
// linear_packed's loops, or on AMX tile GEMMs (amx).
at::Tensor wide(const char* name, const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                const c10::optional<at::Tensor>& bias, bool amx) {
  const Layout L = parse(layout, packed);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == L.k && x.device().is_cpu() && x.scalar_type() == at::kBFloat16, name,
              ": x must be bf16 rows [M, k] on the CPU");
  const at::Tensor xs = x.contiguous();
  const at::BFloat16* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == L.n && b.scalar_type() == at::kBFloat16, name, ": bias must be bf16 [n]");
    bp = b.const_data_ptr<at::BFloat16>();
  }
  const int64_t M = xs.size(0), n = L.n, n_tiles = L.tiles(), K2 = L.k / 2;
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const at::BFloat16* xp = xs.const_data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const __m512 table = code_table(L);
  const int64_t G = amx ? 4 : 2;  // tiles dequantized at a time
  at::parallel_for(0, (n_tiles + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    // G tiles in linear_pack's layout, [K2][16][2] bf16 each: G x 16 x k x 2 bytes (L2-sized)
    std::vector<at::BFloat16> buf(G * K2 * 2 * TILE);
    uint32_t* wb = reinterpret_cast<uint32_t*>(buf.data());
    int configured = 0;  // the rows this thread's tiles are configured for (amx), none yet
    // amx: the running sums of every row for four tiles, [M][4][16] (every one written before it is read)
    const std::unique_ptr<float[]> sums(amx ? new float[((M + 15) / 16) * 16 * 4 * TILE + 16] : nullptr);
    float* sp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sums.get()) + 63) & ~uintptr_t{63});
    for (int64_t t = begin * G; t < std::min(n_tiles, end * G); t += G) {
      const int64_t t1 = std::min(n_tiles, t + G);
      for (int64_t u = t; u < t1; ++u) {
        uint32_t* tile = wb + (u - t) * K2 * TILE;
        // columns k and k + 1, rounded to bf16 and paired as linear_pack lays them out
        tile_weights(wp + u * L.tile_bytes(), L, table, [&](int64_t k, __m512 a, __m512 b) {
          const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
          const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
          _mm512_storeu_si512(tile + (k / 2) * TILE, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        });
      }
#if defined(ASTRAI_AMX)
      if (amx) {
        const at::BFloat16* w = buf.data();
        switch (t1 - t) {
          case 1: amx_rows<1>(xp, L.k, M, w, K2, bp, op, n, t * TILE, sp, configured); break;
          case 2: amx_rows<2>(xp, L.k, M, w, K2, bp, op, n, t * TILE, sp, configured); break;
          case 3: amx_rows<3>(xp, L.k, M, w, K2, bp, op, n, t * TILE, sp, configured); break;
          default: amx_rows<4>(xp, L.k, M, w, K2, bp, op, n, t * TILE, sp, configured); break;
        }
        continue;
      }
#endif
      packed_rows(xp, L.k, M, buf.data(), bp, op, n, K2, t, t1);
    }
#if defined(ASTRAI_AMX)
    if (configured) _tile_release();
#endif
  });
#endif
  (void)amx;
  return out;
}

}  // namespace

at::Tensor quant_linear_wide(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_quant_linear() && has_linear_packed(), "quant_linear_wide: built without AVX512-BF16");
  return wide("quant_linear_wide", x, packed, layout, bias, false);
}

bool has_quant_linear_amx() {
#if defined(ASTRAI_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor quant_linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_quant_linear_amx(), "quant_linear_amx: built without AMX, or the OS refused its tile registers");
  TORCH_CHECK(layout.size() >= 7 && layout[1] % 32 == 0, "quant_linear_amx: k must be a multiple of 32");
  return wide("quant_linear_amx", x, packed, layout, bias, true);
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("has_quant_linear() -> bool", &astrai_cpu::has_quant_linear);
  m.def("has_quant_linear_bf16() -> bool", &astrai_cpu::has_quant_linear_bf16);
  m.def("has_quant_linear_int8() -> bool", &astrai_cpu::has_quant_linear_int8);
  m.def("has_quant_narrow_codes() -> bool", &astrai_cpu::has_quant_narrow_codes);
  m.def("quant_linear(Tensor x, Tensor packed, int[] layout, Tensor? bias, bool float_out=False) -> Tensor");
  m.def("quant_dequant(Tensor packed, int[] layout, Tensor? rows, ScalarType dtype) -> Tensor");
  m.def("quant_weight_t(Tensor packed, int[] layout, ScalarType dtype) -> Tensor");
  m.def("quant_linear_wide(Tensor x, Tensor packed, int[] layout, Tensor? bias) -> Tensor");
  m.def("has_quant_linear_amx() -> bool", &astrai_cpu::has_quant_linear_amx);
  m.def("quant_linear_amx(Tensor x, Tensor packed, int[] layout, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("quant_linear", &astrai_cpu::quant_linear);
  m.impl("quant_dequant", &astrai_cpu::quant_dequant);
  m.impl("quant_weight_t", &astrai_cpu::quant_weight_t);
  m.impl("quant_linear_wide", &astrai_cpu::quant_linear_wide);
  m.impl("quant_linear_amx", &astrai_cpu::quant_linear_amx);
}
