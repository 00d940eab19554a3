// quant_linear with 8-bit activations on AVX512-VNNI (builds for AVX512-BF16 CPUs that have it:
// Sapphire Rapids, Zen 4): the arithmetic of quant_q8_avx2.cpp (llama.cpp's Q8 activations on
// astrai's tile layout), with `vpdpbusd` taking four columns of a tile's 16 rows an instruction.
// Each row of x (bf16 or float32) is quantized per group of the weight's columns to int8 codes
// with one float32 scale (amax / 127, round to nearest even); per group, the integer sum of the
// weight's codes times the row's codes; each group's sum scaled once in float32: y[n] = sum_g
// (ws[n,g] * xs[g] * S[n,g] + min[n,g] * X[g]), X[g] the float32 sum of the row's unquantized
// group. `vpdpbusd` multiplies unsigned bytes by signed ones, so the weight's codes go in as
// unsigned: 4-bit codes as they are (signed Q4_0 codes plus 8), 8-bit codes plus 128, and the
// offset times the row's code sum starts the group's sum below zero. A lane holds a row's four
// consecutive columns: a 4-bit record's 32-byte chunk (word j: row j's columns 4q..4q+3 as
// nibbles) widened to dwords and its high nibbles moved up 12 bits, an 8-bit record's two chunks
// (words j: columns 4q, 4q+1 and 4q+2, 4q+3) interleaved. Against the bf16 kernel's two
// `vdpbf16ps` per four columns, one instruction and no float conversion of the codes; the sums
// are exact in integers, so a row's result depends on that row alone, whatever the batch.
//
// 5- and 6-bit codes (astrai.model.quant.narrow_codes: Q5_0, Q5_1, Q5_K and Q6_K, which the other
// kernels read widened to int8) go in as 4-bit ones do, plus the bytes their chunk's 64-bit masks of
// bit 4 (and 5) mark, 16 (and 32) added to each: one byte of the operand a mask bit. A K-quant's
// scales and mins may come as the file's factors (Layout::K_SCALES: int8 in the records, float16
// in each super-block's header), multiplied as a tile's record is read: the same float32 values.
//
// Up to 8 rows (decode) expand each tile's codes in registers as they are read (up to 4 rows two
// tiles at a time, more a tile at a time); more rows expand a pair of tiles once into a buffer
// (L1/L2) that every block of 4 rows then reads.
#include "quant.h"

#if defined(ASTRAI_QUANT_VNNI)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace astrai_cpu::quant {
namespace {

// rows a block of two tiles (a tile: twice as many), their sums and running sums in registers
constexpr int64_t ROWS = 4;

inline __m512 load_scales(const uint8_t* p, bool f16) {
  return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
             : _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

// K_SCALES: 16 float16 factors (a header's) times 16 int8 ones (a record's), exact in float32
inline __m512 k_scales(const uint8_t* header, const uint8_t* record) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header)));
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record)));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
}

// The unsigned operand for columns 4q .. 4q + 3 of a record's 16 rows (codes: the record's codes).
// 5- and 6-bit codes (unsigned, signed ones stored plus 16 or 32): the low nibbles as 4-bit codes
// are, then the chunk's 64-bit masks of bit 4 (and bit 5) at chunks * 32 bytes, one byte of the
// operand a mask bit: added to the bytes they mark.
template <int BITS, bool SIGNED>
inline __m512i expand(const uint8_t* codes, int64_t q, int64_t chunks) {
  if constexpr (BITS != 8) {
    // dword j = byte 2j | byte 2j+1 << 8: columns 0, 1 in the low nibbles, 2, 3 in the high ones;
    // (v | v << 12) & 0x0F0F0F0F puts the high nibbles in bytes 2 and 3
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 32)));
    __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
    if constexpr (BITS == 4 && SIGNED) w = _mm512_xor_si512(w, _mm512_set1_epi32(0x08080808));  // -8..7 -> 0..15
    if constexpr (BITS > 4) {
      const uint8_t* high = codes + chunks * 32 + q * 8 * (BITS - 4);
      uint64_t bit4;
      std::memcpy(&bit4, high, sizeof(bit4));
      w = _mm512_mask_add_epi8(w, _cvtu64_mask64(bit4), w, _mm512_set1_epi8(16));
      if constexpr (BITS == 6) {
        uint64_t bit5;
        std::memcpy(&bit5, high + 8, sizeof(bit5));
        w = _mm512_mask_add_epi8(w, _cvtu64_mask64(bit5), w, _mm512_set1_epi8(32));
      }
    }
    return w;
  } else {
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 64)));
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 64 + 32)));
    // (a | b << 16) ^ 0x80808080: int8 codes -> code + 128
    return _mm512_ternarylogic_epi32(a, _mm512_slli_epi32(b, 16), _mm512_set1_epi32(static_cast<int>(0x80808080)), 0x56);
  }
}

