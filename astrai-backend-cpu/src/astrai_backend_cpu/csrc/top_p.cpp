// astrai_cpu::top_p: the nucleus filter of astrai.sampling.top_p, in place, without sorting the
// vocabulary: each row with top_p < 1 keeps the tokens whose logit is at least the cut-off c, the
// logit of the last token (in descending order) whose probability mass strictly ahead of it is
// under top_p (the top token always; ties with c too), and sets the others to -inf.
//
// PyTorch finds c by sorting the row (topk of 256 first): a nucleus wider than that sorted all
// 262,144 logits of Gemma 3, ~21 ms a row on a Zen 4 core (a base model at temperature 1 and
// top_p 0.95 does that for most rows). Here, per row: its maximum m; then one pass that sums
// exp(x - m) over the whole row and over the tokens at or above each of the thresholds m - d
// (d = 1/4 to 32 nats, FIRST_CUTS), with their counts; the first threshold whose mass reaches
// top_p of the total brackets c between it and the one before. While the bracket holds more than
// SORTED tokens it is cut into 16 by another such pass; then its tokens are gathered, sorted and
// walked from the mass ahead of the bracket, as PyTorch walks the sorted row, and a last pass
// masks the row. Three to five reads of a row, no sort past a few thousand tokens, rows spread
// over the threads. The probabilities are exp(x - m) / total, summed in double: the cut-off is
// PyTorch's wherever a token's mass ahead is not within a float32 rounding of top_p.
//
// Rows that hold a NaN, +inf, or nothing above -inf are left as they are.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t SORTED = 4096;  // tokens of a bracket sorted at once; more: the bracket is cut again
constexpr float FIRST_CUTS[] = {0.25f, 0.5f, 0.75f, 1.f, 1.5f, 2.f, 2.5f, 3.f, 4.f, 5.f, 6.f, 8.f, 11.f, 16.f, 32.f};
constexpr int FIRST = 16;  // thresholds of the first pass: m - d for d in FIRST_CUTS (nats), then -inf
constexpr int CUTS = 16;          // thresholds of a pass over a bracket's tokens

struct Sums {
  double mass[CUTS];  // of exp(x - m) over the tokens with x >= cut[i]
  int64_t count[CUTS];
};

// mass and count of the tokens at or above each of the N descending thresholds cut[] (N a constant:
// the running sums stay in registers)
template <int N>
Sums sums(const float* x, int64_t V, float m, const float* cut) {
  Sums s{};
#if defined(__AVX512F__)
  // float lanes, flushed into the doubles every FLUSH vectors (float sums over a whole vocabulary
  // drift by ~1e-6 of the total, which at top_p 0.999 moves the cut-off past dozens of tokens)
  constexpr int64_t FLUSH = 16;
  __m512 acc[N], at_cut[N];
  __m512i cnt[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps(), cnt[i] = _mm512_setzero_si512(), at_cut[i] = _mm512_set1_ps(cut[i]);
  const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(NEG_INF);
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t base = 0; base < V; base += 16 * FLUSH) {
    const int64_t end = std::min(V, base + 16 * FLUSH);
    for (int64_t j = base; j < end; j += 16) {
      const __mmask16 live = end - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (end - j)) - 1);
      const __m512 v = _mm512_mask_loadu_ps(ninf, live, x + j);
      const __m512 e = astrai_cpu::exp_ps(_mm512_sub_ps(v, vm));
      const __mmask16 finite = _mm512_mask_cmp_ps_mask(live, v, ninf, _CMP_NEQ_OQ);  // -inf: no mass, not counted
#pragma GCC unroll 16
      for (int i = 0; i < N; ++i) {
        const __mmask16 at = _mm512_mask_cmp_ps_mask(finite, v, at_cut[i], _CMP_GE_OQ);
        acc[i] = _mm512_mask_add_ps(acc[i], at, acc[i], e);
        cnt[i] = _mm512_mask_add_epi32(cnt[i], at, cnt[i], one);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(acc[i]));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
      s.mass[i] += _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
      acc[i] = _mm512_setzero_ps();
    }
  }
  for (int i = 0; i < N; ++i) s.count[i] = _mm512_reduce_add_epi32(cnt[i]);
#else
  for (int64_t j = 0; j < V; ++j) {
    if (!(x[j] >= cut[N - 1]) || x[j] == NEG_INF) continue;
    const double e = std::exp(static_cast<double>(x[j]) - m);
    for (int i = 0; i < N; ++i)
      if (x[j] >= cut[i]) s.mass[i] += e, ++s.count[i];
  }
#endif
  return s;
}

