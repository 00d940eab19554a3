// astrai_cpu.DecodeStack: every decoder layer of a decode step in one call from Python: the stock
// pre-norm layer (Llama, SmolLM2, Qwen2/3, Mistral) or Gemma's sandwich-normed one, with or
// without per-head q/k norms, SwiGLU or GeGLU, a dense MLP or a mixture of experts (Qwen3-MoE,
// Mixtral, Qwen2-MoE's shared expert), sliding windows and layer groups.
//
// Run layer by layer from Python, a decode step at batch 1 spends as long dispatching each
// layer's dozen small calls (norms, RoPE, the K/V write, attention, the activation, residual
// adds, views and splits) as in its GEMVs on an AVX2 CPU (SmolLM2: about 7 ms of each). Here the
// same calls are made from C++: the plugin's own kernels directly (kernels.h), the activation,
// float32 RoPE and the products through ATen, in the order and with the roundings of the Python
// layers (astrai.model.layers), so the result is bit for bit the layer-by-layer one on the same
// kernels.
//
// Built once per model from its weights (bf16 linears packed for linear_packed, or GGUF weights
// kept quantized, for quant_linear, in bf16 or float32), then called once per decode step with
// the step's pool view. The GIL is released for the call.
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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

// rotate_torch's rotation (astrai.extension.backend.rotary) of x [B, H, D] by freqs [B, D / 2, 2]:
// the rotary kernel on bf16 rows (the layers' kernel there), ATen's complex product on float32
// ones (the layers' ops there, so the same bits).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& freqs) {
  if (x.scalar_type() == at::kBFloat16) {
    return traced("astrai_cpu::rotary", [&] { return rotary(x.stride(1) == x.size(2) ? x : x.contiguous(), freqs); });
  }
  const int64_t B = x.size(0), H = x.size(1), D = x.size(2);
  const at::Tensor pairs = at::view_as_complex(x.reshape({B, H, D / 2, 2}).contiguous());
  return at::view_as_real(pairs * at::view_as_complex(freqs).unsqueeze(1)).flatten(-2);
}

// SparseMoE.forward's grouping of a step's (token, choice) pairs by expert, its integer part done
// here in one pass: ids [B, k] int64 and weights [B, k] (the routing, from ATen's topk as the layer
// takes it) -> rows_of [B k] (each pair's token), scale [B k, 1] (its weight) and offsets [E + 1]
// (expert e's pairs at offsets[e] .. offsets[e + 1]). A counting sort by expert that keeps the
// pairs' order within an expert: the bits of the layer's stable argsort, floor_divide,
// index_select, bincount and cumsum (eight ATen calls a layer, ~25 us at one row, in one).
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_by_expert(const at::Tensor& ids, const at::Tensor& weights,
                                                                int64_t E) {
  const at::Tensor id = ids.contiguous(), w = weights.contiguous();
  const int64_t k = id.size(1), P = id.numel();
  at::Tensor rows_of = at::empty({P}, id.options()), offsets = at::zeros({E + 1}, id.options());
  at::Tensor scale = at::empty({P, 1}, w.options());
  const int64_t* e_of = id.data_ptr<int64_t>();
  int64_t* rows = rows_of.data_ptr<int64_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(e_of[p] >= 0 && e_of[p] < E, "DecodeStack: a routed expert out of range");
    ++off[e_of[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + E);
  const int64_t bytes = w.element_size();
  const char* from = static_cast<const char*>(w.data_ptr());
  char* to = static_cast<char*>(scale.data_ptr());
  for (int64_t p = 0; p < P; ++p) {
    const int64_t slot = next[e_of[p]]++;
    rows[slot] = p / k;
    std::memcpy(to + slot * bytes, from + p * bytes, bytes);
  }
  return {rows_of, scale, offsets};
}

// zeros_like(h).index_add_(0, rows_of, y * scale), SparseMoE.forward's combine, in one pass: each
// product rounded to the dtype (at::mul's), then every token's products summed in float32 in pair
// order and rounded once (what ATen's index_add_ does on bf16 and float32 rows: float32 sums in
// index order). y [P, H], contiguous. The product is not fused into the sum (the build's
// -ffast-math would contract them into one multiply-add, skipping the product's float32 rounding:
// the float32 mixtures of tests/core/test_families_stack.py then differ from the layers).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void combine_rows(const T* y, const T* scale, const int64_t* rows_of, int64_t P, int64_t B, int64_t H, T* out) {
  at::parallel_for(0, H, 256, [&](int64_t h0, int64_t h1) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    std::vector<float> acc(B * (h1 - h0), 0.f);
    for (int64_t p = 0; p < P; ++p) {
      const float s = static_cast<float>(scale[p]);
      float* a = acc.data() + rows_of[p] * (h1 - h0);
      const T* yp = y + p * H;
      for (int64_t h = h0; h < h1; ++h) a[h - h0] += static_cast<float>(static_cast<T>(static_cast<float>(yp[h]) * s));
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = h0; h < h1; ++h) out[b * H + h] = static_cast<T>(acc[b * (h1 - h0) + h - h0]);
  });
}

