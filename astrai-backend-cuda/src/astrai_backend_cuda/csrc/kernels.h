// Host-side entry points of the astrai kernels: raw pointers, sizes and a stream, no torch types.
// bindings.cpp validates tensors and calls these; each returns the launch's cudaError_t
// (cudaErrorInvalidValue for a configuration no kernel is compiled for) and never synchronises.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace astrai {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// The largest n_heads / n_kv_heads (query heads per KV head) of the decode kernel.
constexpr int kMaxDecodeGroup = 16;
// Query rows per prefill tile: KVCache's PREFILL_Q_TILE (q_tile_to_batch is in these units).
constexpr int kPrefillTileQ = 64;
// Tokens per decode pipeline stage; split-K chunk lengths are multiples of it.
constexpr int kDecodeTile = 32;

// Head dims the attention kernels are compiled for.
inline bool head_dim_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Strides are in elements; a row (one token and head) is head_dim contiguous, 16-byte aligned elements.
//
// A quantized pool (astrai.kvcache.quant): K (V) of this layer is int8 [size, Hkv, D] with one float32
// scale per slot and head in k_scale (v_scale) [size, Hkv], contiguous; a null scale pointer means K (V)
// is kept in the model's dtype. Values are read as q * scale in float32; decode quantizes the new
// token's K/V as the reference does (round(x * (127 / amax)), scale amax / 127).
struct DecodeArgs {
  const void* q;  // [B, Hq, D]
  int64_t q_stride_t, q_stride_h;
  const void* new_k;  // [B, Hkv, D]: this step's K, written to k_cache[out_cache_loc[b]]
  int64_t new_k_stride_t, new_k_stride_h;
  const void* new_v;
  int64_t new_v_stride_t, new_v_stride_h;
  void* k_cache;  // this layer's pool [size, Hkv, D], contiguous
  void* v_cache;
  const int32_t* req_to_token;  // [num_reqs, req_to_token_stride]
  int64_t req_to_token_stride;
  const int64_t* req_pool_indices;  // [B]
  const int64_t* seq_lens;          // [B], >= 1
  const int64_t* out_cache_loc;     // [B]
  float* o_part;                    // [B, Hq, max_splits, D], contiguous
  float* ml_part;                   // [B, Hq, max_splits], contiguous: log-sum-exp of each split
  void* out;                        // [B, Hq, D], contiguous
  int batch, n_heads, n_kv_heads, head_dim;
  int max_len;     // >= 1; sets the split length (any value is correct; the longest range attended is fastest)
  int num_splits;  // 1 .. max_splits
  int max_splits;
  float scale;
  int window;     // > 0: request b attends positions seq_len - window .. seq_len - 1 only (sliding window)
  float softcap;  // > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax
  float* k_scale;  // non-null: k_cache is int8 (its new rows written with their scales here)
  float* v_scale;
};

cudaError_t paged_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream);

// Thread blocks of the decode kernel one SM can hold for this shape (0 if unsupported); k8/v8: an
// int8 K/V pool.
int paged_decode_blocks_per_sm(DType dtype, int head_dim, int group, bool k8 = false, bool v8 = false);

struct PrefillArgs {
  const void* q;  // [T, Hq, D]
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;  // this layer's pool [size, Hkv, D], contiguous
  const void* v_cache;
  const int32_t* req_to_token;
  int64_t req_to_token_stride;
  const int64_t* req_pool_indices;  // [B]
  const int32_t* qo_indptr;         // [B + 1]
  const int32_t* kv_indptr;         // [B + 1]
  const int32_t* q_tile_to_batch;   // [num_q_tiles]
  const int32_t* q_tile_to_index;   // [num_q_tiles]
  void* out;                        // [T, Hq, D]
  int64_t out_stride_t, out_stride_h;
  int num_q_tiles, n_heads, n_kv_heads, head_dim;
  float scale;
  int window;     // > 0: the row at position p sees positions p - window + 1 .. p only (sliding window)
  float softcap;  // > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax
  const float* k_scale;  // non-null: k_cache is int8 (see DecodeArgs)
  const float* v_scale;
};

cudaError_t paged_prefill(const PrefillArgs& args, DType dtype, cudaStream_t stream);

struct RotaryArgs {
  const void* x;  // [N, H, D]
  int64_t x_stride_t, x_stride_h;
  const float* freqs;  // [N, D/2, 2] contiguous: (cos, sin) of each pair
  void* out;           // [N, H, D], may be x
  int64_t out_stride_t, out_stride_h;
  int64_t n_tokens;
  int n_heads, head_dim;
  bool vec16;  // head_dim % 8 == 0 and every row 16-byte aligned: 4 pairs per thread
};

cudaError_t rotary(const RotaryArgs& args, DType dtype, cudaStream_t stream);

}  // namespace astrai
