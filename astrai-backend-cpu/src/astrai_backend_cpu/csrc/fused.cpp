// astrai_cpu fused elementwise ops for the model's glue: RMSNorm (with and without the residual
// add), the rotary embedding and, on AVX-512 builds, SiLU-and-multiply (with a vectorised exp: a
// scalar loop of std::exp lost to ATen's vectorised ops at every batch size). Each replaces 2-12
// ATen dispatches per call with one and rounds exactly where the PyTorch formulation it replaces
// rounds (see each op), computing in float32 between roundings. Rows are split over threads only
// when there are many of them.
#include <torch/library.h>

#include "kernels.h"
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GRAIN_ELEMENTS = 32768;  // ATen's own grain for elementwise loops

inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(width, 1)); }

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

// float -> bfloat16, round to nearest even, in plain integer ops so that loops vectorise (c10's
// conversion has a NaN branch that keeps them scalar). Finite values round as c10 rounds them.
template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// One float32 row: x * rsqrt(mean(x^2) + eps) * w. Out of line, so that float32 rows and the
// float32 weights of narrower rows (widened first) run the same instructions: the same bits.
__attribute__((noinline)) void rms_norm_row_f32(const float* x, const float* w, float* out, int64_t width, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < width; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; ++i) out[i] = x[i] * inv * w[i];
}

// out = T(T(x * rsqrt(mean(x^2) + eps)) * w): F.rms_norm(x) (float32 inside, one rounding)
// then `* weight` in the model dtype (float32 product, one rounding). With float32 weights (W
// float) on bf16 or f16 rows: each row widened to float32, normed as a float32 row is, rounded
// once (Gemma's `1 + weight` norm: OffsetRMSNorm's float32 norm of the widened rows, then `.to`).
template <typename T, typename W>
void rms_norm_rows(const T* x, const W* w, T* out, int64_t rows, int64_t width, int64_t stride, float eps) {
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> wide(std::is_same_v<W, float> && !std::is_same_v<T, float> ? 2 * width : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * stride;
      T* o = out + r * width;
      if constexpr (std::is_same_v<W, float>) {
        if constexpr (std::is_same_v<T, float>) {
          rms_norm_row_f32(xr, w, o, width, eps);
        } else {
          for (int64_t i = 0; i < width; ++i) wide[i] = to_float(xr[i]);
          rms_norm_row_f32(wide.data(), w, wide.data() + width, width, eps);
          for (int64_t i = 0; i < width; ++i) o[i] = round_to<T>(wide[width + i]);
        }
      } else {
        float ss = 0.f;
        for (int64_t i = 0; i < width; ++i) {
          const float v = to_float(xr[i]);
          ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(width) + eps);
        for (int64_t i = 0; i < width; ++i) {
          const T normed = round_to<T>(to_float(xr[i]) * inv);
          o[i] = round_to<T>(to_float(normed) * to_float(w[i]));
        }
      }
    }
  });
}

}  // namespace

namespace astrai_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              "rms_norm: weight must be [hidden] in x's dtype or float32");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if (weight.scalar_type() == at::kFloat) {
      rms_norm_rows<scalar_t, float>(x.data_ptr<scalar_t>(), weight.data_ptr<float>(), out.data_ptr<scalar_t>(),
                                     x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
    } else {
      rms_norm_rows<scalar_t, scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                        x.size(0), x.size(1), x.stride(0), static_cast<float>(eps));
    }
  });
  return out;
}

// (s, rms_norm(s) * w) with s = T(x + residual): the residual add of a decoder layer fused with
// the next norm (one pass over the row for both).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(), "add_rms_norm: x and residual must be contiguous [rows, hidden] of one dtype");
  auto sum = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* b = residual.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    const int64_t n = x.numel(), width = x.size(1);
    at::parallel_for(0, n, GRAIN_ELEMENTS, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) s[i] = round_to<scalar_t>(to_float(a[i]) + to_float(b[i]));
    });
    (void)width;
  });
  return {sum, rms_norm(sum, weight, eps)};
}

// Interleaved-pair RoPE (llama.cpp layout): pair i of a head, (x[2i], x[2i+1]), times
// (cos, sin) of freqs[row, i], in float32, one rounding. x [rows, heads, D] with contiguous
// heads (row stride free: a slice of the fused QKV output); freqs [rows, D/2, 2] float32.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& freqs) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary: x must be [rows, heads, head_dim] with contiguous heads");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat && freqs.is_contiguous() && freqs.dim() == 3 &&
                  freqs.size(0) == x.size(0) && freqs.size(1) * 2 == x.size(2) && freqs.size(2) == 2,
              "rotary: freqs must be contiguous float32 [rows, head_dim / 2, 2]");
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2, width = heads * x.size(2);
  auto out = at::empty({rows, heads, x.size(2)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const float* f = freqs.data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* fr = f + r * half * 2;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* xr = xp + r * stride + h * half * 2;
          scalar_t* orow = o + (r * heads + h) * half * 2;
          for (int64_t i = 0; i < half; ++i) {
            const float a = to_float(xr[2 * i]), b = to_float(xr[2 * i + 1]);
            const float c = fr[2 * i], s = fr[2 * i + 1];
            orow[2 * i] = round_to<scalar_t>(a * c - b * s);
            orow[2 * i + 1] = round_to<scalar_t>(a * s + b * c);
          }
        }
      }
    });
  });
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

// silu(g) = g / (1 + exp(-g)), 16 lanes: simd.h's exp (which clamps below at -104), -g clamped above
// at 89 (e^89 overflows float32 to inf through scalef: a gate under -89 gives -0, as ATen's); a NaN
// gate stays NaN through the quotient
inline __m512 silu16(__m512 g) {
  const __m512 e = astrai_cpu::exp_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(89.f)));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
// the value as the dtype holds it: bf16's rounding (to nearest even), float32's none
inline __m512 rounded(const float*, __m512 v) { return v; }
inline __m512 rounded(const c10::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t width, int64_t stride) {
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * stride;
      const T* u = g + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < width; i += 16) {
        const int64_t left = std::min<int64_t>(16, width - i);
        const __mmask16 m = left == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
        const __m512 s = rounded(o, silu16(load16(g + i, m)));
        store16(o + i, m, _mm512_mul_ps(s, load16(u + i, m)));
      }
    }
  });
}

}  // namespace

bool has_silu_and_mul() { return true; }

// T(T(silu(gate)) * up) for x = [gate | up] [rows, 2 width] (rows may be strided): F.silu then the
// product, each rounded to the dtype as PyTorch rounds them; silu's exp is simd.h's, not ATen's
// (SLEEF's), so a value may differ from PyTorch's by an ulp of float32 before rounding.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "silu_and_mul: x must be [rows, 2 width] float32 or bf16 with contiguous rows");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, width, x.stride(0));
  else
    silu_and_mul_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, width, x.stride(0));
  return out;
}
#else
bool has_silu_and_mul() { return false; }

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(false, "silu_and_mul: this build has no AVX512-BF16 (has_silu_and_mul() is false)");
  return x;
}
#endif

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor freqs) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("has_silu_and_mul() -> bool", &astrai_cpu::has_silu_and_mul);
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("rms_norm", &astrai_cpu::rms_norm);
  m.impl("add_rms_norm", &astrai_cpu::add_rms_norm);
  m.impl("rotary", &astrai_cpu::rotary);
  m.impl("silu_and_mul", &astrai_cpu::silu_and_mul);
}
