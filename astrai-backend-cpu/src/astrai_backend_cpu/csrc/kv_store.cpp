// astrai_cpu::store_kv: one layer's new K (or V) rows written into the pool, quantized where it is int8.
//
// x [T, H, D] (float32, bf16 or fp16) goes to buf[loc[t]] ([size, H, D]). An int8 buf keeps each
// head as round(x * (127 / amax)) clamped to [-127, 127] with scale[loc[t], h] = amax / 127, the
// bytes astrai.kvcache.quant.quantize gives (the same float32 products, rounded half to even); a
// buf in x's dtype takes a copy. One call per layer instead of the half-dozen tensor ops the
// reference takes per buffer.
#include <torch/library.h>

#include "kernels.h"
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// 127 / amax and amax / 127 as IEEE divisions (the file is built with -ffast-math, whose reciprocal
// products could differ from torch's quotients in the last bit): once per head, never inlined.
__attribute__((noinline, optimize("no-fast-math"))) void head_scale(float amax, float* inv, float* scale) {
  *inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
}

template <typename T>
void quantize_rows(const T* x, const int64_t* loc, int64_t T_, int64_t H, int64_t D, int8_t* buf, float* scale) {
  at::parallel_for(0, T_ * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / H, h = i % H;
      const T* src = x + i * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(src[d])));
      float inv, s;
      head_scale(amax, &inv, &s);
      int8_t* dst = buf + (loc[t] * H + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float r = std::nearbyint(static_cast<float>(src[d]) * inv);
        dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
      }
      scale[loc[t] * H + h] = s;
    }
  });
}

}  // namespace

namespace astrai_cpu {

void store_kv(const at::Tensor& x, const at::Tensor& loc, const at::Tensor& buf, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && buf.dim() == 3 && x.size(1) == buf.size(1) && x.size(2) == buf.size(2),
              "store_kv: x [T, H, D] and buf [size, H, D] on the CPU");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.numel() == x.size(0), "store_kv: one int64 slot per row of x");
  TORCH_CHECK(buf.is_contiguous(), "store_kv: buf must be contiguous");
  const auto xc = x.contiguous();
  const auto lc = loc.contiguous();
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), size = buf.size(0);
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(lp[t] >= 0 && lp[t] < size, "store_kv: a slot outside the pool");
  if (buf.scalar_type() != at::kChar) {
    TORCH_CHECK(!scale.has_value() && buf.scalar_type() == x.scalar_type(), "store_kv: buf in x's dtype takes no scales");
    const int64_t row = H * D * x.element_size();
    const auto* src = static_cast<const char*>(xc.data_ptr());
    auto* dst = static_cast<char*>(buf.data_ptr());
    for (int64_t t = 0; t < T; ++t) std::memcpy(dst + lp[t] * row, src + t * row, row);
    return;
  }
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->dim() == 2 &&
                  scale->size(0) == size && scale->size(1) == H,
              "store_kv: an int8 buf needs contiguous float32 scales [size, H]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "store_kv", [&] {
    quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), lp, T, H, D, buf.data_ptr<int8_t>(), scale->data_ptr<float>());
  });
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("store_kv(Tensor x, Tensor loc, Tensor(a!) buf, Tensor(b!)? scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("store_kv", &astrai_cpu::store_kv); }
