// CPU emulator's stand-in for the kernels' ptx.cuh: the same functions, with the documented
// semantics of cp.async, ldmatrix and mma.m16n8k16 implemented over the fibers of a warp.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

void emu_check_smem(const void* p, size_t bytes, const char* what);
// Every lane of the warp passes `bytes` bytes and receives all 32 lanes' values in lane order.
void emu_warp_exchange(const void* mine, size_t bytes, void* all);
unsigned emu_lane();
void emu_fail(const char* what);

namespace astrai {

// The copy happens at once: a wait can only be too early, never missed by the emulator.
inline void cp_async_16(void* dst, const void* src, bool valid) {
  emu_check_smem(dst, 16, "cp.async destination");
  if (valid && reinterpret_cast<uintptr_t>(src) % 16) emu_fail("cp.async source not 16-byte aligned");
  if (valid)
    std::memcpy(dst, src, 16);
  else
    std::memset(dst, 0, 16);
}

inline void cp_async_4(void* dst, const void* src, bool valid) {
  emu_check_smem(dst, 4, "cp.async destination");
  if (valid && reinterpret_cast<uintptr_t>(src) % 4) emu_fail("cp.async source not 4-byte aligned");
  if (valid)
    std::memcpy(dst, src, 4);
  else
    std::memset(dst, 0, 4);
}

inline void cp_async_8(void* dst, const void* src, bool valid) {
  emu_check_smem(dst, 8, "cp.async destination");
  if (valid && reinterpret_cast<uintptr_t>(src) % 8) emu_fail("cp.async source not 8-byte aligned");
  if (valid)
    std::memcpy(dst, src, 8);
  else
    std::memset(dst, 0, 8);
}

inline void cp_async_commit() {}

template <int N>
inline void cp_async_wait() {}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  emu_check_smem(row, 16, "ldmatrix row");
  const void* rows[32];
  emu_warp_exchange(&row, sizeof(row), rows);
  const unsigned lane = emu_lane();
  for (int j = 0; j < 4; ++j) {
    const uint16_t* p = static_cast<const uint16_t*>(rows[j * 8 + lane / 4]);
    r[j] = uint32_t(p[2 * (lane % 4)]) | (uint32_t(p[2 * (lane % 4) + 1]) << 16);
  }
  emu_syncwarp();  // the warp reads shared memory together: no lane writes before all have read
}

inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  emu_check_smem(row, 16, "ldmatrix row");
  const void* rows[32];
  emu_warp_exchange(&row, sizeof(row), rows);
  const unsigned lane = emu_lane();
  for (int j = 0; j < 4; ++j) {
    const uint16_t* lo = static_cast<const uint16_t*>(rows[j * 8 + 2 * (lane % 4)]);
    const uint16_t* hi = static_cast<const uint16_t*>(rows[j * 8 + 2 * (lane % 4) + 1]);
    r[j] = uint32_t(lo[lane / 4]) | (uint32_t(hi[lane / 4]) << 16);
  }
  emu_syncwarp();
}

inline float emu_to_float(uint16_t bits, const __nv_bfloat16*) { return __bfloat162float(__nv_bfloat16{bits}); }
inline float emu_to_float(uint16_t bits, const __half*) { return __half2float(__half{bits}); }

template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  struct Frag {
    uint32_t a[4], b[2];
  };
  const Frag mine = {{a[0], a[1], a[2], a[3]}, {b0, b1}};
  Frag all[32];
  emu_warp_exchange(&mine, sizeof(Frag), all);
  auto half = [](uint32_t reg, int k) { return uint16_t(k % 2 ? reg >> 16 : reg & 0xffff); };
  auto A = [&](int row, int k) {  // a[(row / 8) + 2 (k / 8)] of lane (row % 8) * 4 + (k % 8) / 2
    return emu_to_float(half(all[(row % 8) * 4 + (k % 8) / 2].a[row / 8 + 2 * (k / 8)], k), (const T*)nullptr);
  };
  auto B = [&](int k, int n) {  // b[k / 8] of lane n * 4 + (k % 8) / 2
    return emu_to_float(half(all[n * 4 + (k % 8) / 2].b[k / 8], k), (const T*)nullptr);
  };
  const int g = static_cast<int>(emu_lane() / 4), t = static_cast<int>(emu_lane() % 4);
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[e] += acc;
  }
}

}  // namespace astrai
