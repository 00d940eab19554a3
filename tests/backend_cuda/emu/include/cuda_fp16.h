// CPU emulator: float16 storage type and the conversions the kernels use (GCC's _Float16, RNE).
#pragma once
#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __half { uint16_t bits; };
struct __half2 { __half x, y; };

inline float __half2float(__half v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, 2);
  return static_cast<float>(h);
}

inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  __half r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}

inline float2 __half22float2(__half2 v) { return {__half2float(v.x), __half2float(v.y)}; }
inline __half2 __floats2half2_rn(float lo, float hi) { return {__float2half_rn(lo), __float2half_rn(hi)}; }
