// torch.ops.astrai.*: the op schemas, tensor checks, and dispatch to the launchers of kernels.h.
// The only translation unit that includes torch headers (the kernels compile without them).
// Every op mutates only the tensors its schema marks (a!) and returns nothing, so it composes
// with torch.compile (auto-functionalised) and CUDA graphs (no allocation, no host sync).
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"

namespace {

using at::Tensor;

astrai::DType storage_type(const Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return astrai::DType::kBFloat16;
  TORCH_CHECK(t.scalar_type() == at::kHalf, name, " must be bfloat16 or float16, got ", t.scalar_type());
  return astrai::DType::kFloat16;
}

void check_same_device(const Tensor& t, const Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on ", ref.device(), ", got ", t.device());
}

void check_tensor(const Tensor& t, const Tensor& ref, at::ScalarType type, int64_t dim, const char* name) {
  check_same_device(t, ref, name);
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.sizes());
}

// [N, H, D] rows for 16-byte vector access: last dim contiguous, rows 16-byte aligned.
void check_rows(const Tensor& t, const char* name) {
  const int64_t align = 16 / t.element_size();
  TORCH_CHECK(t.stride(-1) == 1 && t.stride(0) % align == 0 && t.stride(1) % align == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              name, " rows must be contiguous and 16-byte aligned (strides ", t.strides(), ")");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "astrai::", op, " failed to launch: ", cudaGetErrorString(err));
}

// Pointer to layer `layer` of a contiguous [n_layers, size, n_kv_heads, head_dim] pool.
void* layer_ptr(const Tensor& buf, int64_t layer) {
  TORCH_CHECK(0 <= layer && layer < buf.size(0), "layer_id ", layer, " outside [0, ", buf.size(0), ")");
  return static_cast<char*>(buf.data_ptr()) + layer * buf.stride(0) * buf.element_size();
}

// The pool's K (V): q's dtype without a scale, or int8 with its float32 scales [n_layers, size, Hkv].
void check_side(const Tensor& buf, const c10::optional<Tensor>& scale, const Tensor& q, const char* name) {
  check_same_device(buf, q, name);
  TORCH_CHECK(buf.dim() == 4 && buf.is_contiguous(), name, " must be a contiguous [n_layers, size, n_kv_heads, head_dim]");
  if (!scale.has_value()) {
    TORCH_CHECK(buf.scalar_type() == q.scalar_type(), name, " must be ", q.scalar_type(), " (or int8 with its scales), got ",
                buf.scalar_type());
    return;
  }
  TORCH_CHECK(buf.scalar_type() == at::kChar, name, " must be int8 when its scales are given, got ", buf.scalar_type());
  check_tensor(*scale, q, at::kFloat, 3, "k_scale/v_scale");
  TORCH_CHECK(scale->is_contiguous() && scale->sizes() == buf.sizes().slice(0, 3), "the scales of ", name,
              " must be a contiguous [n_layers, size, n_kv_heads] = ", buf.sizes().slice(0, 3), ", got ", scale->sizes());
}

void check_pool(const Tensor& k_buffer, const Tensor& v_buffer, const Tensor& q, const c10::optional<Tensor>& k_scale,
                const c10::optional<Tensor>& v_scale) {
  check_side(k_buffer, k_scale, q, "k_buffer");
  check_side(v_buffer, v_scale, q, "v_buffer");
  TORCH_CHECK(k_buffer.sizes() == v_buffer.sizes(), "k_buffer and v_buffer differ in shape");
  TORCH_CHECK(k_buffer.size(3) == q.size(2), "head_dim of q (", q.size(2), ") and the pool differ");
  TORCH_CHECK(astrai::head_dim_supported(static_cast<int>(q.size(2))), "head_dim ", q.size(2),
              " has no kernel (64, 128)");
  const int64_t n_heads = q.size(1), n_kv = k_buffer.size(2);
  TORCH_CHECK(n_kv >= 1 && n_heads % n_kv == 0, "n_heads ", n_heads, " is not a multiple of n_kv_heads ", n_kv);
}

// Layer `layer` of an int8 pool's scales, or null.
float* scale_ptr(const c10::optional<Tensor>& scale, int64_t layer) {
  return scale.has_value() ? scale->data_ptr<float>() + layer * scale->stride(0) : nullptr;
}

