// CPU emulator of the small part of the CUDA runtime and device built-ins that the astrai kernels
// use. Blocks run one after another; the threads of a block are fibers (emu.cpp) switched at
// barriers, so __syncthreads, shuffles, ldmatrix and mma keep their collective semantics.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

extern dim3 threadIdx, blockIdx, blockDim, gridDim;

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 719 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
using cudaStream_t = void*;
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  void* attrs;
  unsigned numAttrs;
};

// emu.cpp
void emu_syncthreads();
void emu_syncwarp();
uint64_t emu_shfl_xor(uint64_t bits, int lane_mask);
void emu_fail(const char* what);
cudaError_t emu_run_grid(const cudaLaunchConfig_t& config, unsigned char* smem, size_t smem_size,
                         const std::function<void()>& body);
const char* cudaGetErrorString(cudaError_t err);

inline void __syncthreads() { emu_syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_syncwarp(); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of a register-sized value");
  if (mask != 0xffffffffu) emu_fail("__shfl_xor_sync with a partial mask");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = emu_shfl_xor(bits, lane_mask);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

template <typename F>
cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int value) {
  return value <= 227 * 1024 ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F*, int, size_t) {
  *n = 1;
  return cudaSuccess;
}

// The dynamic shared memory of this translation unit (declared by emu.h in the kernels' namespace).
namespace astrai {
namespace {
extern unsigned char smem[];
}
}  // namespace astrai

template <typename... Exp, typename... Act>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Exp...), Act&&... args) {
  return emu_run_grid(*config, astrai::smem, EMU_SMEM_BYTES, [&] { kernel(args...); });
}
