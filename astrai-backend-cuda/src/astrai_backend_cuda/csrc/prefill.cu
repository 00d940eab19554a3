// attn_paged_prefill: causal attention of a ragged batch of query tiles over the paged pool.
//
// Grid (n_heads, num_q_tiles): one block per (head, 64-row Q tile); q_tile_to_batch and
// q_tile_to_index name the tile's request and its tile index within the request. Request b's row j
// sits at position kv_len - q_len + j (a request resuming after a prefix hit attends to its cached
// positions) and sees positions 0 .. its own, or in a sliding window (window > 0) the last `window`
// of them: the tile's K/V loop then starts at the tile holding its row 0's first. Scores may be
// soft-capped (softcap > 0). Four warps own 16 query rows each. K/V tiles of 64
// positions are gathered by slot through req_to_token with cp.async (double-buffered, slots fetched
// a tile ahead) into XOR-swizzled shared memory; S = Q K^T and O += P V run on tensor cores
// (mma.m16n8k16 with ldmatrix), the online softmax in float32 registers (FlashAttention-2 style).
// Heads are the fastest grid dimension, so the heads of a GQA group, which read the same K/V
// rows, run side by side and share them through L2.
// An int8 pool (K, V or both; PrefillArgs): its rows are staged raw, then converted to T integers
// (exact) for the tensor cores; S is multiplied by each position's K scale before the softmax, P by
// its V scale before P V.
#include "common.cuh"
#include "kernels.h"
#include "ptx.cuh"