// The weights as a tile block reads them: codes(u, g, q), scales(u, g), mins(u, g).
// InRecords: straight from the packed records (expanded as read, each tile's stream prefetched).
template <int U, int BITS, bool SIGNED>
struct InRecords {
  const uint8_t* packed;
  const Layout& L;
  int64_t t;
  const uint8_t* r[U] = {};
  const uint8_t* h[U] = {};  // K_SCALES: the super-block's header
  void group(int64_t g) {
    for (int u = 0; u < U; ++u) {
      r[u] = L.record_at(packed, t + u, g);
      if (L.f16 == Layout::K_SCALES) h[u] = L.header_at(packed, t + u, g);
      for (int64_t line = 0; line < L.record(); line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(r[u] + PF_BYTES + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r[u] + PF_FAR_BYTES + line), _MM_HINT_T1);
      }
    }
  }
  __m512i codes(int u, int64_t q) const {
    return expand<BITS, SIGNED>(r[u] + L.scale_bytes() * (1 + L.has_min), q, L.group / 4);
  }
  __m512 scales(int u) const {
    return L.f16 == Layout::K_SCALES ? k_scales(h[u], r[u]) : load_scales(r[u], L.f16);
  }
  __m512 mins(int u) const {
    return L.f16 == Layout::K_SCALES ? k_scales(h[u] + 2 * TILE, r[u] + TILE) : load_scales(r[u] + L.scale_bytes(), L.f16);
  }
};

// Expanded: a pair of tiles expanded once (expand_pair) into buf: per group, per tile, the G / 4
// operands, then its scales and mins in float32.
template <int U>
struct Expanded {
  const __m512i* buf;
  int64_t per_tile;  // G / 4 + 2 vectors
  const __m512i* at = nullptr;
  void group(int64_t g) { at = buf + g * U * per_tile; }
  __m512i codes(int u, int64_t q) const { return _mm512_load_si512(at + u * per_tile + q); }
  __m512 scales(int u) const { return _mm512_castsi512_ps(_mm512_load_si512(at + u * per_tile + per_tile - 2)); }
  __m512 mins(int u) const { return _mm512_castsi512_ps(_mm512_load_si512(at + u * per_tile + per_tile - 1)); }
};

template <int U, int BITS, bool SIGNED>
void expand_pair(const uint8_t* packed, const Layout& L, int64_t t, __m512i* buf) {
  InRecords<U, BITS, SIGNED> w{packed, L, t};
  const int64_t Q = L.group / 4, per_tile = Q + 2;
  for (int64_t g = 0; g < L.groups(); ++g) {
    w.group(g);
    __m512i* at = buf + g * U * per_tile;
    for (int u = 0; u < U; ++u) {
      for (int64_t q = 0; q < Q; ++q) _mm512_store_si512(at + u * per_tile + q, w.codes(u, q));
      _mm512_store_si512(at + u * per_tile + Q, _mm512_castps_si512(w.scales(u)));
      _mm512_store_si512(at + u * per_tile + Q + 1,
                         _mm512_castps_si512(L.has_min ? w.mins(u) : _mm512_setzero_ps()));
    }
  }
}

inline void store_row(float* o, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(o, keep, v); }
inline void store_row(c10::BFloat16* o, __mmask16 keep, __m512 v) {
  _mm256_mask_storeu_epi16(o, keep, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 load_bias(const float* b, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, b); }
inline __m512 load_bias(const c10::BFloat16* b, __mmask16 keep) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, b)), 16));
}