at::Tensor combine(const at::Tensor& like, const at::Tensor& y, const at::Tensor& rows_of, const at::Tensor& scale) {
  const at::Tensor yc = y.contiguous();
  const int64_t P = yc.size(0), B = like.size(0), H = like.size(1);
  at::Tensor out = at::empty({B, H}, like.options());
  if (like.scalar_type() == at::kBFloat16)
    combine_rows(yc.data_ptr<at::BFloat16>(), scale.data_ptr<at::BFloat16>(), rows_of.data_ptr<int64_t>(), P, B, H,
                 out.data_ptr<at::BFloat16>());
  else
    combine_rows(yc.data_ptr<float>(), scale.data_ptr<float>(), rows_of.data_ptr<int64_t>(), P, B, H,
                 out.data_ptr<float>());
  return out;
}

// What the layers are (DecodeStack's options): the stock pre-norm layer, or Gemma's sandwich
// (norms after attention and after the MLP too); per-head norms on q and k before RoPE or none;
// SiLU (SwiGLU) or tanh-approximated GELU (GeGLU) on the gate; (FLOAT_NORMS, optional) norm weights
// in float32 on bf16 rows, each norm in float32 and rounded once (Gemma's `1 + weight`, as
// OffsetRMSNorm computes it).
enum Option : int64_t { SANDWICH = 0, QK_NORM = 1, GELU = 2, FLOAT_NORMS = 3, N_OPTIONS = 4 };

// A mixture-of-experts layer's MLP (astrai.model.moe.SparseMoE): its router, every expert's
// quantized gate_up and down (one layout each), and where it has one the shared expert's gate (the
// shared expert's own projections are the layer's linears 2 and 3).
struct Experts {
  at::Tensor router, shared_gate;  // router: [experts, hidden], or linear_pack's tiles (router_packed)
  bool router_packed = false;
  std::vector<at::Tensor> gate_up, down;
  std::vector<int64_t> gate_up_layout, down_layout;
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t n_heads, n_kv_heads, head_dim, intermediate, n_layers;
  double eps, scale;
  bool sandwich, qk_norm, gelu, float_norms;
  at::ScalarType dtype;  // the model's: its rows, K/V pool, router and bias
  // per layer, in the model's dtype (float32 with float_norms): input norm, post-attention norm; then (sandwich) pre- and
  // post-feed-forward norms [hidden]; then (qk_norm) q and k norms [head_dim]
  std::vector<at::Tensor> norms;
  int64_t norms_per_layer;
  // 4 linears per layer (qkv, o, gate_up, down), each one or more segments whose outputs sit
  // side by side: linear i is segments first[i] .. first[i + 1] - 1 of packed
  std::vector<at::Tensor> packed;
  std::vector<int64_t> first;
  std::vector<at::Tensor> qkv_bias;  // none, or 1 per layer [(Hq + 2 Hkv) D]
  // per segment, 8 integers: zeros for the linear_pack layout (bf16), else the quant_linear layout
  // (quant.h: n, k, bits, group, has_min, f16_scales, signed, int8_rows) of GGUF weights kept quantized
  std::vector<std::vector<int64_t>> layouts;
  // per layer: its sliding window (0: every position), a request attending from seq_len - window;
  // empty: no layer has one
  std::vector<int64_t> windows;
  std::vector<int64_t> tables;  // per layer: which of forward's RoPE tables turns it; empty: the first
  // per layer: its experts (a router undefined: a dense MLP); empty: every MLP dense
  std::vector<Experts> experts;
  int64_t n_experts = 0, top_k = 0, expert_intermediate = 0, shared_intermediate = 0;
  bool norm_topk = false;
  // set_lora's: per linear (4 a layer), every LoRA slot's a, b and spans side by side; each linear's
  // slots checked (lora_slots) at its first LoRA rows after set_lora
  std::vector<at::Tensor> lora_a, lora_b, lora_spans;
  std::vector<std::shared_ptr<const LoraSlots>> lora_checked;