namespace astrai {
namespace {

constexpr int kThreads = 128;
constexpr int kTileQ = kPrefillTileQ;
constexpr int kTileK = 64;
static_assert(kTileQ == 16 * kThreads / 32, "each warp owns 16 query rows");

template <int D>
struct PrefillShape {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kPassesQ = kTileQ / kRowsPerPass;
  static constexpr int kPassesK = kTileK / kRowsPerPass;
  static constexpr int kTileElems = kTileK * D;
  // Q, 2 x K, 2 x V (of T: int8 rows are converted as they are stored), then 2 x K scales, 2 x V scales
  static constexpr size_t kSmemBytes = size_t(kTileQ * D + 4 * kTileElems) * 2 + 4 * kTileK * sizeof(float);
  static_assert(kTileQ == kTileK, "Q and K/V tiles share the swizzled [64][D] layout");
  static_assert(kChunks >= 8, "the swizzle permutes 8 chunks");
};

// Element offset of chunk c of `row` in a [64][D] tile; chunk ^ (row % 8) spreads the 8 rows an
// ldmatrix reads over all banks.
template <int D>
__device__ __forceinline__ int tile_off(int row, int c) {
  return row * D + ((c ^ (row & 7)) << 3);
}

// 8 int8 values (8 bytes) -> 8 values of T (exact: integers up to 127 fit bf16's and fp16's significands).
template <typename T>
__device__ __forceinline__ uint4 int8_to_storage(const uint2& raw) {
  float f[8];
  unpack8_i8(raw, f);
  return pack8<T>(f);
}

template <typename T, bool K8, bool V8, int D>
__global__ void __launch_bounds__(kThreads) paged_prefill_kernel(const PrefillArgs a) {
  using S = PrefillShape<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = qs + kTileQ * D;
  T* vs = ks + 2 * S::kTileElems;
  float* k_sc = reinterpret_cast<float*>(vs + 2 * S::kTileElems);  // [2][kTileK] (K8)
  float* v_sc = k_sc + 2 * kTileK;                                  // [2][kTileK] (V8)

  const int hq = blockIdx.x, tile = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int b = a.q_tile_to_batch[tile];
  const int row0 = a.q_tile_to_index[tile] * kTileQ;
  const int q_start = a.qo_indptr[b], q_len = a.qo_indptr[b + 1] - q_start;
  const int kv_len = a.kv_indptr[b + 1] - a.kv_indptr[b];
  const int rows = imin(kTileQ, q_len - row0);
  const int first_pos = kv_len - q_len + row0;  // position of the tile's row 0
  if (rows <= 0 || first_pos < 0) return;       // a tile map or lengths outside the contract
  const int kv_end = first_pos + rows;          // the tile's last row sees positions < kv_end
  const int n_kv_tiles = ceil_div(kv_end, kTileK);
  // A row at position p sees positions > p - win (win: no limit without a window); the K/V loop
  // starts at the tile of the first position row 0 sees.
  const int win = a.window > 0 ? a.window : (1 << 30);
  const int j0 = imax(0, first_pos - win + 1) / kTileK;
  const int hkv = hq / (a.n_heads / a.n_kv_heads);
  const int64_t slot_stride = int64_t(a.n_kv_heads) * D;  // values per slot
  const int32_t* r2t = a.req_to_token + a.req_pool_indices[b] * a.req_to_token_stride;
  const void* k_cache = static_cast<const unsigned char*>(a.k_cache) + hkv * D * (K8 ? 1 : sizeof(T));
  const void* v_cache = static_cast<const unsigned char*>(a.v_cache) + hkv * D * (V8 ? 1 : sizeof(T));
  const int lc = tid % S::kChunks, lr = tid / S::kChunks;  // loader: chunk, first row

  {  // Q tile; rows past the request are zero-filled (computed, never stored)
    const T* q = static_cast<const T*>(a.q) + int64_t(q_start + row0) * a.q_stride_t + int64_t(hq) * a.q_stride_h;
#pragma unroll
    for (int p = 0; p < S::kPassesQ; ++p) {
      const int r = p * S::kRowsPerPass + lr;
      cp_async_16(qs + tile_off<D>(r, lc), q + int64_t(r < rows ? r : 0) * a.q_stride_t + lc * 8, r < rows);
    }
  }
  // K/V tiles: a T side is copied with cp.async into its two buffers. An int8 side's rows go by
  // cp.async (8 bytes a chunk) into two raw int8 buffers, which take the place of its second T
  // buffer; once a tile has landed, each thread converts the chunks it copied into the side's one T
  // buffer (exact: integers up to 127 fit bf16's and fp16's significands), before the barrier that
  // precedes the compute. The scales go by cp.async too. Rows past kv_end are zero-filled.
  int slots[S::kPassesK];
  auto raw = [&](T* side, int j) {  // an int8 side's raw buffer of tile j
    return reinterpret_cast<int8_t*>(side + S::kTileElems) + (j & 1) * kTileK * D;
  };
  auto fetch_slots = [&](int j) {
#pragma unroll
    for (int p = 0; p < S::kPassesK; ++p) {
      const int pos = j * kTileK + p * S::kRowsPerPass + lr;
      slots[p] = (j < n_kv_tiles && pos < kv_end) ? r2t[pos] : 0;
    }
  };
  auto issue_kv = [&](int j) {
#pragma unroll
    for (int p = 0; p < S::kPassesK; ++p) {
      const int r = p * S::kRowsPerPass + lr;
      const bool valid = j * kTileK + r < kv_end;  // else zero-filled: finite, and masked
      const int64_t off = int64_t(slots[p]) * slot_stride + lc * 8;
      if constexpr (K8)
        cp_async_8(raw(ks, j) + r * D + lc * 8, static_cast<const int8_t*>(k_cache) + off, valid);
      else
        cp_async_16(ks + (j & 1) * S::kTileElems + tile_off<D>(r, lc), static_cast<const T*>(k_cache) + off, valid);
      if constexpr (V8)
        cp_async_8(raw(vs, j) + r * D + lc * 8, static_cast<const int8_t*>(v_cache) + off, valid);
      else
        cp_async_16(vs + (j & 1) * S::kTileElems + tile_off<D>(r, lc), static_cast<const T*>(v_cache) + off, valid);
      const int64_t at = int64_t(slots[p]) * a.n_kv_heads + hkv;
      if (K8 && lc == 0) cp_async_4(k_sc + (j & 1) * kTileK + r, a.k_scale + at, valid);
      if (V8 && lc == 0) cp_async_4(v_sc + (j & 1) * kTileK + r, a.v_scale + at, valid);
    }
  };
  auto land_kv = [&](int j) {  // this thread's chunks of the int8 sides' tile j, into their T buffers
#pragma unroll
    for (int p = 0; p < S::kPassesK; ++p) {
      const int r = p * S::kRowsPerPass + lr;
      if constexpr (K8)
        *reinterpret_cast<uint4*>(ks + tile_off<D>(r, lc)) =
            int8_to_storage<T>(*reinterpret_cast<const uint2*>(raw(ks, j) + r * D + lc * 8));
      if constexpr (V8)
        *reinterpret_cast<uint4*>(vs + tile_off<D>(r, lc)) =
            int8_to_storage<T>(*reinterpret_cast<const uint2*>(raw(vs, j) + r * D + lc * 8));
    }
  };
  fetch_slots(j0);
  issue_kv(j0);
  cp_async_commit();
  fetch_slots(j0 + 1);

  const int g = lane / 4, t4 = lane % 4;  // mma fragment coordinates
  const int wrow = warp * 16;              // this warp's first row of the tile
  const float sl2 = a.scale * kLog2e;
  // the soft-cap in base-2 units: softcap * tanh(s / softcap) of a score s is cap * tanh(s2 / cap), s2 = s log2 e
  const float cap = a.softcap * kLog2e, inv_cap = a.softcap > 0.f ? 1.f / cap : 0.f;
  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows g and g + 8, base-2 units
  float l_run[2] = {0.f, 0.f};              // this lane's part of the row sums

  for (int j = j0; j < n_kv_tiles; ++j) {
    if (j + 1 < n_kv_tiles) {
      issue_kv(j + 1);
      fetch_slots(j + 2);
    }
    cp_async_commit();
    cp_async_wait<1>();  // Q and K/V tile j have landed
    if constexpr (K8 || V8) land_kv(j);  // the T buffer of an int8 side was freed by the last barrier
    __syncthreads();
    if (j == j0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], qs + tile_off<D>(wrow + (lane % 8) + 8 * ((lane / 8) % 2), 2 * kk + lane / 16));
    }
    const T* kt = ks + (K8 ? 0 : (j & 1) * S::kTileElems);
    const T* vt = vs + (V8 ? 0 : (j & 1) * S::kTileElems);
    const float* kst = k_sc + (j & 1) * kTileK;  // int8 sides: each position's scale
    const float* vst = v_sc + (j & 1) * kTileK;