void check_req_to_token(const Tensor& req_to_token, const Tensor& q) {
  check_tensor(req_to_token, q, at::kInt, 2, "req_to_token");
  TORCH_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
}

// A sliding window (0: none) and a soft-cap (0: none) of the attention ops.
void check_window(int64_t window, double softcap) {
  TORCH_CHECK(0 <= window && window <= (int64_t{1} << 30), "window ", window, " outside [0, 2^30]");
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: off), got ", softcap);
}

void attn_paged_decode(const Tensor& q, const Tensor& new_k, const Tensor& new_v, const Tensor& k_buffer,
                       const Tensor& v_buffer, int64_t layer_id, const Tensor& req_to_token,
                       const Tensor& req_pool_indices, const Tensor& seq_lens, const Tensor& out_cache_loc,
                       int64_t max_len, int64_t num_splits, const Tensor& o_part, const Tensor& ml_part,
                       const Tensor& out, double scale, int64_t window, double softcap,
                       const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "q must be a [B, n_heads, head_dim] CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const astrai::DType dtype = storage_type(q, "q");
  check_pool(k_buffer, v_buffer, q, k_scale, v_scale);
  const int64_t batch = q.size(0), n_heads = q.size(1), head_dim = q.size(2), n_kv = k_buffer.size(2);
  TORCH_CHECK(n_heads / n_kv <= astrai::kMaxDecodeGroup, "n_heads / n_kv_heads above ", astrai::kMaxDecodeGroup);
  TORCH_CHECK(batch <= 65535 && n_kv <= 65535, "batch and n_kv_heads must be <= 65535");
  for (const Tensor* t : {&new_k, &new_v}) {
    check_tensor(*t, q, q.scalar_type(), 3, "new_k/new_v");
    TORCH_CHECK(t->size(0) == batch && t->size(1) == n_kv && t->size(2) == head_dim,
                "new_k/new_v must be [B, n_kv_heads, head_dim], got ", t->sizes());
  }
  check_rows(q, "q");
  check_rows(new_k, "new_k");
  check_rows(new_v, "new_v");
  check_req_to_token(req_to_token, q);
  for (const Tensor* t : {&req_pool_indices, &seq_lens, &out_cache_loc}) {
    check_tensor(*t, q, at::kLong, 1, "req_pool_indices/seq_lens/out_cache_loc");
    TORCH_CHECK(t->size(0) == batch && t->is_contiguous(), "req_pool_indices/seq_lens/out_cache_loc must be [B]");
  }
  check_tensor(o_part, q, at::kFloat, 4, "o_part");
  check_tensor(ml_part, q, at::kFloat, 3, "ml_part");
  const int64_t max_splits = o_part.size(2);
  TORCH_CHECK(o_part.is_contiguous() && o_part.size(0) == batch && o_part.size(1) == n_heads &&
                  o_part.size(3) == head_dim,
              "o_part must be a contiguous [B, n_heads, splits, head_dim], got ", o_part.sizes());
  TORCH_CHECK(ml_part.is_contiguous() && ml_part.size(0) == batch && ml_part.size(1) == n_heads &&
                  ml_part.size(2) == max_splits,
              "ml_part must be a contiguous [B, n_heads, splits], got ", ml_part.sizes());
  check_tensor(out, q, q.scalar_type(), 3, "out");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be a contiguous [B, n_heads, head_dim]");
  TORCH_CHECK(1 <= num_splits && num_splits <= max_splits, "num_splits ", num_splits, " outside [1, ", max_splits, "]");
  TORCH_CHECK(1 <= max_len && max_len <= req_to_token.size(1), "max_len ", max_len, " outside [1, max_ctx_len]");
  check_window(window, softcap);

  astrai::DecodeArgs a{};
  a.q = q.data_ptr();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.new_k = new_k.data_ptr();
  a.new_k_stride_t = new_k.stride(0);
  a.new_k_stride_h = new_k.stride(1);
  a.new_v = new_v.data_ptr();
  a.new_v_stride_t = new_v.stride(0);
  a.new_v_stride_h = new_v.stride(1);
  a.k_cache = layer_ptr(k_buffer, layer_id);
  a.v_cache = layer_ptr(v_buffer, layer_id);
  a.req_to_token = req_to_token.data_ptr<int32_t>();
  a.req_to_token_stride = req_to_token.stride(0);
  a.req_pool_indices = req_pool_indices.data_ptr<int64_t>();
  a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.out_cache_loc = out_cache_loc.data_ptr<int64_t>();
  a.o_part = o_part.data_ptr<float>();
  a.ml_part = ml_part.data_ptr<float>();
  a.out = out.data_ptr();
  a.batch = static_cast<int>(batch);
  a.n_heads = static_cast<int>(n_heads);
  a.n_kv_heads = static_cast<int>(n_kv);
  a.head_dim = static_cast<int>(head_dim);
  a.max_len = static_cast<int>(max_len);
  a.num_splits = static_cast<int>(num_splits);
  a.max_splits = static_cast<int>(max_splits);
  a.scale = static_cast<float>(scale);
  a.window = static_cast<int>(window);
  a.softcap = static_cast<float>(softcap);
  a.k_scale = scale_ptr(k_scale, layer_id);
  a.v_scale = scale_ptr(v_scale, layer_id);
  check_launch(astrai::paged_decode(a, dtype, c10::cuda::getCurrentCUDAStream()), "attn_paged_decode");
}

