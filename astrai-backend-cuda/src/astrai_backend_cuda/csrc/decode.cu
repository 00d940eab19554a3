// attn_paged_decode: one query token per request, K/V read straight from the paged pool through
// req_to_token, split-K over the sequence, then a combine pass.
//
// Grid (num_splits, n_kv_heads, batch); a block of 4 warps serves the `group` query heads that
// share one KV head, so each K/V row is loaded once for all of them (GQA). The block's split is a
// range of the positions the request attends (all of them, or a sliding window's last `window`),
// streamed in tiles of 32 tokens through a multi-stage cp.async pipeline
// (rows gathered by slot, 16-byte copies); per tile:
//   scores   4 threads per token, each a quarter of the row, reduced with two shuffles (then
//            soft-capped when softcap > 0);
//   softmax  one warp per head, one lane per token: online max / sum in float32 (base-2 exponent);
//   P.V      each thread owns 8 output dims of up to four heads and a subset of the tile's tokens.
// The block writes its normalised partial output and log-sum-exp; the combine kernel merges splits.
// The new token (position seq_len - 1) is read from new_k/new_v and written to the pool by the
// block whose split holds it, so no other block of this launch reads its slot.
// An int8 pool (K, V or both; DecodeArgs): its rows are staged as int8 with their scales (half the
// bytes of a bf16 row), the score phase multiplies each token's dot by K's scale and the P.V phase
// each probability by V's; the new token is quantized by one warp (K: warp 0, V: warp 1) and read
// back from the pool after a barrier.
#include <type_traits>

#include "common.cuh"
#include "kernels.h"
#include "ptx.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = kDecodeTile;         // one token per lane in the softmax phase
constexpr int kSlices = kThreads / kTile;  // threads per token in the score phase
constexpr int kQuad = 4;                   // heads per thread in the P.V phase (one V load, four heads)
static_assert(kTile == 32, "the softmax phase maps one token to each lane");

// One of K and V in the pipeline's stages: rows of the model's dtype T (16-byte chunks of 8 values)
// or, from an int8 pool, rows of int8 (16-byte chunks of 16 values) with a float32 scale each.
template <typename T, bool Q8, int D>
struct Side {
  static constexpr int kBytes = Q8 ? 1 : 2;  // per value
  static constexpr int kPer = 16 / kBytes;   // values per 16-byte chunk
  static constexpr int kChunks = D / kPer;   // 16-byte chunks per row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kPasses = kTile / kRowsPerPass;
  static constexpr int kStageBytes = kTile * D * kBytes;
  static_assert(kChunks >= 4 && kTile % kRowsPerPass == 0, "head dims of 64 and more");

  // Byte offset of 16-byte chunk c of `row` in a stage. T rows: odd rows swizzled by 4 chunks, so the
  // score phase's reads (2 tokens x 4 slices per 8 lanes) are free of bank conflicts; int8 rows (half
  // as long): chunk ^ (row / 2) spreads the 8 rows one score-phase read touches over the banks.
  static __device__ __forceinline__ int off(int row, int c) {
    if constexpr (Q8)
      return row * D + ((c ^ ((row >> 1) & (kChunks - 1))) << 4);
    else
      return (row * D + ((c ^ ((row & 1) << 2)) << 3)) * 2;
  }

  // Values e0 .. e0 + 7 (e0 a multiple of 8) of `row` as floats; int8 rows give the integers (the scale
  // is applied to the score, or to the probability, once per token).
  static __device__ __forceinline__ void read8(const unsigned char* stage, int row, int e0, float (&f)[8]) {
    if constexpr (Q8)
      unpack8_i8(*reinterpret_cast<const uint2*>(stage + off(row, e0 / 16) + (e0 % 16)), f);
    else
      unpack8<T>(*reinterpret_cast<const uint4*>(stage + off(row, e0 / 8)), f);
  }
};