    float s[kTileK / 8][4];  // S = Q K^T: 8 column blocks of 8 positions
#pragma unroll
    for (int n = 0; n < kTileK / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kTileK / 16; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, kt + tile_off<D>(np * 16 + (lane % 8) + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
        mma_16816<T>(s[2 * np], qf[kk], kb[0], kb[1]);
        mma_16816<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    }

    // Scale to base 2 and soft-cap; mask positions after a row's own (and past kv_end), and before
    // its window, where the tile reaches them.
    const bool masked = (j + 1) * kTileK - 1 > first_pos + wrow || (j + 1) * kTileK > kv_end ||
                        j * kTileK <= first_pos + wrow + 15 - win;
#pragma unroll
    for (int n = 0; n < kTileK / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kv = j * kTileK + n * 8 + 2 * t4 + (e & 1);
        const int pos = first_pos + wrow + g + 8 * (e >> 1);
        const float x = (K8 ? s[n][e] * kst[n * 8 + 2 * t4 + (e & 1)] : s[n][e]) * sl2;
        s[n][e] = (masked && (kv > pos || kv >= kv_end || kv <= pos - win)) ? -INFINITY
                  : inv_cap > 0.f                                          ? cap * tanhf(x * inv_cap)
                                                                           : x;
      }

    // Online softmax per row. Without a window, tile 0 holds position 0, visible to every row, so m
    // is finite; in a window a row may see nothing of this tile yet (m stays -inf: exponents from 0).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kTileK / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m_run[r], mx);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run[r] - m_ref);
      m_run[r] = m_new;
      l_run[r] *= alpha;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int n = 0; n < kTileK / 8; ++n) {
        s[n][2 * r] = exp2f(s[n][2 * r] - m_ref);
        s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - m_ref);
        l_run[r] += s[n][2 * r] + s[n][2 * r + 1];
      }
    }

    // O += P V: the accumulators of two column blocks form one A fragment (P in T precision; times
    // each position's scale for an int8 V, whose tile holds the integers).
    if constexpr (V8) {
#pragma unroll
      for (int n = 0; n < kTileK / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= vst[n * 8 + 2 * t4 + (e & 1)];
    }
#pragma unroll
    for (int kt2 = 0; kt2 < kTileK / 16; ++kt2) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kt2][0], s[2 * kt2][1]), pack2<T>(s[2 * kt2][2], s[2 * kt2][3]),
                              pack2<T>(s[2 * kt2 + 1][0], s[2 * kt2 + 1][1]),
                              pack2<T>(s[2 * kt2 + 1][2], s[2 * kt2 + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vt + tile_off<D>(kt2 * 16 + (lane % 8) + 8 * ((lane / 8) % 2), 2 * dp + lane / 16));
        mma_16816<T>(o[2 * dp], pa, vb[0], vb[1]);
        mma_16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // buffer j & 1 is refilled at iteration j + 1
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv[r] = 1.f / l;
  }
  // Stage the warp's 16 rows in its own rows of the Q tile, then store them 16 bytes at a time.
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<uint32_t*>(qs + tile_off<D>(wrow + g + 8 * r, n) + 2 * t4) =
          pack2<T>(o[n][2 * r] * inv[r], o[n][2 * r + 1] * inv[r]);
  __syncwarp();
  T* out = static_cast<T*>(a.out) + int64_t(q_start + row0) * a.out_stride_t + int64_t(hq) * a.out_stride_h;
  for (int i = lane; i < 16 * S::kChunks; i += 32) {
    const int r = wrow + i / S::kChunks, c = i % S::kChunks;
    if (r < rows)
      *reinterpret_cast<uint4*>(out + int64_t(r) * a.out_stride_t + c * 8) =
          *reinterpret_cast<const uint4*>(qs + tile_off<D>(r, c));
  }
}

