// astrai_cpu::lora_apply: the LoRA updates of a step's rows, added in place to a linear's output
// (astrai.lora). Rows of several adapters, and rows of none, share one call: the base product
// ran once for all of them, and each row adds its own adapter's low-rank update.
//
// y [T, out] and x [T, in]: float32 or bf16, the same dtype, contiguous rows. rows int32 [T]: each
// row's adapter slot, -1 for none. Per slot s (empty tensors where the module has no update for
// it): a[s] [P*R, in] float32 (the A of each of its P parts, zero-padded to rank R), bt[s] [R, C]
// float32 (each part's scaled B, transposed, side by side), spans[s] int64 [P, 3]: part p adds
// s_p @ bt[:, c0 : c0 + o1 - o0] to y[:, o0:o1], with s_p = x @ a[p*R:(p+1)*R].T.
//
// A run of at least GEMM_ROWS consecutive rows of one slot (a prefill chunk) goes through ATen's
// GEMMs; other rows (decode, speculative verification) are done row by row here, the rows spread
// over threads, each row's update summed in float32 and added to y with one rounding.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace astrai_cpu {
namespace {

constexpr int64_t GEMM_ROWS = 16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i].x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline void add_to(float* y, int64_t i, float v) { y[i] += v; }
inline void add_to(at::BFloat16* y, int64_t i, float v) { y[i] = static_cast<at::BFloat16>(load(y, i) + v); }

struct Slot {
  const float* a = nullptr;
  const float* bt = nullptr;
  const int64_t* spans = nullptr;
  int64_t parts = 0, rank = 0, cols = 0;
};

template <typename T>
void one_row(const T* x, T* y, const Slot& s, int64_t in, std::vector<float>& xf, std::vector<float>& sv,
             std::vector<float>& acc) {
  xf.resize(in);
  for (int64_t k = 0; k < in; ++k) xf[k] = load(x, k);
  const int64_t R = s.rank, PR = s.parts * R;
  sv.resize(PR);
  for (int64_t j = 0; j < PR; ++j) {
    const float* aj = s.a + j * in;
    float sum = 0.f;
    for (int64_t k = 0; k < in; ++k) sum += aj[k] * xf[k];
    sv[j] = sum;
  }
  for (int64_t p = 0; p < s.parts; ++p) {
    const int64_t o0 = s.spans[3 * p], o1 = s.spans[3 * p + 1], c0 = s.spans[3 * p + 2], n = o1 - o0;
    acc.assign(n, 0.f);
    float* out = acc.data();
    for (int64_t r = 0; r < R; ++r) {
      const float coef = sv[p * R + r];
      const float* b = s.bt + r * s.cols + c0;
      for (int64_t o = 0; o < n; ++o) out[o] += coef * b[o];
    }
    for (int64_t o = 0; o < n; ++o) add_to(y, o0 + o, out[o]);
  }
}

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& bt, const std::vector<at::Tensor>& spans) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_apply: x [T, in], y [T, out]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_apply: x and y float32 or bf16 alike");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), "lora_apply: contiguous x and y");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.numel() == x.size(0) && rows.is_contiguous(),
              "lora_apply: rows int32 [T]");
  TORCH_CHECK(a.size() == bt.size() && a.size() == spans.size(), "lora_apply: one a, bt, spans per slot");
  const int64_t T = x.size(0), in = x.size(1), out = y.size(1), S = static_cast<int64_t>(a.size());
  std::vector<Slot> slots(S);
  for (int64_t s = 0; s < S; ++s) {
    if (!a[s].defined() || a[s].numel() == 0) continue;
    TORCH_CHECK(a[s].scalar_type() == at::kFloat && bt[s].scalar_type() == at::kFloat &&
                    spans[s].scalar_type() == at::kLong && a[s].is_contiguous() && bt[s].is_contiguous() &&
                    spans[s].is_contiguous() && a[s].size(1) == in,
                "lora_apply: slot ", s, "'s weights are not what the module's input takes");
    Slot& sl = slots[s];
    sl.parts = spans[s].size(0);
    sl.rank = bt[s].size(0);
    sl.cols = bt[s].size(1);
    TORCH_CHECK(a[s].size(0) == sl.parts * sl.rank, "lora_apply: a rows = parts * rank");
    sl.a = a[s].data_ptr<float>();
    sl.bt = bt[s].data_ptr<float>();
    sl.spans = spans[s].data_ptr<int64_t>();
    for (int64_t p = 0; p < sl.parts; ++p)
      TORCH_CHECK(sl.spans[3 * p] >= 0 && sl.spans[3 * p + 1] <= out && sl.spans[3 * p + 2] >= 0 &&
                      sl.spans[3 * p + 2] + sl.spans[3 * p + 1] - sl.spans[3 * p] <= sl.cols,
                  "lora_apply: a span outside the output");
  }
  const int32_t* slot_of = rows.data_ptr<int32_t>();
  std::vector<int64_t> single;  // rows done one by one
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && slot_of[e] == slot_of[t]) ++e;
    const int32_t s = slot_of[t];
    if (s >= 0 && s < S && slots[s].a != nullptr) {
      if (e - t >= GEMM_ROWS) {
        const Slot& sl = slots[s];
        const at::Tensor xs = x.narrow(0, t, e - t).to(at::kFloat);
        const at::Tensor sv = at::mm(xs, a[s].t());
        for (int64_t p = 0; p < sl.parts; ++p) {
          const int64_t o0 = sl.spans[3 * p], o1 = sl.spans[3 * p + 1], c0 = sl.spans[3 * p + 2];
          const at::Tensor d = at::mm(sv.narrow(1, p * sl.rank, sl.rank), bt[s].narrow(1, c0, o1 - o0));
          at::Tensor dst = y.narrow(0, t, e - t).narrow(1, o0, o1 - o0);
          dst.copy_(dst.to(at::kFloat).add_(d));
        }
      } else {
        for (int64_t r = t; r < e; ++r) single.push_back(r);
      }
    }
    t = e;
  }
  if (single.empty()) return;
  const int64_t n = static_cast<int64_t>(single.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf, sv, acc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = single[i];
      const Slot& sl = slots[slot_of[r]];
      if (x.scalar_type() == at::kFloat)
        one_row(x.data_ptr<float>() + r * in, y.data_ptr<float>() + r * out, sl, in, xf, sv, acc);
      else
        one_row(x.data_ptr<at::BFloat16>() + r * in, y.data_ptr<at::BFloat16>() + r * out, sl, in, xf, sv, acc);
    }
  });
}

}  // namespace
}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor rows, Tensor[] a, Tensor[] bt, Tensor[] spans) -> ()");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("lora_apply", &astrai_cpu::lora_apply); }