template <typename T, bool K8, bool V8, int D>
struct DecodeShape {
  using KS = Side<T, K8, D>;
  using VS = Side<T, V8, D>;
  static constexpr int kChunks = D / 8;  // 8-value chunks per row (the P.V phase's output chunks)
  static constexpr int kStages = D >= 128 ? 3 : 4;
  static constexpr int kSliceChunks = kChunks / kSlices;
  static constexpr int kPvRows = kThreads / kChunks;  // (head quad, token subset) pairs of the P.V phase
  static constexpr int kStagesBytes = kStages * (KS::kStageBytes + VS::kStageBytes);
  static constexpr int kScaleFloats = kStages * kTile * (int(K8) + int(V8));
  static_assert(kChunks >= 8 && kChunks % kSlices == 0, "slices need D % 32 == 0, D >= 64");
  static_assert(kPvRows * kQuad * D * 4 <= kStagesBytes, "the P.V reduction fits the stages");

  // K and V stages, their scales (int8 sides), then float q [group][D], scores/probabilities
  // [group][kTile], m, l, alpha [group].
  static size_t smem_bytes(int group) {
    return size_t(kStagesBytes) + size_t(kScaleFloats) * 4 + size_t(group) * (D + kTile + 3) * sizeof(float);
  }
};

// The new token's row of one KV head into the pool: copied (16 bytes per thread, tid < D / 8), or
// quantized by one warp (its lanes < D / 8 hold 8 values each) with the scale written beside it.
template <typename T, bool Q8, int D>
__device__ __forceinline__ void store_new_row(const T* src, void* pool, float* scales, int64_t slot,
                                              int64_t slot_stride, int hkv, int n_kv, int tid, int quant_warp) {
  constexpr int kLanes = D / 8;
  if constexpr (!Q8) {
    if (tid < kLanes)
      *reinterpret_cast<uint4*>(static_cast<T*>(pool) + slot * slot_stride + tid * 8) =
          *reinterpret_cast<const uint4*>(src + tid * 8);
  } else {
    if (tid / 32 != quant_warp) return;
    const int lane = tid % 32;
    const bool holds = lane < kLanes;
    float x[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(src + (holds ? lane : 0) * 8), x);
    float scale;
    const uint2 q = quantize8_warp(x, holds, scale);
    if (holds) *reinterpret_cast<uint2*>(static_cast<int8_t*>(pool) + slot * slot_stride + lane * 8) = q;
    if (lane == 0) scales[slot * n_kv + hkv] = scale;
  }
}

