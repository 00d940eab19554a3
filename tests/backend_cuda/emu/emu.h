// Force-included before every kernel source of the CPU emulator build (g++ -include emu.h):
// CUDA's execution-space keywords become nothing, and each translation unit gets the buffer
// that its kernels' `extern __shared__ unsigned char smem[]` refers to.
#pragma once

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

#define EMU_SMEM_BYTES (228 * 1024)

namespace astrai {
namespace {
__attribute__((aligned(16))) unsigned char smem[EMU_SMEM_BYTES];
}
}  // namespace astrai
