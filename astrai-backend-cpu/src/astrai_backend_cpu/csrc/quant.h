// The tile layout of the quantized linears (astrai.model.quant documents it), shared by quant.cpp
// (the ops, and their AVX512-BF16 code) and quant_avx2.cpp (their float32 code for AVX2 + FMA
// CPUs without AVX512-BF16).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// The float32 kernels of quant_avx2.cpp: compiled where the compiler targets AVX2, FMA and F16C
// but not AVX512-BF16 (which has kernels of its own, for bf16 and float32 rows).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512BF16__)
#define ASTRAI_QUANT_AVX2 1
#endif

namespace astrai_cpu::quant {

constexpr int64_t TILE = 16;
// Bytes ahead that each tile's stream of group records is prefetched: into L1 3 KB ahead
// (linear.cpp's distance), and into L2 12 KB ahead, so that more of the stream is in flight from
// memory than L1's fill buffers hold (on an AMX Xeon, 2 cores, weights from memory: a whole
// decode step of the default model 7.7 -> 6.3 ms for 1 row, 12.7 -> 11.0 ms for 3).
constexpr int64_t PF_BYTES = 3072;
constexpr int64_t PF_FAR_BYTES = 12288;

// The layout's parameters, as astrai.model.quant.QuantLayout.ints(): n, k, bits, group, has_min,
// f16_scales, signed (4-bit codes read as -8..7 instead of 0..15; 8-bit codes are always int8).
struct Layout {
  int64_t n, k, bits, group, has_min, f16, sign;
  int64_t groups() const { return k / group; }
  int64_t scale_bytes() const { return TILE * (f16 ? 2 : 4); }
  int64_t code_bytes() const { return TILE * group * bits / 8; }
  int64_t record() const { return scale_bytes() * (1 + has_min) + code_bytes(); }
  int64_t tiles() const { return (n + TILE - 1) / TILE; }
  int64_t tile_bytes() const { return groups() * record(); }
};

#if defined(ASTRAI_QUANT_AVX2)
// quant_linear on float32 rows: x [M, k] (contiguous), xsum [M, groups] the groups' sums of x
// (nullptr without mins), bias [n] or nullptr -> out [M, n] float32.
void linear_f32_avx2(const float* x, int64_t M, const float* xsum, const uint8_t* packed, const Layout& L,
                     const float* bias, float* out);
// quant_weight_t in float32: the weight dequantized, transposed, out [k, n].
void weight_t_f32_avx2(const uint8_t* packed, const Layout& L, float* out);
#endif

}  // namespace astrai_cpu::quant