template <typename T, bool K8, bool V8, int D>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeArgs a) {
  using S = DecodeShape<T, K8, V8, D>;
  using KS = typename S::KS;
  using VS = typename S::VS;
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = a.n_heads / a.n_kv_heads;
  unsigned char* ks = smem;
  unsigned char* vs = ks + S::kStages * KS::kStageBytes;
  float* k_sc = reinterpret_cast<float*>(vs + S::kStages * VS::kStageBytes);  // [kStages][kTile] (K8)
  float* v_sc = k_sc + (K8 ? S::kStages * kTile : 0);                         // [kStages][kTile] (V8)
  float* qs = reinterpret_cast<float*>(smem + S::kStagesBytes) + S::kScaleFloats;
  float* sp = qs + group * D;
  float* m_s = sp + group * kTile;
  float* l_s = m_s + group;
  float* alpha_s = l_s + group;

  const int split = blockIdx.x, hkv = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int seq_len = static_cast<int>(a.seq_lens[b]);
  const int chunk = ceil_div(ceil_div(a.max_len, a.num_splits), kTile) * kTile;
  const int first = a.window > 0 ? imax(0, seq_len - a.window) : 0;  // the first position attended
  const int start = first + split * chunk;
  const int end = split == a.num_splits - 1 ? seq_len : imin(seq_len, start + chunk);
  const int64_t bh0 = int64_t(b) * a.n_heads + int64_t(hkv) * group;  // (b, first head of the group)

  if (start >= end) {  // an empty split: weight zero in the combine
    for (int i = tid; i < group * D; i += kThreads) a.o_part[((bh0 + i / D) * a.max_splits + split) * D + i % D] = 0.f;
    if (tid < group) a.ml_part[(bh0 + tid) * a.max_splits + split] = -INFINITY;
    return;
  }

  const int last = seq_len - 1;
  const T* new_k = static_cast<const T*>(a.new_k) + b * a.new_k_stride_t + hkv * a.new_k_stride_h;
  const T* new_v = static_cast<const T*>(a.new_v) + b * a.new_v_stride_t + hkv * a.new_v_stride_h;
  const int64_t slot_stride = int64_t(a.n_kv_heads) * D;  // values per slot
  if (last < end) {  // this split holds the new token: store it in the pool
    const int64_t slot = a.out_cache_loc[b];
    store_new_row<T, K8, D>(new_k, static_cast<unsigned char*>(a.k_cache) + hkv * D * KS::kBytes, a.k_scale, slot,
                            slot_stride, hkv, a.n_kv_heads, tid, 0);
    store_new_row<T, V8, D>(new_v, static_cast<unsigned char*>(a.v_cache) + hkv * D * VS::kBytes, a.v_scale, slot,
                            slot_stride, hkv, a.n_kv_heads, tid, 1);
    // An int8 side reads the new row back from the pool (its quantized values), after this barrier.
    if constexpr (K8 || V8) __syncthreads();
  }
  const unsigned char* k_cache = static_cast<const unsigned char*>(a.k_cache) + hkv * D * KS::kBytes;
  const unsigned char* v_cache = static_cast<const unsigned char*>(a.v_cache) + hkv * D * VS::kBytes;

  // Queries of the group, pre-multiplied by scale * log2(e): scores come out in base-2 units, and so
  // does the soft-cap (softcap * tanh(s / softcap) of a score s is cap * tanh(s2 / cap) of s2 = s log2 e).
  const float qscale = a.scale * kLog2e;
  const float cap = a.softcap * kLog2e, inv_cap = a.softcap > 0.f ? 1.f / cap : 0.f;
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride_t + int64_t(hkv) * group * a.q_stride_h;
  for (int i = tid; i < group * S::kChunks; i += kThreads) {
    const int g = i / S::kChunks, c = i % S::kChunks;
    float f[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(q + g * a.q_stride_h + c * 8), f);
    float4* dst = reinterpret_cast<float4*>(qs + g * D + c * 8);
    dst[0] = make_float4(f[0] * qscale, f[1] * qscale, f[2] * qscale, f[3] * qscale);
    dst[1] = make_float4(f[4] * qscale, f[5] * qscale, f[6] * qscale, f[7] * qscale);
  }
  for (int g = tid; g < group; g += kThreads) {
    m_s[g] = -INFINITY;
    l_s[g] = 0.f;
  }

  // Loaders, one per side: thread copies chunk tid % kChunks of rows tid / kChunks + p * kRowsPerPass
  // (and, for an int8 side, the thread of chunk 0 the row's scale). Slots are fetched one tile ahead
  // into registers, so the dependent global load is off the issue path. The new token's row comes
  // from new_k/new_v on a T side (no block reads a slot this launch writes), from the pool on an int8
  // side (written above, before the barrier).
  const int32_t* r2t = a.req_to_token + a.req_pool_indices[b] * a.req_to_token_stride;
  const int n_tiles = ceil_div(end - start, kTile);
  int k_slots[KS::kPasses], v_slots[VS::kPasses];
  auto fetch = [&](auto side, int (&slots)[decltype(side)::kPasses], int tile) {
    using X = decltype(side);
    const int lr = tid / X::kChunks;
#pragma unroll
    for (int p = 0; p < X::kPasses; ++p) {
      const int pos = start + tile * kTile + p * X::kRowsPerPass + lr;
      slots[p] = (tile < n_tiles && pos < end) ? r2t[pos] : 0;
    }
  };
  auto load = [&](auto side, const int (&slots)[decltype(side)::kPasses], int tile, unsigned char* stages,
                  float* scales, const unsigned char* pool, const float* pool_scales, const T* fresh) {
    using X = decltype(side);
    constexpr bool kQ8 = X::kBytes == 1;
    const int lc = tid % X::kChunks, lr = tid / X::kChunks;
    unsigned char* dst = stages + (tile % S::kStages) * X::kStageBytes;
#pragma unroll
    for (int p = 0; p < X::kPasses; ++p) {
      const int row = p * X::kRowsPerPass + lr;
      const int pos = start + tile * kTile + row;
      const unsigned char* src = pool + int64_t(slots[p]) * slot_stride * X::kBytes;
      if (!kQ8 && pos == last) src = reinterpret_cast<const unsigned char*>(fresh);
      cp_async_16(dst + X::off(row, lc), src + lc * 16, pos < end);
      if (kQ8 && lc == 0)
        cp_async_4(scales + (tile % S::kStages) * kTile + row,
                   pool_scales + int64_t(slots[p]) * a.n_kv_heads + hkv, pos < end);
    }
  };
  auto fetch_slots = [&](int tile) {
    fetch(KS{}, k_slots, tile);
    fetch(VS{}, v_slots, tile);
  };
  auto issue = [&](int tile) {
    load(KS{}, k_slots, tile, ks, k_sc, k_cache, a.k_scale, new_k);
    load(VS{}, v_slots, tile, vs, v_sc, v_cache, a.v_scale, new_v);
  };

  fetch_slots(0);
#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    if (s < n_tiles) {
      issue(s);
      fetch_slots(s + 1);
    }
    cp_async_commit();
  }

  const int tt = tid / kSlices, sl = tid % kSlices;  // score phase: token, slice of its row
  const int pc = tid % S::kChunks, pr = tid / S::kChunks;  // P.V phase: output chunk, row
  // P.V rows: each owns a quad of heads and every ts_count-th token of the tile, so a V chunk is
  // converted once for up to four heads; the token subsets are added up after the loop.
  const int n_quads = ceil_div(group, kQuad);
  const int ts_count = S::kPvRows / n_quads;
  const bool pv_active = pr < ts_count * n_quads;
  const int ts = pr % ts_count, g0 = pr / ts_count * kQuad;
  float acc[kQuad][8];
