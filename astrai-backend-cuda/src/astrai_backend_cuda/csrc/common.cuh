// Device helpers shared by the astrai kernels: storage-type conversions, warp reductions,
// and a kernel launcher. Plain CUDA: no torch header may be included from a kernel file,
// so that every kernel translation unit compiles standalone in seconds.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace astrai {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Conversions between a 16-bit storage type and float, two elements at a time.
template <typename T>
struct Storage;

template <>
struct Storage<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(Pair v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ Pair from_float2(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
};

template <>
struct Storage<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float2 to_float2(Pair v) { return __half22float2(v); }
  static __device__ __forceinline__ Pair from_float2(float lo, float hi) { return __floats2half2_rn(lo, hi); }
};

// 16 bytes = 8 elements of T -> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[8]) {
  const auto* pairs = reinterpret_cast<const typename Storage<T>::Pair*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Storage<T>::to_float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// 8 floats -> 16 bytes = 8 elements of T (round to nearest even).
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  uint4 raw;
  auto* pairs = reinterpret_cast<typename Storage<T>::Pair*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = Storage<T>::from_float2(in[2 * i], in[2 * i + 1]);
  return raw;
}

// Two floats -> one 32-bit register of two T (low half = lo), the layout of an mma operand.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const typename Storage<T>::Pair p = Storage<T>::from_float2(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t raw) {
  return Storage<T>::to_float2(*reinterpret_cast<const typename Storage<T>::Pair*>(&raw));
}

// 8 bytes = 8 int8 values -> 8 floats (exact).
__device__ __forceinline__ void unpack8_i8(const uint2& raw, float (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<float>(static_cast<int8_t>((raw.x >> (8 * i)) & 0xffu));
    out[4 + i] = static_cast<float>(static_cast<int8_t>((raw.y >> (8 * i)) & 0xffu));
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// One KV head's row of D = 8 * (lanes holding values) elements quantized by one warp, as
// astrai.kvcache.quant.quantize: lane i < D / 8 passes its 8 values in x (other lanes any finite
// values with `holds` false), receives them as int8 in the returned 8 bytes; `scale` is amax / 127
// on every lane. 127 / amax and amax / 127 are IEEE divisions (nvcc's default -prec-div).
__device__ __forceinline__ uint2 quantize8_warp(const float (&x)[8], bool holds, float& scale) {
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = fmaxf(amax, holds ? fabsf(x[e]) : 0.f);
  amax = warp_max(amax);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  scale = amax / 127.f;
  uint2 raw{0u, 0u};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float r = fminf(fmaxf(rintf(x[e] * inv), -127.f), 127.f);
    const uint32_t byte = static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(r)));
    if (e < 4)
      raw.x |= byte << (8 * e);
    else
      raw.y |= byte << (8 * (e - 4));
  }
  return raw;
}

// Let `kernel` use up to `smem_max` bytes of dynamic shared memory (above the 48 KiB default),
// once per device and kernel.
template <typename... Params>
cudaError_t allow_smem(void (*kernel)(Params...), size_t smem_max) {
  if (smem_max <= 48 * 1024) return cudaSuccess;
  static unsigned long long configured = 0;  // bit d: done on device d (a race only repeats it)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  const unsigned long long bit = 1ull << (device & 63);
  if (err != cudaSuccess || (configured & bit)) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_max));
  if (err == cudaSuccess) configured |= bit;
  return err;
}

// Launch with `smem` bytes of dynamic shared memory; `smem_max` is the most this kernel ever uses.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, size_t smem_max,
                   cudaStream_t stream, Args&&... args) {
  const cudaError_t err = allow_smem(kernel, smem_max);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace astrai
