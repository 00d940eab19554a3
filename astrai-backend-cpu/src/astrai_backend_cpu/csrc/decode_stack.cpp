// astrai_cpu.DecodeStack: every decoder layer of a Llama-family model on a decode step, in one call
// from Python.
//
// A decode step at batch 1 spends about 6 ms in its 120 GEMVs and, run layer by layer from
// Python, another 1.5-2 ms dispatching the dozen small calls of each layer (norms, RoPE, the K/V
// write, attention, SiLU-and-multiply, residual adds, views and splits). Here the same calls are
// made from C++: the plugin's own kernels directly (kernels.h), SiLU and the products through
// ATen, in the order and with the roundings of the Python layers (astrai.model.llama), so the
// result is bit for bit the layer-by-layer one on the same kernels.
//
// Built once per model from its weights (the linears already packed for linear_packed, or GGUF
// weights kept quantized, for quant_linear) and each layer's sliding window (Mistral, Ministral:
// paged_decode then starts each request at the first position its window holds), then
// called once per decode step with the step's pool view. The GIL is released for the call.
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace astrai_cpu {
namespace {

// The kernels are called directly, not through the dispatcher: this names each call for
// torch.profiler (a flag test when no profiler runs).
template <typename F>
auto traced(const char* name, F&& f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

struct DecodeStack : torch::CustomClassHolder {
  int64_t n_heads, n_kv_heads, head_dim, intermediate, n_layers;
  double eps, scale;
  std::vector<at::Tensor> norms;   // 2 per layer: input norm, post-attention norm, [hidden] bf16
  std::vector<at::Tensor> packed;  // 4 per layer, linear_pack layout: qkv, o, gate_up, down
  std::vector<at::Tensor> qkv_bias;  // none, or 1 per layer [(Hq + 2 Hkv) D] bf16
  // per packed weight, 7 integers: zeros for the linear_pack layout, else the quant_linear layout
  // (quant.cpp: n, k, bits, group, has_min, f16_scales, signed) of GGUF weights kept quantized
  std::vector<std::vector<int64_t>> layouts;
  // per layer: its sliding window (0: every position), a request attending from seq_len - window;
  // empty: no layer has one
  std::vector<int64_t> windows;

  DecodeStack(int64_t n_heads_, int64_t n_kv_heads_, int64_t head_dim_, int64_t intermediate_, double eps_,
              double scale_, std::vector<at::Tensor> norms_, std::vector<at::Tensor> packed_,
              std::vector<at::Tensor> qkv_bias_, std::vector<int64_t> layouts_, std::vector<int64_t> windows_)
      : n_heads(n_heads_), n_kv_heads(n_kv_heads_), head_dim(head_dim_), intermediate(intermediate_),
        n_layers(static_cast<int64_t>(norms_.size()) / 2), eps(eps_), scale(scale_), norms(std::move(norms_)),
        packed(std::move(packed_)), qkv_bias(std::move(qkv_bias_)), windows(std::move(windows_)) {
    TORCH_CHECK(layouts_.empty() || layouts_.size() == 7 * packed.size(),
                "DecodeStack: no layouts, or 7 integers per packed weight");
    for (size_t i = 0; i < packed.size(); ++i) {
      layouts.emplace_back(layouts_.empty() ? std::vector<int64_t>(7, 0)
                                            : std::vector<int64_t>(layouts_.begin() + 7 * i, layouts_.begin() + 7 * i + 7));
    }
    TORCH_CHECK(has_linear_packed(), "DecodeStack: built without AVX512-BF16 (no linear_packed)");
    TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "DecodeStack: n_heads must be a multiple of n_kv_heads and head_dim even");
    TORCH_CHECK(n_layers > 0 && norms.size() == static_cast<size_t>(2 * n_layers) &&
                    packed.size() == static_cast<size_t>(4 * n_layers) &&
                    (qkv_bias.empty() || qkv_bias.size() == static_cast<size_t>(n_layers)),
                "DecodeStack: 2 norms and 4 packed weights per layer, and no qkv bias or one per layer");
    TORCH_CHECK(windows.empty() || windows.size() == static_cast<size_t>(n_layers),
                "DecodeStack: no windows, or one per layer");
    for (const int64_t w : windows) TORCH_CHECK(w >= 0, "DecodeStack: a window must be >= 0 (0: none)");
    for (const auto& t : norms) {
      TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.size(0) == hidden(),
                  "DecodeStack: norm weights must be contiguous bf16 [hidden]");
    }
    for (const auto& t : qkv_bias) {
      TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.size(0) == qkv_width(),
                  "DecodeStack: qkv bias must be contiguous bf16 [(n_heads + 2 n_kv_heads) head_dim]");
    }
  }

  int64_t hidden() const { return norms.front().size(0); }

  // packed weight i applied to x: linear_packed, or quant_linear for a quantized one
  at::Tensor linear(size_t i, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) const {
    if (layouts[i][0] == 0) {
      return traced("astrai_cpu::linear_packed", [&] { return linear_packed(x, packed[i], n, bias); });
    }
    return traced("astrai_cpu::quant_linear", [&] { return quant_linear(x, packed[i], layouts[i], bias); });
  }
  int64_t qkv_width() const { return (n_heads + 2 * n_kv_heads) * head_dim; }

  // x [B, hidden] bf16 (the embeddings of the step's tokens) -> the hidden states after the last
  // layer. freqs [B, head_dim / 2, 2] float32 (cos, sin); k_buffer/v_buffer [layers, size, Hkv, D];
  // req_to_token int32 [rows, max_ctx]; rows/seq_lens/out_loc [B] int64 (the KVCache of a decode step).
  // An int8 K (V) pool comes with its float32 scales k_scale [layers, size, Hkv] (astrai.kvcache.quant):
  // the step's rows are quantized into it (store_kv) and read back by paged_decode, as the layers do.
  at::Tensor forward(at::Tensor x, const at::Tensor& freqs, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                     const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens,
                     const at::Tensor& out_loc, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
    const int64_t B = x.size(0), Hq = n_heads, Hkv = n_kv_heads, D = head_dim, I = intermediate;
    const int64_t width = qkv_width(), n_qk = (Hq + Hkv) * D, kv_row = Hkv * D;
    TORCH_CHECK(x.dim() == 2 && B >= 1 && x.size(1) == hidden() && x.scalar_type() == at::kBFloat16,
                "DecodeStack.forward: x must be bf16 rows [B, hidden]");
    TORCH_CHECK(k_buffer.dim() == 4 && k_buffer.size(0) == n_layers && k_buffer.size(2) == Hkv && k_buffer.size(3) == D &&
                    v_buffer.sizes() == k_buffer.sizes() && k_buffer.is_contiguous() && v_buffer.is_contiguous(),
                "DecodeStack.forward: k_buffer/v_buffer must be contiguous [layers, size, n_kv_heads, head_dim]");
    for (const auto& [buf, sc] : {std::pair{&k_buffer, &k_scale}, std::pair{&v_buffer, &v_scale}}) {
      TORCH_CHECK(buf->scalar_type() == (sc->has_value() ? at::kChar : at::kBFloat16),
                  "DecodeStack.forward: a K/V pool is bf16, or int8 with its scales");
    }
    TORCH_CHECK(out_loc.scalar_type() == at::kLong && out_loc.numel() == B && rows.numel() == B && seq_lens.numel() == B,
                "DecodeStack.forward: one int64 out_loc, row and seq_len per row of x");
    const auto loc = out_loc.contiguous();
    const int64_t* lp = loc.data_ptr<int64_t>();
    const int64_t size = k_buffer.size(1);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lp[b] >= 0 && lp[b] < size, "DecodeStack.forward: out_loc outside the pool");
    }
    x = x.contiguous();
    // each window's first positions (seq_len - window, from 0), made once per step and window
    std::vector<std::pair<int64_t, at::Tensor>> starts;
    const auto starts_for = [&](int64_t window) -> c10::optional<at::Tensor> {
      if (window <= 0) return c10::nullopt;
      for (const auto& [w, t] : starts)
        if (w == window) return t;
      starts.emplace_back(window, at::clamp_min(seq_lens.to(at::kLong) - window, 0));
      return starts.back().second;
    };
    for (int64_t l = 0; l < n_layers; ++l) {
      const size_t w = 4 * l;
      const c10::optional<at::Tensor> bias = qkv_bias.empty() ? c10::nullopt : c10::optional<at::Tensor>(qkv_bias[l]);
      // attention: norm, QKV, RoPE on q|k, this step's K/V into the pool, paged decode, output projection
      const at::Tensor normed = traced("astrai_cpu::rms_norm", [&] { return rms_norm(x, norms[2 * l], eps); });
      const at::Tensor qkv = linear(w, normed, width, bias);
      const at::Tensor qk = traced("astrai_cpu::rotary", [&] { return rotary(qkv.narrow(1, 0, n_qk).view({B, Hq + Hkv, D}), freqs); });
      const at::Tensor k_buf = k_buffer.select(0, l), v_buf = v_buffer.select(0, l);
      const c10::optional<at::Tensor> ks = k_scale.has_value() ? c10::optional<at::Tensor>(k_scale->select(0, l)) : c10::nullopt;
      const c10::optional<at::Tensor> vs = v_scale.has_value() ? c10::optional<at::Tensor>(v_scale->select(0, l)) : c10::nullopt;
      if (ks.has_value()) {
        traced("astrai_cpu::store_kv", [&] { store_kv(qk.narrow(1, Hq, Hkv), loc, k_buf, ks); return 0; });
      } else {
        auto* kp = static_cast<at::BFloat16*>(k_buf.data_ptr());
        const auto* qkp = qk.const_data_ptr<at::BFloat16>();
        for (int64_t b = 0; b < B; ++b)
          std::memcpy(kp + lp[b] * kv_row, qkp + b * n_qk + Hq * D, kv_row * sizeof(at::BFloat16));
      }
      if (vs.has_value()) {
        traced("astrai_cpu::store_kv", [&] { store_kv(qkv.narrow(1, n_qk, kv_row).view({B, Hkv, D}), loc, v_buf, vs); return 0; });
      } else {
        auto* vp = static_cast<at::BFloat16*>(v_buf.data_ptr());
        const auto* qkvp = qkv.const_data_ptr<at::BFloat16>();
        for (int64_t b = 0; b < B; ++b)
          std::memcpy(vp + lp[b] * kv_row, qkvp + b * width + n_qk, kv_row * sizeof(at::BFloat16));
      }
      const c10::optional<at::Tensor> first = starts_for(windows.empty() ? 0 : windows[l]);
      const at::Tensor o = traced("astrai_cpu::paged_decode", [&] {
        return paged_decode(qk.narrow(1, 0, Hq).contiguous(), k_buf, v_buf, req_to_token, rows, seq_lens, scale, first, ks, vs);
      });
      const at::Tensor attn = linear(w + 1, o.view({B, Hq * D}), hidden(), c10::nullopt);
      // residual add fused with the next norm; SwiGLU MLP; residual add
      const auto [sum, h] = traced("astrai_cpu::add_rms_norm", [&] { return add_rms_norm(x, attn, norms[2 * l + 1], eps); });
      const at::Tensor gate_up = linear(w + 2, h, 2 * I, c10::nullopt);
      const at::Tensor act = at::mul(at::silu(gate_up.narrow(1, 0, I)), gate_up.narrow(1, I, I));
      x = at::add(sum, linear(w + 3, act, hidden(), c10::nullopt));
    }
    return x;
  }
};

}  // namespace
}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.class_<astrai_cpu::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>>())
      .def("forward", &astrai_cpu::DecodeStack::forward);
}