#pragma unroll
  for (int h = 0; h < kQuad; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;

  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<S::kStages - 2>();  // tile i has landed
    __syncthreads();                  // ... for every thread; and tile i - 1's stage is free
    if (i + S::kStages - 1 < n_tiles) {
      issue(i + S::kStages - 1);
      fetch_slots(i + S::kStages);
    }
    cp_async_commit();
    const unsigned char* kt = ks + (i % S::kStages) * KS::kStageBytes;
    const unsigned char* vt = vs + (i % S::kStages) * VS::kStageBytes;
    const float* kst = k_sc + (i % S::kStages) * kTile;
    const float* vst = v_sc + (i % S::kStages) * kTile;
    const int n_valid = imin(kTile, end - (start + i * kTile));

    {  // scores: sp[g][tt] = q_g . k_tt (base-2 units, soft-capped), -inf past the split's end
      float kf[S::kSliceChunks][8];
#pragma unroll
      for (int j = 0; j < S::kSliceChunks; ++j) KS::read8(kt, tt, (sl + kSlices * j) * 8, kf[j]);
      const float k_scale = K8 ? kst[tt] : 1.f;
      for (int g = 0; g < group; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < S::kSliceChunks; ++j) {
          const float4* qv = reinterpret_cast<const float4*>(qs + g * D + (sl + kSlices * j) * 8);
          const float4 q0 = qv[0], q1 = qv[1];
          dot += q0.x * kf[j][0] + q0.y * kf[j][1] + q0.z * kf[j][2] + q0.w * kf[j][3] + q1.x * kf[j][4] +
                 q1.y * kf[j][5] + q1.z * kf[j][6] + q1.w * kf[j][7];
        }
        dot += __shfl_xor_sync(kFullMask, dot, 1);
        dot += __shfl_xor_sync(kFullMask, dot, 2);
        if (K8) dot *= k_scale;
        if (inv_cap > 0.f) dot = cap * tanhf(dot * inv_cap);
        if (sl == 0) sp[g * kTile + tt] = tt < n_valid ? dot : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax, one warp per head: the tile has a valid token, so m_new is finite.
    for (int g = warp; g < group; g += kWarps) {
      const float s = sp[g * kTile + lane];
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, warp_max(s));
      const float p = exp2f(s - m_new);
      sp[g * kTile + lane] = p;
      const float p_sum = warp_sum(p);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + p_sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    if (pv_active) {
      float alpha[kQuad];
#pragma unroll
      for (int h = 0; h < kQuad; ++h) alpha[h] = g0 + h < group ? alpha_s[g0 + h] : 0.f;
#pragma unroll
      for (int h = 0; h < kQuad; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] *= alpha[h];
      for (int t = ts; t < n_valid; t += ts_count) {
        float vf[8];
        VS::read8(vt, t, pc * 8, vf);
        const float v_scale = V8 ? vst[t] : 1.f;  // an int8 V's scale rides on the probability
#pragma unroll
        for (int h = 0; h < kQuad; ++h) {
          float p = g0 + h < group ? sp[(g0 + h) * kTile + t] : 0.f;
          if (V8) p *= v_scale;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[h][e] += p * vf[e];
        }
      }
    }
  }

  // Add up the token subsets of each head quad in the (now free) stage buffers, then normalise.
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [kPvRows][kQuad][D]
  if (pv_active && ts_count > 1)
#pragma unroll
    for (int h = 0; h < kQuad; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) red[(pr * kQuad + h) * D + pc * 8 + e] = acc[h][e];
  __syncthreads();
  if (!pv_active || ts != 0) return;
  for (int k = 1; k < ts_count; ++k)
#pragma unroll
    for (int h = 0; h < kQuad; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] += red[((pr + k) * kQuad + h) * D + pc * 8 + e];
#pragma unroll
  for (int h = 0; h < kQuad; ++h) {
    const int g = g0 + h;
    if (g >= group) break;
    const float l = l_s[g], inv = 1.f / l;
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = acc[h][e] * inv;
    const int64_t bh = bh0 + g;
    float4* dst = reinterpret_cast<float4*>(a.o_part + (bh * a.max_splits + split) * D + pc * 8);
    dst[0] = make_float4(o[0], o[1], o[2], o[3]);
    dst[1] = make_float4(o[4], o[5], o[6], o[7]);
    if (pc == 0) a.ml_part[bh * a.max_splits + split] = (m_s[g] + log2f(l)) * kLn2;
    if (a.num_splits == 1) *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + bh * D + pc * 8) = pack8<T>(o);
  }
}

