// The astrai_cpu kernels as C++ functions, for one another (decode_stack.cpp calls them
// directly, without the dispatcher). Each is registered as torch.ops.astrai_cpu.<name>; the
// contracts are in the comments of the file that defines it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

namespace astrai_cpu {

// A linear's parallel region shared with work of its caller around each thread's share of the
// output (quant_linear_into): every thread of the region runs before(thread, threads, c0, c1) (c0,
// c1: its share of the output columns), all wait for one another, then each computes its columns
// [c0, c1) and runs after(c0, c1) on them. One fork and join for a linear and the LoRA updates
// around it (lora_around), where at a few rows two regions cost about as much as the updates.
struct Around {
  std::function<void(int64_t, int64_t, int64_t, int64_t)> before;
  std::function<void(int64_t, int64_t)> after;
};

// logits_out.cpp: a float32 [rows, cols] output for an LM head (float_out), from one buffer kept
// between calls once nothing else holds it, where it is at least LOGITS_KEPT_BYTES
at::Tensor logits_out(int64_t rows, int64_t cols);

// fused.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& freqs);
bool has_silu_and_mul();
at::Tensor silu_and_mul(const at::Tensor& x);  // T(T(silu(gate)) * up), x = [gate | up]

// linear.cpp
bool has_linear_packed();
at::Tensor linear_pack(const at::Tensor& weight);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias, bool float_out = false);
// quant_linear into out [M, n] (bf16 or float32: float_out), its region shared with around's work
// (nullptr: none)
void quant_linear_into(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                       const c10::optional<at::Tensor>& bias, at::Tensor& out, const Around* around);
// M rows of x (row stride ldx, 2 * K2 columns) against tiles [t0, t1) of a linear_pack layout
// whose data starts at w (tile t0's), into out (row stride N, columns of those tiles): one
// thread's share of linear_packed, for kernels that pack tiles of their own on the fly.
void packed_rows(const at::BFloat16* x, int64_t ldx, int64_t M, const at::BFloat16* w, const at::BFloat16* bias,
                 at::BFloat16* out, int64_t N, int64_t K2, int64_t t0, int64_t t1);

// quant.cpp
bool has_quant_linear();
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                        const c10::optional<at::Tensor>& bias, bool float_out = false);

// experts.cpp
at::Tensor quant_experts(const at::Tensor& x, const at::Tensor& offsets, const std::vector<at::Tensor>& packed,
                         const std::vector<int64_t>& layout);

// lora.cpp: each row's adapter update added in place to y (rows: the row's index in a/b/spans, -1 none;
// a and b in lora.cpp's blocks)
void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& b, const std::vector<at::Tensor>& spans);
// One module's adapter slots (a, b, spans as lora_apply takes them) checked once against its input
// and output widths, for a caller that applies the same slots step after step (DecodeStack): the
// tensors held, each slot's pointers and sizes read out.
struct LoraSlots;
std::shared_ptr<const LoraSlots> lora_slots(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                            const std::vector<at::Tensor>& spans, int64_t in, int64_t out);
void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const LoraSlots& slots);
bool lora_around(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const LoraSlots& slots,
                 const std::function<void(const Around&)>& linear);
// rows x [T, in] through linear(around) into y [T, out], with the rows' adapter updates (rows, a,
// b, spans: as lora_apply takes them) in the same parallel region: A's rows shared out ahead of the
// linear's columns, each thread's columns updated once written; bit for bit lora_apply after the
// linear. False (nothing done) from 16 rows (lora_apply's tiles), with as many adapter rows as
// threads (lora_apply's row a thread is faster) or for slots of mixed dtypes.
bool lora_around(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                 const std::vector<at::Tensor>& b, const std::vector<at::Tensor>& spans,
                 const std::function<void(const Around&)>& linear);

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                        const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens,
                        double scale, const c10::optional<at::Tensor>& starts = c10::nullopt,
                        const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                        const c10::optional<at::Tensor>& v_scale = c10::nullopt);

// kv_store.cpp
void store_kv(const at::Tensor& x, const at::Tensor& loc, const at::Tensor& buf, const c10::optional<at::Tensor>& scale);

// prefill.cpp
bool has_prefill_attention();
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                             const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& q_starts,
                             const at::Tensor& q_lens, const at::Tensor& prefix_lens, double scale,
                             int64_t window = 0, const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                             const c10::optional<at::Tensor>& v_scale = c10::nullopt);
at::Tensor encoder_attention(const at::Tensor& qkv, const at::Tensor& lengths, int64_t heads, double scale);

}  // namespace astrai_cpu
