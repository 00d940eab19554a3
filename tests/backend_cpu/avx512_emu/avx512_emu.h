// The AVX-512 (F, BF16) intrinsics the CPU kernels use, in plain C++ on GCC's vector types, for
// running the kernels' AVX512-BF16 code on a CPU without those instructions (see prefill_emu.cpp).
//
// Included after <immintrin.h> (GCC declares every intrinsic whatever the target, and its vector
// types, __m512 included, are usable on any x86-64 target); each intrinsic name is then redefined
// as a macro naming the emulation below, written from Intel's pseudo-code of the instruction:
// lanes in order, 128-bit lanes where the instruction works within them, bf16 conversions
// rounding to nearest even, dot products as two float32 additions of exact bf16 products.
#pragma once

#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace astrai_avx512_emu {

using F16 = std::array<float, 16>;
using I16 = std::array<int32_t, 16>;
using I8 = std::array<int64_t, 8>;
using U32 = std::array<uint16_t, 32>;
using U16 = std::array<uint16_t, 16>;

template <typename A, typename V>
inline A get(const V& v) {
  static_assert(sizeof(A) == sizeof(V));
  A a;
  std::memcpy(&a, &v, sizeof(a));
  return a;
}

template <typename V, typename A>
inline V put(const A& a) {
  static_assert(sizeof(A) == sizeof(V));
  V v;
  std::memcpy(&v, &a, sizeof(v));
  return v;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 -> bf16, round to nearest even (a NaN stays a quiet NaN), as VCVTNEPS2BF16.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// ---- loads, stores, constants
inline __m512i loadu_si512(const void* p) { __m512i v; std::memcpy(&v, p, 64); return v; }
inline void storeu_si512(void* p, __m512i v) { std::memcpy(p, &v, 64); }
inline __m256i loadu_si256(const __m256i* p) { __m256i v; std::memcpy(&v, p, 32); return v; }
inline void storeu_si256(__m256i* p, __m256i v) { std::memcpy(p, &v, 32); }
inline __m512 load_ps(const void* p) { __m512 v; std::memcpy(&v, p, 64); return v; }
inline void store_ps(void* p, __m512 v) { std::memcpy(p, &v, 64); }
inline __m512i setzero_si512() { return put<__m512i>(I16{}); }
inline __m512 setzero_ps() { return put<__m512>(F16{}); }
inline __m512 set1_ps(float x) { F16 r; r.fill(x); return put<__m512>(r); }
inline __m512i set1_epi32(int x) { I16 r; r.fill(x); return put<__m512i>(r); }
inline __m512i set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7, int e6,
                         int e5, int e4, int e3, int e2, int e1, int e0) {
  return put<__m512i>(I16{e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15});
}