// Tiles t .. t + U - 1 for M (<= ROWS) rows of x starting at row m0, into out (row stride ldo).
// Q: G / 4 (the group's steps of four columns, 8 or 4), known to the compiler so that a group's
// steps are straight-line code.
template <int M, int U, int BITS, bool SIGNED, int Q, class W, typename B, typename O>
void tiles(W w, const Rows8& x, int64_t m0, const Layout& L, const B* bias, O* out, int64_t ldo, int64_t t) {
  constexpr int64_t G = 4 * Q;
  const int64_t NG = L.groups();
  constexpr bool offset = SIGNED || BITS == 8;
  __m512 acc[U][M];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    w.group(g);
    __m512i s[U][M];
    for (int m = 0; m < M; ++m) {
      const __m512i init = offset ? _mm512_set1_epi32(-x.off[(m0 + m) * NG + g]) : _mm512_setzero_si512();
      for (int u = 0; u < U; ++u) s[u][m] = init;
    }
    const int8_t* xg = x.q + m0 * x.k + g * G;
#pragma GCC unroll 8
    for (int64_t q = 0; q < Q; ++q) {
      for (int u = 0; u < U; ++u) {
        const __m512i wz = w.codes(u, q);
        for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, xg + m * x.k + 4 * q, sizeof(four));
          s[u][m] = _mm512_dpbusd_epi32(s[u][m], wz, _mm512_set1_epi32(four));
        }
      }
    }
    for (int u = 0; u < U; ++u) {
      const __m512 sc = w.scales(u);
      for (int m = 0; m < M; ++m) {
        const __m512 ws = _mm512_mul_ps(sc, _mm512_set1_ps(x.d[(m0 + m) * NG + g]));
        acc[u][m] = _mm512_fmadd_ps(ws, _mm512_cvtepi32_ps(s[u][m]), acc[u][m]);
      }
      if (L.has_min) {
        const __m512 mn = w.mins(u);
        for (int m = 0; m < M; ++m)
          acc[u][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.xsum[(m0 + m) * NG + g]), acc[u][m]);
      }
    }
  }
  for (int u = 0; u < U; ++u) {
    const int64_t n0 = (t + u) * TILE, count = std::min<int64_t>(TILE, L.n - n0);
    const __mmask16 keep = count == TILE ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    const __m512 bv = bias != nullptr ? load_bias(bias + n0, keep) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store_row(out + (m0 + m) * ldo + n0, keep, _mm512_add_ps(acc[u][m], bv));
  }
}

template <int U, int BITS, bool SIGNED, int Q, class W, typename B, typename O>
void rows_block(W w, const Rows8& x, int64_t m0, int64_t m, const Layout& L, const B* bias, O* out, int64_t t) {
  switch (m) {
    case 1: tiles<1, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    case 2: tiles<2, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    case 3: tiles<3, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    case 4: tiles<4, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    case 5: tiles<5, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    case 6: tiles<6, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    case 7: tiles<7, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
    default: tiles<8, U, BITS, SIGNED, Q>(w, x, m0, L, bias, out, L.n, t); break;
  }
}

template <int BITS, bool SIGNED, int Q, typename B, typename O>
void run(const Rows8& x, int64_t M, const uint8_t* packed, const Layout& L, const B* bias, O* out,
         const Around* around) {
  const int64_t n_tiles = L.tiles(), per_tile = Q + 2;
  share((n_tiles + 1) / 2, 4, 2 * TILE, L.n, around, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<__m512i[]> buf(M > 2 * ROWS ? new __m512i[L.groups() * 2 * per_tile] : nullptr);
    for (int64_t t = begin * 2; t < std::min(n_tiles, end * 2); t += 2) {
      const bool pair = t + 1 < n_tiles;
      if (M <= ROWS) {  // one block of rows: the codes expanded as they are read
        if (pair) rows_block<2, BITS, SIGNED, Q>(InRecords<2, BITS, SIGNED>{packed, L, t}, x, 0, M, L, bias, out, t);
        else rows_block<1, BITS, SIGNED, Q>(InRecords<1, BITS, SIGNED>{packed, L, t}, x, 0, M, L, bias, out, t);
        continue;
      }
      if (M <= 2 * ROWS) {  // the same a tile at a time, for up to 8 rows
        for (int64_t u = t; u < std::min(n_tiles, t + 2); ++u)
          rows_block<1, BITS, SIGNED, Q>(InRecords<1, BITS, SIGNED>{packed, L, u}, x, 0, M, L, bias, out, u);
        continue;
      }
      if (pair) expand_pair<2, BITS, SIGNED>(packed, L, t, buf.get());
      else expand_pair<1, BITS, SIGNED>(packed, L, t, buf.get());
      for (int64_t r = 0; r < M; r += ROWS) {
        const int64_t m = std::min(ROWS, M - r);
        if (pair) rows_block<2, BITS, SIGNED, Q>(Expanded<2>{buf.get(), per_tile}, x, r, m, L, bias, out, t);
        else rows_block<1, BITS, SIGNED, Q>(Expanded<1>{buf.get(), per_tile}, x, r, m, L, bias, out, t);
      }
    }
  });
}

