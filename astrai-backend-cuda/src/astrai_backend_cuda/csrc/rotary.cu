// rotary_emb: interleaved-pair RoPE, apply_rotary_emb's contract. Pair i of a head,
// (x[2i], x[2i+1]) read as x[2i] + j x[2i+1], is multiplied by cos_i + j sin_i from freqs
// [token, i] = (cos, sin), in float32, and rounded once to the storage type. One thread rotates
// 4 pairs (16-byte loads and stores) or, for unaligned rows, 1 pair; the (cos, sin) row of a
// token is read by each of its heads from L1. `out` may be `x`: each thread reads before it writes.
#include "common.cuh"
#include "kernels.h"

namespace astrai {
namespace {

constexpr int kThreads = 256;

template <typename T, int PAIRS>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const RotaryArgs a) {
  const int half = a.head_dim / 2;
  const int per_row = half / PAIRS;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= a.n_tokens * a.n_heads * per_row) return;
  const int c = static_cast<int>(i % per_row);
  const int64_t th = i / per_row;
  const int h = static_cast<int>(th % a.n_heads);
  const int64_t t = th / a.n_heads;
  const T* x = static_cast<const T*>(a.x) + t * a.x_stride_t + h * a.x_stride_h + 2 * PAIRS * c;
  T* out = static_cast<T*>(a.out) + t * a.out_stride_t + h * a.out_stride_h + 2 * PAIRS * c;
  const float* f = a.freqs + (t * half + int64_t(PAIRS) * c) * 2;
  if constexpr (PAIRS == 4) {
    float v[8], r[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(x), v);
    const float4 f0 = reinterpret_cast<const float4*>(f)[0], f1 = reinterpret_cast<const float4*>(f)[1];
    const float cs[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      r[2 * p] = v[2 * p] * cs[2 * p] - v[2 * p + 1] * cs[2 * p + 1];
      r[2 * p + 1] = v[2 * p] * cs[2 * p + 1] + v[2 * p + 1] * cs[2 * p];
    }
    *reinterpret_cast<uint4*>(out) = pack8<T>(r);
  } else {
    const float2 v = unpack2<T>(*reinterpret_cast<const uint32_t*>(x));
    const float2 cs = *reinterpret_cast<const float2*>(f);
    *reinterpret_cast<uint32_t*>(out) = pack2<T>(v.x * cs.x - v.y * cs.y, v.x * cs.y + v.y * cs.x);
  }
}

template <typename T>
cudaError_t run_rotary(const RotaryArgs& a, cudaStream_t stream) {
  const int pairs = a.vec16 ? 4 : 1;
  const int64_t threads = a.n_tokens * a.n_heads * (a.head_dim / 2 / pairs);
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads));
  return a.vec16 ? launch(rotary_kernel<T, 4>, grid, dim3(kThreads), 0, 0, stream, a)
                 : launch(rotary_kernel<T, 1>, grid, dim3(kThreads), 0, 0, stream, a);
}

}  // namespace

cudaError_t rotary(const RotaryArgs& a, DType dtype, cudaStream_t stream) {
  if (a.head_dim < 2 || a.head_dim % 2 || (a.vec16 && a.head_dim % 8)) return cudaErrorInvalidValue;
  if (a.n_tokens == 0 || a.n_heads == 0) return cudaSuccess;
  return dtype == DType::kBFloat16 ? run_rotary<__nv_bfloat16>(a, stream) : run_rotary<__half>(a, stream);
}

}  // namespace astrai