// ---- integer lanes
inline __m512i unpacklo_epi32(__m512i a, __m512i b) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  I16 r;
  for (int l = 0; l < 4; ++l) r[4 * l] = x[4 * l], r[4 * l + 1] = y[4 * l], r[4 * l + 2] = x[4 * l + 1], r[4 * l + 3] = y[4 * l + 1];
  return put<__m512i>(r);
}
inline __m512i unpackhi_epi32(__m512i a, __m512i b) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  I16 r;
  for (int l = 0; l < 4; ++l) r[4 * l] = x[4 * l + 2], r[4 * l + 1] = y[4 * l + 2], r[4 * l + 2] = x[4 * l + 3], r[4 * l + 3] = y[4 * l + 3];
  return put<__m512i>(r);
}
inline __m512i unpacklo_epi64(__m512i a, __m512i b) {
  const I8 x = get<I8>(a), y = get<I8>(b);
  I8 r;
  for (int l = 0; l < 4; ++l) r[2 * l] = x[2 * l], r[2 * l + 1] = y[2 * l];
  return put<__m512i>(r);
}
inline __m512i unpackhi_epi64(__m512i a, __m512i b) {
  const I8 x = get<I8>(a), y = get<I8>(b);
  I8 r;
  for (int l = 0; l < 4; ++l) r[2 * l] = x[2 * l + 1], r[2 * l + 1] = y[2 * l + 1];
  return put<__m512i>(r);
}
// 128-bit lanes: two picked from a (imm bits 1:0, 3:2), two from b (5:4, 7:6)
inline __m512i shuffle_i32x4(__m512i a, __m512i b, int imm) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  I16 r;
  for (int l = 0; l < 4; ++l) {
    const I16& src = l < 2 ? x : y;
    const int pick = (imm >> (2 * l)) & 3;
    for (int e = 0; e < 4; ++e) r[4 * l + e] = src[4 * pick + e];
  }
  return put<__m512i>(r);
}
inline __m512i cvtepu16_epi32(__m256i a) {
  const U16 x = get<U16>(a);
  I16 r;
  for (int i = 0; i < 16; ++i) r[i] = x[i];
  return put<__m512i>(r);
}
inline __m512i or_si512(__m512i a, __m512i b) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  I16 r;
  for (int i = 0; i < 16; ++i) r[i] = x[i] | y[i];
  return put<__m512i>(r);
}
inline __m512i slli_epi32(__m512i a, unsigned imm) {
  const I16 x = get<I16>(a);
  I16 r;
  for (int i = 0; i < 16; ++i) r[i] = imm > 31 ? 0 : static_cast<int32_t>(static_cast<uint32_t>(x[i]) << imm);
  return put<__m512i>(r);
}
inline __m512i add_epi32(__m512i a, __m512i b) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  I16 r;
  for (int i = 0; i < 16; ++i) r[i] = static_cast<int32_t>(static_cast<uint32_t>(x[i]) + static_cast<uint32_t>(y[i]));
  return put<__m512i>(r);
}
inline __mmask16 cmple_epi32_mask(__m512i a, __m512i b) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= static_cast<unsigned>(x[i] <= y[i]) << i;
  return static_cast<__mmask16>(k);
}
inline __mmask16 cmpgt_epi32_mask(__m512i a, __m512i b) {
  const I16 x = get<I16>(a), y = get<I16>(b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= static_cast<unsigned>(x[i] > y[i]) << i;
  return static_cast<__mmask16>(k);
}

// ---- float lanes
template <typename Op>
inline __m512 lanewise(__m512 a, __m512 b, Op op) {
  const F16 x = get<F16>(a), y = get<F16>(b);
  F16 r;
  for (int i = 0; i < 16; ++i) r[i] = op(x[i], y[i]);
  return put<__m512>(r);
}
inline __m512 add_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x + y; }); }
inline __m512 sub_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x - y; }); }
inline __m512 mul_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x * y; }); }
// VMAXPS: the second operand when either is NaN or both are zeros
inline __m512 max_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x > y ? x : y; }); }
inline __m512 fmadd_ps(__m512 a, __m512 b, __m512 c) {
  const F16 x = get<F16>(a), y = get<F16>(b), z = get<F16>(c);
  F16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(x[i], y[i], z[i]);
  return put<__m512>(r);
}
inline __m512 fnmadd_ps(__m512 a, __m512 b, __m512 c) {
  const F16 x = get<F16>(a), y = get<F16>(b), z = get<F16>(c);
  F16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(-x[i], y[i], z[i]);
  return put<__m512>(r);
}
// to an integer, round to nearest even (the kernels' only rounding mode: imm 0 | _MM_FROUND_NO_EXC)
inline __m512 roundscale_ps(__m512 a, int imm) {
  const F16 x = get<F16>(a);
  F16 r;
  for (int i = 0; i < 16; ++i) r[i] = (imm & 0xf3) == 0 ? std::nearbyint(x[i]) : std::nanf("");
  return put<__m512>(r);
}
// a * 2^floor(b)
inline __m512 scalef_ps(__m512 a, __m512 b) {
  return lanewise(a, b, [](float x, float y) { return std::ldexp(x, static_cast<int>(std::floor(y))); });
}
inline __m512 mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
  const F16 s = get<F16>(src), x = get<F16>(a);
  F16 r;
  for (int i = 0; i < 16; ++i) r[i] = (k >> i) & 1 ? x[i] : s[i];
  return put<__m512>(r);
}
inline __m512 maskz_mov_ps(__mmask16 k, __m512 a) { return mask_mov_ps(setzero_ps(), k, a); }
inline float reduce_max_ps(__m512 a) {
  const F16 x = get<F16>(a);
  float m = x[0];
  for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
inline float reduce_add_ps(__m512 a) {
  const F16 x = get<F16>(a);
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}

// ---- bf16
// dst[j] = src[j] + a[2j+1] b[2j+1] + a[2j] b[2j] (products of bf16 values are exact in float32)
inline __m512 dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  const F16 s = get<F16>(src);
  const U32 x = get<U32>(a), y = get<U32>(b);
  F16 r;
  for (int j = 0; j < 16; ++j) {
    const float hi = bf16_to_float(x[2 * j + 1]) * bf16_to_float(y[2 * j + 1]);
    const float lo = bf16_to_float(x[2 * j]) * bf16_to_float(y[2 * j]);
    r[j] = (s[j] + hi) + lo;
  }
  return put<__m512>(r);
}
// 32 bf16: b's 16 lanes, then a's
inline __m512bh cvtne2ps_pbh(__m512 a, __m512 b) {
  const F16 x = get<F16>(a), y = get<F16>(b);
  U32 r;
  for (int i = 0; i < 16; ++i) r[i] = float_to_bf16(y[i]), r[16 + i] = float_to_bf16(x[i]);
  return put<__m512bh>(r);
}
inline __m256bh cvtneps_pbh(__m512 a) {
  const F16 x = get<F16>(a);
  U16 r;
  for (int i = 0; i < 16; ++i) r[i] = float_to_bf16(x[i]);
  return put<__m256bh>(r);
}

}  // namespace astrai_avx512_emu