inline __m512 load16(const float* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 keep) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}

}  // namespace

template <typename T>
void quantize_rows_q8_512(const T* x, int64_t M, int64_t k, int64_t group, int32_t offset, bool sums, Rows8Buffers& b) {
  const int64_t G = k / group, parts = (group + 15) / 16;
  b.q.reset(new int8_t[M * k]);
  b.d.reset(new float[M * G]);
  b.off.reset(new int32_t[M * G]);
  b.xsum.reset(sums ? new float[M * G] : nullptr);
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xg = x + i * group;  // row i / G, group i % G: rows are contiguous
      __m512 v[2];
      __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t left = std::min<int64_t>(16, group - 16 * p);
        const __mmask16 keep = left == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
        v[p] = load16(xg + 16 * p, keep);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[p]));
        sum = _mm512_add_ps(sum, v[p]);
      }
      const float a = _mm512_reduce_max_ps(amax);
      const float inv = a > 0.f ? 127.f / a : 0.f;
      __m512i codes = _mm512_setzero_si512();
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t left = std::min<int64_t>(16, group - 16 * p);
        const __mmask16 keep = left == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
        // the current rounding mode: to nearest, ties to even (std::nearbyint's)
        const __m512i c = _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(v[p], _mm512_set1_ps(inv)));
        codes = _mm512_add_epi32(codes, c);
        _mm_mask_storeu_epi8(b.q.get() + i * group + 16 * p, keep, _mm512_cvtepi32_epi8(c));
      }
      b.d[i] = a / 127.f;
      b.off[i] = offset != 0 ? offset * _mm512_reduce_add_epi32(codes) : 0;
      if (sums) b.xsum[i] = _mm512_reduce_add_ps(sum);
    }
  });
}

template void quantize_rows_q8_512<float>(const float*, int64_t, int64_t, int64_t, int32_t, bool, Rows8Buffers&);
template void quantize_rows_q8_512<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, int32_t, bool,
                                                   Rows8Buffers&);

template <typename B, typename O>
void linear_q8_512(const Rows8& x, int64_t M, const uint8_t* packed, const Layout& L, const B* bias, O* out,
                   const Around* around) {
  TORCH_CHECK(L.group == 16 || L.group == 32, "quant_linear: 8-bit activations take groups of 16 or 32 columns");
  const bool wide = L.group == 32;
  if (L.bits == 8) wide ? run<8, false, 8>(x, M, packed, L, bias, out, around) : run<8, false, 4>(x, M, packed, L, bias, out, around);
  else if (L.bits == 5) L.sign ? run<5, true, 8>(x, M, packed, L, bias, out, around) : run<5, false, 8>(x, M, packed, L, bias, out, around);
  else if (L.bits == 6) run<6, true, 4>(x, M, packed, L, bias, out, around);  // (parse: signed, groups of 16)
  else if (L.sign) wide ? run<4, true, 8>(x, M, packed, L, bias, out, around) : run<4, true, 4>(x, M, packed, L, bias, out, around);
  else wide ? run<4, false, 8>(x, M, packed, L, bias, out, around) : run<4, false, 4>(x, M, packed, L, bias, out, around);
}

template void linear_q8_512(const Rows8&, int64_t, const uint8_t*, const Layout&, const float*, float*,
                            const Around*);
template void linear_q8_512(const Rows8&, int64_t, const uint8_t*, const Layout&, const c10::BFloat16*,
                            c10::BFloat16*, const Around*);
template void linear_q8_512(const Rows8&, int64_t, const uint8_t*, const Layout&, const c10::BFloat16*, float*,
                            const Around*);

}  // namespace astrai_cpu::quant
#endif