void attn_paged_prefill(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer, int64_t layer_id,
                        const Tensor& req_to_token, const Tensor& req_pool_indices, const Tensor& qo_indptr,
                        const Tensor& kv_indptr, const Tensor& q_tile_to_batch, const Tensor& q_tile_to_index,
                        double scale, const Tensor& out, int64_t window, double softcap,
                        const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "q must be a [T, n_heads, head_dim] CUDA tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const astrai::DType dtype = storage_type(q, "q");
  check_pool(k_buffer, v_buffer, q, k_scale, v_scale);
  check_rows(q, "q");
  check_req_to_token(req_to_token, q);
  const int64_t batch = req_pool_indices.size(0), n_tiles = q_tile_to_batch.size(0);
  check_tensor(req_pool_indices, q, at::kLong, 1, "req_pool_indices");
  for (const Tensor* t : {&qo_indptr, &kv_indptr}) {
    check_tensor(*t, q, at::kInt, 1, "qo_indptr/kv_indptr");
    TORCH_CHECK(t->size(0) == batch + 1 && t->is_contiguous(), "qo_indptr/kv_indptr must be [B + 1]");
  }
  for (const Tensor* t : {&q_tile_to_batch, &q_tile_to_index}) {
    check_tensor(*t, q, at::kInt, 1, "q_tile_to_batch/q_tile_to_index");
    TORCH_CHECK(t->size(0) == n_tiles && t->is_contiguous(), "q_tile_to_batch/q_tile_to_index differ in length");
  }
  TORCH_CHECK(req_pool_indices.is_contiguous(), "req_pool_indices must be contiguous");
  TORCH_CHECK(n_tiles <= 65535, "too many query tiles (", n_tiles, "), at most 65535");
  check_tensor(out, q, q.scalar_type(), 3, "out");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  check_rows(out, "out");
  check_window(window, softcap);

  astrai::PrefillArgs a{};
  a.q = q.data_ptr();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.k_cache = layer_ptr(k_buffer, layer_id);
  a.v_cache = layer_ptr(v_buffer, layer_id);
  a.req_to_token = req_to_token.data_ptr<int32_t>();
  a.req_to_token_stride = req_to_token.stride(0);
  a.req_pool_indices = req_pool_indices.data_ptr<int64_t>();
  a.qo_indptr = qo_indptr.data_ptr<int32_t>();
  a.kv_indptr = kv_indptr.data_ptr<int32_t>();
  a.q_tile_to_batch = q_tile_to_batch.data_ptr<int32_t>();
  a.q_tile_to_index = q_tile_to_index.data_ptr<int32_t>();
  a.out = out.data_ptr();
  a.out_stride_t = out.stride(0);
  a.out_stride_h = out.stride(1);
  a.num_q_tiles = static_cast<int>(n_tiles);
  a.n_heads = static_cast<int>(q.size(1));
  a.n_kv_heads = static_cast<int>(k_buffer.size(2));
  a.head_dim = static_cast<int>(q.size(2));
  a.scale = static_cast<float>(scale);
  a.window = static_cast<int>(window);
  a.softcap = static_cast<float>(softcap);
  a.k_scale = scale_ptr(k_scale, layer_id);
  a.v_scale = scale_ptr(v_scale, layer_id);
  check_launch(astrai::paged_prefill(a, dtype, c10::cuda::getCurrentCUDAStream()), "attn_paged_prefill");
}