// out[b, h] = sum_s w_s o_part[b, h, s] / sum_s w_s, w_s = exp(lse_s - max lse); one thread per 4 dims.
template <typename T, int D>
__global__ void __launch_bounds__(128)
    decode_combine_kernel(const float* o_part, const float* ml_part, T* out, int64_t n_bh, int max_splits,
                          int num_splits) {
  constexpr int kVecs = D / 4;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_bh * kVecs) return;
  const int64_t bh = i / kVecs;
  const int c = static_cast<int>(i % kVecs);
  const float* lse = ml_part + bh * max_splits;
  float m = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, lse[s]);
  float w_sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < num_splits; ++s) {
    const float w = exp2f((lse[s] - m) * kLog2e);
    const float4 o = reinterpret_cast<const float4*>(o_part + (bh * max_splits + s) * D)[c];
    acc.x += w * o.x;
    acc.y += w * o.y;
    acc.z += w * o.z;
    acc.w += w * o.w;
    w_sum += w;
  }
  const float inv = 1.f / w_sum;
  uint2 packed;
  packed.x = pack2<T>(acc.x * inv, acc.y * inv);
  packed.y = pack2<T>(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(out + bh * D + c * 4) = packed;
}

template <typename T, bool K8, bool V8, int D>
cudaError_t run_decode(const DecodeArgs& a, cudaStream_t stream) {
  using S = DecodeShape<T, K8, V8, D>;
  const int group = a.n_heads / a.n_kv_heads;
  cudaError_t err = launch(paged_decode_kernel<T, K8, V8, D>, dim3(a.num_splits, a.n_kv_heads, a.batch),
                           dim3(kThreads), S::smem_bytes(group), S::smem_bytes(kMaxDecodeGroup), stream, a);
  if (err != cudaSuccess || a.num_splits == 1) return err;
  const int64_t n_bh = int64_t(a.batch) * a.n_heads;
  const int64_t threads = n_bh * (D / 4);
  return launch(decode_combine_kernel<T, D>, dim3(static_cast<unsigned>((threads + 127) / 128)), dim3(128), 0, 0,
                stream, static_cast<const float*>(a.o_part), static_cast<const float*>(a.ml_part),
                static_cast<T*>(a.out), n_bh, a.max_splits, a.num_splits);
}

