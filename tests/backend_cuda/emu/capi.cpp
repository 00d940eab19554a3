// C entry points of the CPU emulator build, for ctypes: the launchers of kernels.h with flat
// arguments (the Python side passes tensor data pointers and strides). Return a cudaError_t.
#include "kernels.h"

using astrai::DType;

extern "C" int emu_paged_decode(int dtype, const void* q, int64_t q_st, int64_t q_sh, const void* new_k,
                                int64_t nk_st, int64_t nk_sh, const void* new_v, int64_t nv_st, int64_t nv_sh,
                                void* k_cache, void* v_cache, const int32_t* req_to_token, int64_t r2t_stride,
                                const int64_t* req_pool_indices, const int64_t* seq_lens,
                                const int64_t* out_cache_loc, float* o_part, float* ml_part, void* out, int batch,
                                int n_heads, int n_kv_heads, int head_dim, int max_len, int num_splits,
                                int max_splits, float scale, int window, float softcap, float* k_scale,
                                float* v_scale) {
  const astrai::DecodeArgs a{q, q_st, q_sh, new_k, nk_st, nk_sh, new_v, nv_st, nv_sh, k_cache, v_cache,
                             req_to_token, r2t_stride, req_pool_indices, seq_lens, out_cache_loc, o_part,
                             ml_part, out, batch, n_heads, n_kv_heads, head_dim, max_len, num_splits,
                             max_splits, scale, window, softcap, k_scale, v_scale};
  return astrai::paged_decode(a, DType(dtype), nullptr);
}

extern "C" int emu_paged_prefill(int dtype, const void* q, int64_t q_st, int64_t q_sh, const void* k_cache,
                                 const void* v_cache, const int32_t* req_to_token, int64_t r2t_stride,
                                 const int64_t* req_pool_indices, const int32_t* qo_indptr,
                                 const int32_t* kv_indptr, const int32_t* q_tile_to_batch,
                                 const int32_t* q_tile_to_index, void* out, int64_t out_st, int64_t out_sh,
                                 int num_q_tiles, int n_heads, int n_kv_heads, int head_dim, float scale,
                                 int window, float softcap, const float* k_scale, const float* v_scale) {
  const astrai::PrefillArgs a{q, q_st, q_sh, k_cache, v_cache, req_to_token, r2t_stride, req_pool_indices,
                              qo_indptr, kv_indptr, q_tile_to_batch, q_tile_to_index, out, out_st, out_sh,
                              num_q_tiles, n_heads, n_kv_heads, head_dim, scale, window, softcap,
                              k_scale, v_scale};
  return astrai::paged_prefill(a, DType(dtype), nullptr);
}

extern "C" int emu_rotary(int dtype, const void* x, int64_t x_st, int64_t x_sh, const float* freqs, void* out,
                          int64_t out_st, int64_t out_sh, int64_t n_tokens, int n_heads, int head_dim, int vec16) {
  const astrai::RotaryArgs a{x, x_st, x_sh, freqs, out, out_st, out_sh, n_tokens, n_heads, head_dim, vec16 != 0};
  return astrai::rotary(a, DType(dtype), nullptr);
}