  DecodeStack(int64_t n_heads_, int64_t n_kv_heads_, int64_t head_dim_, int64_t intermediate_, double eps_,
              double scale_, std::vector<at::Tensor> norms_, std::vector<at::Tensor> packed_,
              std::vector<at::Tensor> qkv_bias_, std::vector<int64_t> layouts_, std::vector<int64_t> windows_,
              std::vector<int64_t> options, std::vector<int64_t> segments, std::vector<int64_t> tables_,
              std::vector<int64_t> moe_layers, std::vector<at::Tensor> moe_tensors, std::vector<int64_t> moe_ints)
      : n_heads(n_heads_), n_kv_heads(n_kv_heads_), head_dim(head_dim_), intermediate(intermediate_), eps(eps_),
        scale(scale_), norms(std::move(norms_)), packed(std::move(packed_)), qkv_bias(std::move(qkv_bias_)),
        windows(std::move(windows_)), tables(std::move(tables_)) {
    TORCH_CHECK(options.size() == N_OPTIONS || options.size() == N_OPTIONS - 1,
                "DecodeStack: options are (sandwich, qk_norm, gelu[, float_norms])");
    sandwich = options[SANDWICH] != 0, qk_norm = options[QK_NORM] != 0, gelu = options[GELU] != 0;
    float_norms = options.size() == N_OPTIONS && options[FLOAT_NORMS] != 0;
    TORCH_CHECK(!float_norms || sandwich, "DecodeStack: float32 norm weights on a sandwich layer only");
    norms_per_layer = 2 + (sandwich ? 2 : 0) + (qk_norm ? 2 : 0);
    TORCH_CHECK(!norms.empty() && norms.size() % norms_per_layer == 0, "DecodeStack: ", norms_per_layer,
                " norms per layer");
    n_layers = static_cast<int64_t>(norms.size()) / norms_per_layer;
    if (segments.empty()) segments.assign(4 * n_layers, 1);
    TORCH_CHECK(segments.size() == static_cast<size_t>(4 * n_layers), "DecodeStack: 4 linears per layer");
    first.assign(1, 0);
    for (size_t i = 0; i < segments.size(); ++i) {
      // (a mixture-of-experts layer without a shared expert has no linears 2 and 3)
      TORCH_CHECK(segments[i] >= (i % 4 < 2 ? 1 : 0), "DecodeStack: an attention linear has at least one segment");
      first.push_back(first.back() + segments[i]);
    }
    TORCH_CHECK(packed.size() == static_cast<size_t>(first.back()), "DecodeStack: one packed tensor per segment");
    TORCH_CHECK(layouts_.empty() || layouts_.size() == 8 * packed.size(),
                "DecodeStack: no layouts, or 8 integers per packed segment");
    dtype = float_norms ? at::kBFloat16 : norms.front().scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "DecodeStack: a bf16 or float32 model");
    for (size_t i = 0; i < packed.size(); ++i) {
      layouts.emplace_back(layouts_.empty() ? std::vector<int64_t>(8, 0)
                                            : std::vector<int64_t>(layouts_.begin() + 8 * i, layouts_.begin() + 8 * i + 8));
      if (layouts.back()[0] == 0) {
        TORCH_CHECK(has_linear_packed() && dtype == at::kBFloat16,
                    "DecodeStack: dense (linear_pack) weights need AVX512-BF16 and a bf16 model");
      } else {
        TORCH_CHECK(has_quant_linear(), "DecodeStack: built without quant_linear");
      }
    }
    TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "DecodeStack: n_heads must be a multiple of n_kv_heads and head_dim even");
    TORCH_CHECK(qkv_bias.empty() || qkv_bias.size() == static_cast<size_t>(n_layers),
                "DecodeStack: no qkv bias or one per layer");
    TORCH_CHECK(windows.empty() || windows.size() == static_cast<size_t>(n_layers),
                "DecodeStack: no windows, or one per layer");
    TORCH_CHECK(tables.empty() || tables.size() == static_cast<size_t>(n_layers),
                "DecodeStack: no RoPE table indices, or one per layer");
    for (const int64_t w : windows) TORCH_CHECK(w >= 0, "DecodeStack: a window must be >= 0 (0: none)");
    init_experts(moe_layers, moe_tensors, moe_ints, dtype);
    for (size_t i = 0; i < norms.size(); ++i) {
      const bool per_head = qk_norm && static_cast<int64_t>(i % norms_per_layer) >= norms_per_layer - 2;
      const auto& t = norms[i];
      TORCH_CHECK(t.dim() == 1 && t.scalar_type() == (float_norms ? at::kFloat : dtype) && t.is_contiguous() &&
                      t.size(0) == (per_head ? head_dim : hidden()),
                  "DecodeStack: norm weights must be contiguous [hidden] ([head_dim] for q/k), in the model's "
                  "dtype (float32 with float_norms)");
    }
    for (const auto& t : qkv_bias) {
      TORCH_CHECK(t.dim() == 1 && t.scalar_type() == dtype && t.is_contiguous() && t.size(0) == qkv_width(),
                  "DecodeStack: qkv bias must be contiguous [(n_heads + 2 n_kv_heads) head_dim] in the model's dtype");
    }
  }

  // moe_layers: per layer 1 for a mixture of experts, 0 for a dense MLP (empty: all dense).
  // moe_tensors: per mixture, its router [experts, hidden] (or linear_pack's tiles of it: a bf16
  // PackedLinear's, run by linear_packed as the layer runs it), the shared expert's gate [1, hidden] (or
  // an empty tensor), then every expert's packed gate_up, then every expert's packed down.
  // moe_ints: (experts, top_k, norm_topk, expert intermediate, shared intermediate), then per
  // mixture the 8 layout integers of its gate_up and of its down.
  void init_experts(const std::vector<int64_t>& moe_layers, const std::vector<at::Tensor>& moe_tensors,
                    const std::vector<int64_t>& moe_ints, at::ScalarType dtype) {
    if (moe_layers.empty()) return;
    TORCH_CHECK(moe_layers.size() == static_cast<size_t>(n_layers) && moe_ints.size() >= 5,
                "DecodeStack: a kind per layer and the experts' five integers");
    const int64_t E = n_experts = moe_ints[0];
    top_k = moe_ints[1], norm_topk = moe_ints[2] != 0, expert_intermediate = moe_ints[3];
    shared_intermediate = moe_ints[4];
    TORCH_CHECK(E >= 1 && top_k >= 1 && top_k <= E && expert_intermediate >= 1, "DecodeStack: bad expert sizes");
    experts.resize(n_layers);
    size_t t = 0, i = 5;
    for (int64_t l = 0; l < n_layers; ++l) {
      if (!moe_layers[l]) continue;
      TORCH_CHECK(moe_tensors.size() >= t + 2 + 2 * E && moe_ints.size() >= i + 16,
                  "DecodeStack: each mixture's tensors and layouts");
      Experts& x = experts[l];
      x.router = moe_tensors[t];
      x.router_packed = x.router.dim() == 4;  // linear_pack's tiles (a bf16 PackedLinear's)
      TORCH_CHECK(x.router_packed ? has_linear_packed() && dtype == at::kBFloat16 && x.router.size(0) * 16 >= E
                                  : x.router.dim() == 2 && x.router.size(0) == E && x.router.scalar_type() == dtype,
                  "DecodeStack: a router is [experts, hidden] in the model's dtype, or linear_pack's tiles of one");
      if (moe_tensors[t + 1].numel() > 0) x.shared_gate = moe_tensors[t + 1];
      TORCH_CHECK(x.shared_gate.defined() == (shared_intermediate > 0) &&
                      (first[4 * l + 3] - first[4 * l + 2] > 0) == (shared_intermediate > 0) &&
                      first[4 * l + 4] - first[4 * l + 3] == first[4 * l + 3] - first[4 * l + 2],
                  "DecodeStack: a shared expert's gate and its projections, or neither");
      x.gate_up.assign(moe_tensors.begin() + t + 2, moe_tensors.begin() + t + 2 + E);
      x.down.assign(moe_tensors.begin() + t + 2 + E, moe_tensors.begin() + t + 2 + 2 * E);
      x.gate_up_layout.assign(moe_ints.begin() + i, moe_ints.begin() + i + 8);
      x.down_layout.assign(moe_ints.begin() + i + 8, moe_ints.begin() + i + 16);
      TORCH_CHECK(x.gate_up_layout[0] == 2 * expert_intermediate && x.down_layout[0] == hidden(),
                  "DecodeStack: an expert's gate_up gives 2 x its intermediate rows, its down hidden ones");
      t += 2 + 2 * E, i += 16;
    }
  }

  // the gate's activation times up (astrai.model.layers.GatedMLP), gate_up [rows, 2 width]
  at::Tensor activation(const at::Tensor& gate_up, int64_t width) const {
    if (!gelu && has_silu_and_mul() && gate_up.size(1) == 2 * width) return silu_and_mul(gate_up);
    const at::Tensor gate = gate_up.narrow(1, 0, width);
    return at::mul(gelu ? at::gelu(gate, "tanh") : at::silu(gate), gate_up.narrow(1, width, width));
  }

  // the MLP of layer l (linears 4l + 2 and 4l + 3) on h: dense, or its experts (SparseMoE.forward:
  // route, the (token, choice) pairs sorted by expert, each projection of every chosen expert in one
  // quant_experts call, the outputs weighted and added back at their tokens; the shared expert's)
  // A dense MLP's projections are proj(i, x, n): linear i with its rows' LoRA updates (forward's).
  template <typename Proj>
  at::Tensor mlp(int64_t l, const at::Tensor& h, const Proj& proj) const {
    const size_t w = 4 * l;
    if (experts.empty() || !experts[l].router.defined()) {
      const at::Tensor act = activation(proj(w + 2, h, 2 * intermediate, c10::nullopt), intermediate);
      return proj(w + 3, act, hidden(), c10::nullopt);
    }
    const Experts& x = experts[l];
    const int64_t E = n_experts;
    const at::Tensor logits = x.router_packed
                                  ? traced("astrai_cpu::linear_packed", [&] { return linear_packed(h, x.router, E, c10::nullopt); })
                                  : at::linear(h, x.router);
    const at::Tensor probs = logits.to(at::kFloat).softmax(-1);
    auto [weights, ids] = at::topk(probs, top_k, -1);
    if (norm_topk) weights = at::div(weights, weights.sum(-1, true));
    weights = weights.to(h.scalar_type());
    const auto [rows_of, scale, offsets] = group_by_expert(ids, weights, E);
    const at::Tensor up = traced("astrai_cpu::quant_experts", [&] {
      return quant_experts(h.index_select(0, rows_of), offsets, x.gate_up, x.gate_up_layout);
    });
    const at::Tensor act = activation(up, expert_intermediate).contiguous();
    const at::Tensor y =
        traced("astrai_cpu::quant_experts", [&] { return quant_experts(act, offsets, x.down, x.down_layout); });
    at::Tensor out = combine(h, y, rows_of, scale);
    if (x.shared_gate.defined()) {
      const at::Tensor shared = linear(
          w + 3, activation(linear(w + 2, h, 2 * shared_intermediate, c10::nullopt), shared_intermediate), hidden(),
          c10::nullopt);
      out = at::add(out, at::mul(at::sigmoid(at::linear(h, x.shared_gate)), shared));
    }
    return out;
  }

  int64_t hidden() const { return norms.front().size(0); }
  int64_t qkv_width() const { return (n_heads + 2 * n_kv_heads) * head_dim; }
  const at::Tensor& norm(int64_t layer, int64_t which) const { return norms[layer * norms_per_layer + which]; }

  // segment s applied to x: linear_packed, or quant_linear for a quantized one
  at::Tensor segment(size_t s, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) const {
    if (layouts[s][0] == 0) {
      return traced("astrai_cpu::linear_packed", [&] { return linear_packed(x, packed[s], n, bias); });
    }
    return traced("astrai_cpu::quant_linear", [&] { return quant_linear(x, packed[s], layouts[s], bias); });
  }

  // linear i (its segments' outputs side by side, the bias cut to each) applied to x
  at::Tensor linear(size_t i, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) const {
    if (first[i + 1] - first[i] == 1) return segment(first[i], x, n, bias);
    std::vector<at::Tensor> outs;
    int64_t n0 = 0;
    for (int64_t s = first[i]; s < first[i + 1]; ++s) {
      const int64_t ns = layouts[s][0];
      outs.push_back(segment(s, x, ns, bias.has_value() ? c10::optional<at::Tensor>(bias->narrow(0, n0, ns)) : c10::nullopt));
      n0 += ns;
    }
    TORCH_CHECK(n0 == n, "DecodeStack: a linear's segments give ", n0, " outputs, not ", n);
    return at::cat(outs, 1);
  }

  // The LoRA adapters' weights the steps' LoRA rows read (astrai.lora.LoraSet.stacked): for each
  // layer's qkv, o, gate_up and down projections in turn, every slot's a, b and spans (empty tensors:
  // no update there), kept until the next call (held here, not passed with every step: thousands of
  // tensors through the dispatcher cost a step more than a millisecond).
  void set_lora(std::vector<at::Tensor> a, std::vector<at::Tensor> b, std::vector<at::Tensor> spans) {
    TORCH_CHECK(a.size() % (4 * n_layers) == 0 && b.size() == a.size() && spans.size() == a.size(),
                "DecodeStack.set_lora: each linear's a, b, spans per slot");
    lora_a = std::move(a), lora_b = std::move(b), lora_spans = std::move(spans);
    lora_checked.assign(4 * n_layers, nullptr);
  }

  // linear i's LoRA slots, checked for its input and output widths
  const LoraSlots& lora_slots_of(size_t i, int64_t in, int64_t out) {
    std::shared_ptr<const LoraSlots>& checked = lora_checked[i];
    if (!checked) {
      const int64_t n = static_cast<int64_t>(lora_a.size()) / (4 * n_layers);
      const auto part = [&](const std::vector<at::Tensor>& v) {
        return std::vector<at::Tensor>(v.begin() + i * n, v.begin() + (i + 1) * n);
      };
      checked = lora_slots(part(lora_a), part(lora_b), part(lora_spans), in, out);
    }
    return *checked;
  }

  // x [B, hidden] in the model's dtype (the embeddings of the step's tokens) -> the hidden states
  // after the last layer. freqs: RoPE tables [B, head_dim / 2, 2] float32 (cos, sin), a layer
  // turning by tables[layer]; k_buffer/v_buffer [slots, size, Hkv, D]; rows/seq_lens [B] int64
  // (the KVCache of a decode step). Per layer group: req_to_token int32 [rows, max_ctx] and
  // out_loc [B] int64; slots: per layer its group and its index in k_buffer (empty: group 0, the
  // layer's own index). An int8 K (V) pool comes with its float32 scales k_scale [slots, size, Hkv]
  // (astrai.kvcache.quant): the step's rows are quantized into it (store_kv) and read back by
  // paged_decode, as the layers do. LoRA rows (lora_rows given: each row's adapter slot, -1 none):
  // after each projection the rows' adapter updates are added (lora_apply), as astrai.lora's
  // wrappers add them, from the slots' weights set_lora holds.
  at::Tensor forward(at::Tensor x, const std::vector<at::Tensor>& freqs, const at::Tensor& k_buffer,
                     const at::Tensor& v_buffer, const std::vector<at::Tensor>& req_to_token, const at::Tensor& rows,
                     const at::Tensor& seq_lens, const std::vector<at::Tensor>& out_loc,
                     const std::vector<int64_t>& slots, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& lora_rows) {
    const int64_t B = x.size(0), Hq = n_heads, Hkv = n_kv_heads, D = head_dim;
    const int64_t width = qkv_width(), n_qk = (Hq + Hkv) * D, kv_row = Hkv * D;
    TORCH_CHECK(x.dim() == 2 && B >= 1 && x.size(1) == hidden() && x.scalar_type() == dtype,
                "DecodeStack.forward: x must be rows [B, hidden] in the model's dtype");
    TORCH_CHECK(k_buffer.dim() == 4 && k_buffer.size(2) == Hkv && k_buffer.size(3) == D &&
                    v_buffer.sizes() == k_buffer.sizes() && k_buffer.is_contiguous() && v_buffer.is_contiguous(),
                "DecodeStack.forward: k_buffer/v_buffer must be contiguous [slots, size, n_kv_heads, head_dim]");
    for (const auto& [buf, sc] : {std::pair{&k_buffer, &k_scale}, std::pair{&v_buffer, &v_scale}}) {
      TORCH_CHECK(buf->scalar_type() == (sc->has_value() ? at::kChar : dtype),
                  "DecodeStack.forward: a K/V pool is in the model's dtype, or int8 with its scales");
    }
    TORCH_CHECK(!freqs.empty() && !req_to_token.empty() && out_loc.size() == req_to_token.size(),
                "DecodeStack.forward: RoPE tables, and a page table and out_loc per layer group");
    TORCH_CHECK(slots.empty() || slots.size() == static_cast<size_t>(2 * n_layers),
                "DecodeStack.forward: no slots, or a group and an index per layer");
    for (const auto& f : freqs) {
      TORCH_CHECK(f.scalar_type() == at::kFloat && f.is_contiguous() && f.dim() == 3 && f.size(0) == B &&
                      f.size(1) * 2 == D && f.size(2) == 2,
                  "DecodeStack.forward: RoPE tables must be contiguous float32 [B, head_dim / 2, 2]");
    }
    const int64_t size = k_buffer.size(1);
    std::vector<at::Tensor> locs;
    for (const auto& loc : out_loc) {
      TORCH_CHECK(loc.scalar_type() == at::kLong && loc.numel() == B && rows.numel() == B && seq_lens.numel() == B,
                  "DecodeStack.forward: one int64 out_loc, row and seq_len per row of x");
      locs.push_back(loc.contiguous());
      const int64_t* lp = locs.back().data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) TORCH_CHECK(lp[b] >= 0 && lp[b] < size, "DecodeStack.forward: out_loc outside the pool");
    }
    // LoRA rows (astrai.lora): each row's adapter slot (-1: none), its weights set_lora's
    const int64_t n_lora = static_cast<int64_t>(lora_a.size()) / (4 * n_layers);
    if (lora_rows.has_value()) {
      TORCH_CHECK(lora_rows->scalar_type() == at::kInt && lora_rows->numel() == B && n_lora >= 1,
                  "DecodeStack.forward: LoRA rows int32 [B], after set_lora");
      const int32_t* lr = lora_rows->data_ptr<int32_t>();
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(lr[b] >= -1 && lr[b] < n_lora, "DecodeStack.forward: a LoRA row's slot outside set_lora's");
    }
    const auto lora = [&](size_t i, const at::Tensor& y, const at::Tensor& in) -> at::Tensor {
      if (!lora_rows.has_value()) return y;
      traced("astrai_cpu::lora_apply", [&] {
        lora_apply(y, in, *lora_rows, lora_slots_of(i, in.size(1), y.size(1)));
        return 0;
      });
      return y;
    };
    // linear i on in with its rows' LoRA updates (astrai.lora's LoraLinear): a quantized linear in one
    // parallel region with its rows' updates (lora_around, up to 15 rows), else the updates after it
    const auto proj = [&](size_t i, const at::Tensor& in, int64_t n, const c10::optional<at::Tensor>& b) {
      const size_t s = first[i];
      if (lora_rows.has_value() && first[i + 1] - s == 1 && layouts[s][0] != 0) {
        at::Tensor y = at::empty({in.size(0), n}, in.options());
        const at::Tensor xs = in.contiguous();
        const bool done = traced("astrai_cpu::quant_linear_lora", [&] {
          return lora_around(y, xs, *lora_rows, lora_slots_of(i, xs.size(1), n),
                             [&](const Around& around) { quant_linear_into(xs, packed[s], layouts[s], b, y, &around); });
        });
        if (done) return y;
      }
      return lora(i, linear(i, in, n, b), in);
    };
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
    const auto store = [&](const at::Tensor& rows_, const at::Tensor& loc, const at::Tensor& buf,
                           const c10::optional<at::Tensor>& sc) {
      traced("astrai_cpu::store_kv", [&] { store_kv(rows_, loc, buf, sc); return 0; });
    };
    // (float_norms: float32 weights on the bf16 rows, which rms_norm widens, norms as float32 rows
    // and rounds once, as OffsetRMSNorm computes it)
    const auto norm_rows = [&](const at::Tensor& t, const at::Tensor& w) {
      return traced("astrai_cpu::rms_norm", [&] { return rms_norm(t, w, eps); });
    };
    for (int64_t l = 0; l < n_layers; ++l) {
      const size_t w = 4 * l;
      const int64_t group = slots.empty() ? 0 : slots[2 * l], index = slots.empty() ? l : slots[2 * l + 1];
      TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(locs.size()) && index >= 0 && index < k_buffer.size(0),
                  "DecodeStack.forward: a layer's slot outside the pool");
      const at::Tensor& f = freqs.at(tables.empty() ? 0 : tables[l]);
      const c10::optional<at::Tensor> bias = qkv_bias.empty() ? c10::nullopt : c10::optional<at::Tensor>(qkv_bias[l]);
      // attention: norm, QKV, (q/k norms,) RoPE, this step's K/V into the pool, paged decode, output projection
      const at::Tensor normed = norm_rows(x, norm(l, 0));
      const at::Tensor qkv = proj(w, normed, width, bias);
      at::Tensor q, k;
      if (qk_norm) {
        const int64_t qn = norms_per_layer - 2;
        q = rotate(norm_rows(qkv.narrow(1, 0, Hq * D).reshape({B * Hq, D}), norm(l, qn)).view({B, Hq, D}), f);
        k = rotate(norm_rows(qkv.narrow(1, Hq * D, kv_row).reshape({B * Hkv, D}), norm(l, qn + 1)).view({B, Hkv, D}), f);
      } else {
        const at::Tensor qk = rotate(qkv.narrow(1, 0, n_qk).view({B, Hq + Hkv, D}), f);
        q = qk.narrow(1, 0, Hq), k = qk.narrow(1, Hq, Hkv);
      }
      const at::Tensor k_buf = k_buffer.select(0, index), v_buf = v_buffer.select(0, index);
      const c10::optional<at::Tensor> ks = k_scale.has_value() ? c10::optional<at::Tensor>(k_scale->select(0, index)) : c10::nullopt;
      const c10::optional<at::Tensor> vs = v_scale.has_value() ? c10::optional<at::Tensor>(v_scale->select(0, index)) : c10::nullopt;
      store(k, locs[group], k_buf, ks);
      store(qkv.narrow(1, n_qk, kv_row).view({B, Hkv, D}), locs[group], v_buf, vs);
      const c10::optional<at::Tensor> start = starts_for(windows.empty() ? 0 : windows[l]);
      const at::Tensor o = traced("astrai_cpu::paged_decode", [&] {
        return paged_decode(q.contiguous(), k_buf, v_buf, req_to_token[group], rows, seq_lens, scale, start, ks, vs);
      });
      const at::Tensor o_rows = o.view({B, Hq * D});
      const at::Tensor attn = proj(w + 1, o_rows, hidden(), c10::nullopt);
      at::Tensor h;
      if (sandwich) {  // x + post_norm(attn), then the pre-feed-forward norm
        x = at::add(x, norm_rows(attn, norm(l, 1)));
        h = norm_rows(x, norm(l, 2));
      } else {  // the residual add fused with the next norm
        std::tie(x, h) = traced("astrai_cpu::add_rms_norm", [&] { return add_rms_norm(x, attn, norm(l, 1), eps); });
      }
      const at::Tensor down = mlp(l, h, proj);
      x = at::add(x, sandwich ? norm_rows(down, norm(l, 3)) : down);
    }
    return x;
  }
};

}  // namespace
}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.class_<astrai_cpu::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("forward", &astrai_cpu::DecodeStack::forward)
      .def("set_lora", &astrai_cpu::DecodeStack::set_lora);
}