template <typename T, bool K8, bool V8, int D>
int blocks_per_sm(int group) {
  using S = DecodeShape<T, K8, V8, D>;
  if (allow_smem(paged_decode_kernel<T, K8, V8, D>, S::smem_bytes(kMaxDecodeGroup)) != cudaSuccess) return 0;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, paged_decode_kernel<T, K8, V8, D>, kThreads,
                                                    S::smem_bytes(group)) != cudaSuccess)
    return 0;
  return n;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// F<T, K8, V8, D>::call(args...) for the runtime storage type, pool kinds and head dim (D 64 or 128).
template <template <typename, bool, bool, int> class F, typename R, typename... Args>
R dispatch(DType dtype, bool k8, bool v8, int head_dim, R unsupported, Args&&... args) {
  auto by_dim = [&](auto t, auto kq, auto vq) -> R {
    using T = typename decltype(t)::type;
    constexpr bool kK8 = decltype(kq)::value, kV8 = decltype(vq)::value;
    switch (head_dim) {
      case 64: return F<T, kK8, kV8, 64>::call(std::forward<Args>(args)...);
      case 128: return F<T, kK8, kV8, 128>::call(std::forward<Args>(args)...);
      default: return unsupported;
    }
  };
  auto by_kinds = [&](auto t) -> R {
    using Yes = std::true_type;
    using No = std::false_type;
    if (k8) return v8 ? by_dim(t, Yes{}, Yes{}) : by_dim(t, Yes{}, No{});
    return v8 ? by_dim(t, No{}, Yes{}) : by_dim(t, No{}, No{});
  };
  return dtype == DType::kBFloat16 ? by_kinds(TypeTag<__nv_bfloat16>{}) : by_kinds(TypeTag<__half>{});
}

template <typename T, bool K8, bool V8, int D>
struct RunDecode {
  static cudaError_t call(const DecodeArgs& a, cudaStream_t stream) { return run_decode<T, K8, V8, D>(a, stream); }
};

template <typename T, bool K8, bool V8, int D>
struct BlocksPerSm {
  static int call(int group) { return blocks_per_sm<T, K8, V8, D>(group); }
};

}  // namespace

cudaError_t paged_decode(const DecodeArgs& a, DType dtype, cudaStream_t stream) {
  if (a.n_kv_heads < 1 || a.n_heads % a.n_kv_heads || a.n_heads / a.n_kv_heads > kMaxDecodeGroup ||
      a.num_splits < 1 || a.num_splits > a.max_splits || a.max_len < 1 || a.window < 0 || !(a.softcap >= 0.f))
    return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  return dispatch<RunDecode>(dtype, a.k_scale != nullptr, a.v_scale != nullptr, a.head_dim, cudaErrorInvalidValue,
                             a, stream);
}

int paged_decode_blocks_per_sm(DType dtype, int head_dim, int group, bool k8, bool v8) {
  if (group < 1 || group > kMaxDecodeGroup) return 0;
  return dispatch<BlocksPerSm>(dtype, k8, v8, head_dim, 0, group);
}

}  // namespace astrai