#undef _mm512_loadu_si512
#define _mm512_loadu_si512 astrai_avx512_emu::loadu_si512
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 astrai_avx512_emu::storeu_si512
#undef _mm512_store_si512
#define _mm512_store_si512 astrai_avx512_emu::storeu_si512
#undef _mm256_loadu_si256
#define _mm256_loadu_si256 astrai_avx512_emu::loadu_si256
#undef _mm256_storeu_si256
#define _mm256_storeu_si256 astrai_avx512_emu::storeu_si256
#undef _mm512_load_ps
#define _mm512_load_ps astrai_avx512_emu::load_ps
#undef _mm512_store_ps
#define _mm512_store_ps astrai_avx512_emu::store_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 astrai_avx512_emu::setzero_si512
#undef _mm512_setzero_ps
#define _mm512_setzero_ps astrai_avx512_emu::setzero_ps
#undef _mm512_set1_ps
#define _mm512_set1_ps astrai_avx512_emu::set1_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 astrai_avx512_emu::set1_epi32
#undef _mm512_set_epi32
#define _mm512_set_epi32 astrai_avx512_emu::set_epi32
#undef _mm512_unpacklo_epi32
#define _mm512_unpacklo_epi32 astrai_avx512_emu::unpacklo_epi32
#undef _mm512_unpackhi_epi32
#define _mm512_unpackhi_epi32 astrai_avx512_emu::unpackhi_epi32
#undef _mm512_unpacklo_epi64
#define _mm512_unpacklo_epi64 astrai_avx512_emu::unpacklo_epi64
#undef _mm512_unpackhi_epi64
#define _mm512_unpackhi_epi64 astrai_avx512_emu::unpackhi_epi64
#undef _mm512_shuffle_i32x4
#define _mm512_shuffle_i32x4 astrai_avx512_emu::shuffle_i32x4
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 astrai_avx512_emu::cvtepu16_epi32
#undef _mm512_or_si512
#define _mm512_or_si512 astrai_avx512_emu::or_si512
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 astrai_avx512_emu::slli_epi32
#undef _mm512_add_epi32
#define _mm512_add_epi32 astrai_avx512_emu::add_epi32
#undef _mm512_cmple_epi32_mask
#define _mm512_cmple_epi32_mask astrai_avx512_emu::cmple_epi32_mask
#undef _mm512_cmpgt_epi32_mask
#define _mm512_cmpgt_epi32_mask astrai_avx512_emu::cmpgt_epi32_mask
#undef _mm512_add_ps
#define _mm512_add_ps astrai_avx512_emu::add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps astrai_avx512_emu::sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps astrai_avx512_emu::mul_ps
#undef _mm512_max_ps
#define _mm512_max_ps astrai_avx512_emu::max_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps astrai_avx512_emu::fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps astrai_avx512_emu::fnmadd_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps astrai_avx512_emu::roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps astrai_avx512_emu::scalef_ps
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps astrai_avx512_emu::mask_mov_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps astrai_avx512_emu::maskz_mov_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps astrai_avx512_emu::reduce_max_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps astrai_avx512_emu::reduce_add_ps
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps astrai_avx512_emu::dpbf16_ps
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh astrai_avx512_emu::cvtne2ps_pbh
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh astrai_avx512_emu::cvtneps_pbh