// The finite values of x[0, n) in [lo, hi), of which there are count (the sums' counts): out
std::vector<float> gather(const float* x, int64_t n, float lo, float hi, int64_t count) {
  std::vector<float> out(static_cast<size_t>(count) + 16);  // room for a whole vector past the end
  float* at = out.data();
  const float* end = at + count;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), ninf = _mm512_set1_ps(NEG_INF);
  for (; j + 16 <= n && at < end; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 in = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, vhi, _CMP_LT_OQ) &
                         _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    if (!in) continue;
    // compressed in a register and stored whole (the room past the end takes the rest): a compress
    // straight to memory is microcoded on Zen 4, tens of cycles
    _mm512_storeu_ps(at, _mm512_maskz_compress_ps(in, v));
    at += __builtin_popcount(in);
  }
#endif
  for (; j < n && at < end; ++j)
    if (x[j] >= lo && x[j] < hi && x[j] != NEG_INF) *at++ = x[j];
  out.resize(static_cast<size_t>(at - out.data()));
  return out;
}

// The cut-off of one row (its maximum m; top_p in (0, 1)): see the file's comment. G(t) is the mass at
// or above t. The bracket [lo, hi) holds c: G(hi) < target (every token at or above hi is kept: the
// mass strictly ahead of it is at most G(hi)) and G(lo) >= target (no token below lo is).
float cutoff(const float* x, int64_t V, float m, double top_p) {
  float cut[CUTS];
  int n = 0;
  for (const float d : FIRST_CUTS) cut[n++] = m - d;
  cut[n++] = NEG_INF;  // every token: the total
  const Sums s = sums<FIRST>(x, V, m, cut);
  const double total = s.mass[n - 1], target = top_p * total;
  int i = 0;
  while (i < n - 1 && s.mass[i] < target) ++i;  // the first threshold reaching the target (the last does)
  float lo = cut[i], hi = i ? cut[i - 1] : std::numeric_limits<float>::infinity();
  double ahead = i ? s.mass[i - 1] : 0.0;  // G(hi)
  std::vector<float> inside = gather(x, V, lo, hi, s.count[i] - (i ? s.count[i - 1] : 0));
  // a wide bracket cut in CUTS - 1 evenly below its top, on its own tokens, until few enough are left
  for (;;) {
    const float top = std::isfinite(hi) ? hi : m, bottom = std::isfinite(lo) ? lo : m - 128.f;
    if (static_cast<int64_t>(inside.size()) <= SORTED || !(top - bottom > std::abs(top) * 1e-6f)) break;
    for (int k = 0; k < CUTS - 1; ++k) cut[k] = top - (top - bottom) * static_cast<float>(k + 1) / CUTS;
    cut[CUTS - 1] = lo;
    const Sums t = sums<CUTS>(inside.data(), static_cast<int64_t>(inside.size()), m, cut);
    int k = 0;
    while (k < CUTS - 1 && ahead + t.mass[k] < target) ++k;
    const float new_lo = cut[k], new_hi = k ? cut[k - 1] : hi;
    if (k) ahead += t.mass[k - 1];
    inside = gather(inside.data(), static_cast<int64_t>(inside.size()), new_lo, new_hi,
                    t.count[k] - (k ? t.count[k - 1] : 0));
    lo = new_lo, hi = new_hi;
  }
  // the bracket's tokens sorted descending, walked as PyTorch walks the sorted row: a token is kept
  // while the probability strictly ahead of it, rounded to float32, is under top_p (in float32)
  std::sort(inside.begin(), inside.end(), [](float a, float b) { return a > b; });
  const float p = static_cast<float>(top_p);
  double before = ahead;
  float c = std::isfinite(hi) ? hi : m;
  for (const float value : inside) {
    if (!(static_cast<float>(before / total) < p)) break;
    c = value;
    before += std::exp(static_cast<double>(value) - m);
  }
  return c;
}

}  // namespace

namespace astrai_cpu {

at::Tensor top_p(at::Tensor logits, const at::Tensor& top_p) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "top_p: logits must be float32 [B, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.dim() == 1 && top_p.size(0) == B && top_p.device().is_cpu(),
              "top_p: top_p must be a [B] float32 CPU tensor");
  const at::Tensor p = top_p.contiguous();
  float* x = logits.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (!(pp[b] < 1.0f) || V == 0) continue;
      float* row = x + b * stride;
      float m = NEG_INF;
      bool bad = false;
      int64_t j = 0;
#if defined(__AVX512F__)
      __m512 best = _mm512_set1_ps(NEG_INF);
      __mmask16 nan = 0;
      for (; j + 16 <= V; j += 16) {
        const __m512 v = _mm512_loadu_ps(row + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
      }
      m = _mm512_reduce_max_ps(best), bad = nan != 0;
#endif
      for (; j < V; ++j) {
        if (std::isnan(row[j])) bad = true;
        m = std::max(m, row[j]);
      }
      if (bad || !std::isfinite(m)) continue;
      const float c = cutoff(row, V, m, static_cast<double>(pp[b]));
      for (j = 0; j < V; ++j) row[j] = row[j] < c ? NEG_INF : row[j];
    }
  });
  return logits;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) { m.def("top_p(Tensor(a!) logits, Tensor top_p) -> Tensor(a!)"); }

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("top_p", &astrai_cpu::top_p); }
