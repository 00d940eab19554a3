// astrai_cpu::quant_experts: one projection of every chosen expert of a mixture-of-experts layer in
// one call (astrai.model.moe): x's rows sorted by expert, offsets[e] .. offsets[e + 1] expert e's,
// each expert's weight kept quantized (quant_linear's layout, the same for every expert).
//
// A decode step gives each chosen expert a row or a few: run from Python, each expert's
// quant_linear is a parallel region of its own over a matrix too small to keep two threads busy
// (fork, join, and the call's dispatch, per expert and projection). Here the experts are the
// parallel work when each has few rows (each expert's product then runs on one thread, its bytes
// read once); with more rows (prefill) each runs in turn on every thread, as quant_linear does.
// Each row's result is quant_linear's on that row whatever rows come with it (its kernel's order).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <vector>

#include "kernels.h"

namespace astrai_cpu {
namespace {

// rows per expert up to which the experts themselves are the parallel work
constexpr int64_t FEW_ROWS = 4;

}  // namespace

at::Tensor quant_experts(const at::Tensor& x, const at::Tensor& offsets, const std::vector<at::Tensor>& packed,
                         const std::vector<int64_t>& layout) {
  const int64_t E = static_cast<int64_t>(packed.size());
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_experts: x must be rows [R, k] on the CPU");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() == E + 1,
              "quant_experts: offsets must be int64 [experts + 1]");
  TORCH_CHECK(layout.size() == 7 || layout.size() == 8, "quant_experts: layout must be quant_linear's integers");
  const at::Tensor off_t = offsets.contiguous();
  const int64_t* off = off_t.const_data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == x.size(0), "quant_experts: offsets must run from 0 to x's rows");
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(off[e + 1] >= off[e], "quant_experts: offsets must not decrease");
    if (off[e + 1] > off[e]) active.push_back(e);
    most = std::max(most, off[e + 1] - off[e]);
  }
  auto out = at::empty({x.size(0), layout[0]}, x.options());
  const auto one = [&](int64_t e) {
    const int64_t rows = off[e + 1] - off[e];
    out.narrow(0, off[e], rows).copy_(quant_linear(x.narrow(0, off[e], rows), packed[e], layout, c10::nullopt));
  };
  if (most <= FEW_ROWS && active.size() > 1) {
    // the caller's inference mode is thread-local: the workers take it too (out is an inference
    // tensor when the model runs under torch.inference_mode)
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
      c10::InferenceMode guard(inference);
      for (int64_t i = begin; i < end; ++i) one(active[i]);  // (quant_linear's own region runs inline)
    });
  } else {
    for (const int64_t e : active) one(e);
  }
  return out;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("quant_experts(Tensor x, Tensor offsets, Tensor[] packed, int[] layout) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("quant_experts", &astrai_cpu::quant_experts);
}