template <typename T, bool K8, bool V8, int D>
cudaError_t run_prefill(const PrefillArgs& a, cudaStream_t stream) {
  using S = PrefillShape<D>;
  return launch(paged_prefill_kernel<T, K8, V8, D>, dim3(a.n_heads, a.num_q_tiles), dim3(kThreads), S::kSmemBytes,
                S::kSmemBytes, stream, a);
}

template <typename T, bool K8, bool V8>
cudaError_t run_prefill(const PrefillArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return run_prefill<T, K8, V8, 64>(a, stream);
    case 128: return run_prefill<T, K8, V8, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t run_prefill(const PrefillArgs& a, cudaStream_t stream) {
  const bool k8 = a.k_scale != nullptr, v8 = a.v_scale != nullptr;
  if (k8) return v8 ? run_prefill<T, true, true>(a, stream) : run_prefill<T, true, false>(a, stream);
  return v8 ? run_prefill<T, false, true>(a, stream) : run_prefill<T, false, false>(a, stream);
}

}  // namespace

cudaError_t paged_prefill(const PrefillArgs& a, DType dtype, cudaStream_t stream) {
  if (a.n_kv_heads < 1 || a.n_heads % a.n_kv_heads || a.window < 0 || !(a.softcap >= 0.f)) return cudaErrorInvalidValue;
  if (a.num_q_tiles == 0) return cudaSuccess;
  return dtype == DType::kBFloat16 ? run_prefill<__nv_bfloat16>(a, stream) : run_prefill<__half>(a, stream);
}

}  // namespace astrai