void rotary_emb(const Tensor& x, const Tensor& freqs, const Tensor& out) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 2, "x must be a [..., heads, head_dim] CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const astrai::DType dtype = storage_type(x, "x");
  const int64_t heads = x.size(-2), head_dim = x.size(-1);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  check_same_device(freqs, x, "freqs");
  check_same_device(out, x, "out");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat, "freqs must be float32, got ", freqs.scalar_type());
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes(), "out must match x");
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  std::vector<int64_t> freqs_shape = lead;
  freqs_shape.insert(freqs_shape.end(), {head_dim / 2, 2});
  TORCH_CHECK(freqs.sizes() == at::IntArrayRef(freqs_shape), "freqs must be [..., head_dim/2, 2] = ",
              at::IntArrayRef(freqs_shape), ", got ", freqs.sizes());
  TORCH_CHECK(freqs.is_contiguous(), "freqs must be contiguous");
  // x may be copied into [N, H, D] (an input); out must be a view of those rows.
  const Tensor x3 = x.reshape({-1, heads, head_dim}), out3 = out.view({-1, heads, head_dim});
  TORCH_CHECK(x3.stride(2) == 1 && out3.stride(2) == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "x and out need contiguous, 4-byte aligned head rows");
  auto aligned16 = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0;
  };

  astrai::RotaryArgs a{};
  a.x = x3.data_ptr();
  a.x_stride_t = x3.stride(0);
  a.x_stride_h = x3.stride(1);
  a.freqs = freqs.data_ptr<float>();
  a.out = out3.data_ptr();
  a.out_stride_t = out3.stride(0);
  a.out_stride_h = out3.stride(1);
  a.n_tokens = x3.size(0);
  a.n_heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(head_dim);
  a.vec16 = head_dim % 8 == 0 && aligned16(x3) && aligned16(out3) &&
            reinterpret_cast<uintptr_t>(freqs.data_ptr()) % 16 == 0;
  check_launch(astrai::rotary(a, dtype, c10::cuda::getCurrentCUDAStream()), "rotary_emb");
}

int64_t paged_decode_blocks_per_sm(at::ScalarType dtype, int64_t head_dim, int64_t group, bool k8, bool v8) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "dtype must be bfloat16 or float16");
  const auto type = dtype == at::kBFloat16 ? astrai::DType::kBFloat16 : astrai::DType::kFloat16;
  return astrai::paged_decode_blocks_per_sm(type, static_cast<int>(head_dim), static_cast<int>(group), k8, v8);
}

}  // namespace

TORCH_LIBRARY(astrai, m) {
  m.def(
      "attn_paged_decode(Tensor q, Tensor new_k, Tensor new_v, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "
      "int layer_id, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor out_cache_loc, "
      "int max_len, int num_splits, Tensor(c!) o_part, Tensor(d!) ml_part, Tensor(e!) out, float scale, "
      "int window=0, float softcap=0., Tensor(f!)? k_scale=None, Tensor(g!)? v_scale=None) -> ()");
  m.def(
      "attn_paged_prefill(Tensor q, Tensor k_buffer, Tensor v_buffer, int layer_id, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor qo_indptr, Tensor kv_indptr, Tensor q_tile_to_batch, "
      "Tensor q_tile_to_index, float scale, Tensor(a!) out, int window=0, float softcap=0., Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> ()");
  m.def("rotary_emb(Tensor x, Tensor freqs, Tensor(a!) out) -> ()");
  // Occupancy of the decode kernel on the current device (sizes the split-K grid); no tensors.
  m.def("paged_decode_blocks_per_sm(ScalarType dtype, int head_dim, int group, bool k8=False, bool v8=False) -> int",
        &paged_decode_blocks_per_sm);
}

TORCH_LIBRARY_IMPL(astrai, CUDA, m) {
  m.impl("attn_paged_decode", &attn_paged_decode);
  m.impl("attn_paged_prefill", &attn_paged_prefill);
  m.impl("rotary_emb", &rotary_emb);
}
