// astrai_cpu::lora_apply: the LoRA updates of a step's rows, added in place to a linear's output
// (astrai.lora). Rows of several adapters, and rows of none, share one call: the base product
// ran once for all of them, and each row adds its own adapter's low-rank update.
//
// y [T, out] and x [T, in]: float32 or bf16, the same dtype, contiguous rows. rows int32 [T]: each
// row's adapter slot, -1 for none. Per slot s (empty tensors where the module has no update for
// it): a[s] [P*R, in] (the A of each of its P parts, zero-padded to rank R), bt[s] [R, C] (each
// part's scaled B, transposed, side by side), float32, float16 or bf16 (a slot's two alike: the
// adapter's storage, EngineConfig.lora_dtype), and spans[s] int64 [P, 3]: part p adds
// s_p @ bt[:, c0 : c0 + o1 - o0] to y[:, o0:o1], with s_p = x @ a[p*R:(p+1)*R].T. Sums are float32,
// of the stored weights widened exactly to float32.
//
// A run of at least GEMM_ROWS consecutive rows of one slot (a prefill chunk) goes through ATen's
// GEMMs; other rows (decode, speculative verification) are done row by row here, each row's update
// summed in float32 and added to y with one rounding. With at least as many rows as threads the
// rows are spread over the threads; with fewer (a lone stream), each row's work is split over them in
// one parallel region: A's rows, a barrier, then the output columns of every part (its bytes are read
// at the bandwidth of every core, not one's, at the cost of one fork and join a module).
//
// lora_around (the whole-step kernel's way on quantized weights, up to 15 rows): the same updates,
// the same bits, inside the linear's own parallel region (quant_linear_into with an Around): each
// thread its share of A's rows, a barrier, its share of the linear's columns, then the updates of
// those columns. That saves a fork and join per projection (120 a SmolLM2 token) and sends each
// thread's share of the update's weights out to memory at once, and writes bf16 rows 8 at a time.
// A decode step of the default model in bf16 (AVX512-BF16, 2 Zen 4 cores, in process) with one
// rank-16 adapter on all projections: 2.6-3.0 ms more than the base step's 6 ms before, 0.8-1.5 ms
// after (the update's 9.7 MB at the base step's 29 GB/s would take 0.33 ms).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace astrai_cpu {
namespace {

constexpr int64_t GEMM_ROWS = 16;
// weights (A and B values) of one module's update from which a lone row's update is split over
// the threads (each its share of A's rows, then of the output columns): below it, the two
// parallel regions cost more than they save
constexpr int64_t SPLIT_WEIGHTS = 16384;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i].x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline void add_to(float* y, int64_t i, float v) { y[i] += v; }
inline void add_to(at::BFloat16* y, int64_t i, float v) { y[i] = static_cast<at::BFloat16>(load(y, i) + v); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline float hsum(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
// 8 stored weights from p, widened to float32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// 8 sums added to y[o .. o + 8)
inline void add8(float* y, __m256 v) { _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), v)); }
inline void add8(at::BFloat16* y, __m256 v) {  // add_to's rounding (c10's, to nearest even), 8 lanes at once
  const __m256 sum = _mm256_add_ps(load8(y), v);
  const __m256i u = _mm256_castps_si256(sum);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}
// bytes from p on their way into L2 (a thread's share of an update's weights, ahead of its use)
inline void fetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}
#else
inline void fetch(const void*, int64_t) {}
#endif

// A slot's weights, stored as W (float, at::Half or at::BFloat16)
template <typename W>
struct Slot {
  const W* a = nullptr;
  const W* bt = nullptr;
  const int64_t* spans = nullptr;
  int64_t parts = 0, rank = 0, cols = 0;
};

// sv[j] = A[j] . xf for j in [j0, j1): four rows of A against each load of x
template <typename W>
void shrink(const W* a, const float* xf, int64_t in, float* sv, int64_t j0, int64_t j1) {
  int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const int64_t kv = in & ~int64_t(7);
  for (; j + 4 <= j1; j += 4) {
    const W* r0 = a + j * in;
    const W *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t k = 0; k < kv; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xf + k);
      c0 = _mm256_fmadd_ps(load8(r0 + k), xv, c0);
      c1 = _mm256_fmadd_ps(load8(r1 + k), xv, c1);
      c2 = _mm256_fmadd_ps(load8(r2 + k), xv, c2);
      c3 = _mm256_fmadd_ps(load8(r3 + k), xv, c3);
    }
    float s0 = hsum(c0), s1 = hsum(c1), s2 = hsum(c2), s3 = hsum(c3);
    for (int64_t k = kv; k < in; ++k) {
      s0 += load(r0, k) * xf[k];
      s1 += load(r1, k) * xf[k];
      s2 += load(r2, k) * xf[k];
      s3 += load(r3, k) * xf[k];
    }
    sv[j] = s0, sv[j + 1] = s1, sv[j + 2] = s2, sv[j + 3] = s3;
  }
#endif
  for (; j < j1; ++j) {
    const W* aj = a + j * in;
    float sum = 0.f;
    for (int64_t k = 0; k < in; ++k) sum += load(aj, k) * xf[k];
    sv[j] = sum;
  }
}

// y[o] += sum_r sv[r] * b[r * cols + o] for o in [lo, hi) (b: part p's first column of bt; y: its
// first output column). Each output's sum runs over r in order from zero, then goes into y: the
// columns in blocks whose running sums stay in L1, each block reading B's rows one after another
// (one contiguous stream at a time, which the hardware prefetcher follows; reading a few columns of
// every row at once, as a register tile over the columns did, keeps R streams in flight, past what
// it tracks: a lone row's rank-64 update of a 4096-wide q/k/v from memory, 2 Zen 3 cores, took
// 157 us with the tile, 110 and 150 us in two runs of this on a noisy machine). The last columns
// of a block (under 8) go through 8 zero-padded lanes: every column gets the same fused
// multiply-adds whatever W is, so 16-bit weights give the float32 kernel's result on their values.
template <typename W, typename T>
void expand(const W* b, int64_t cols, int64_t R, const float* sv, int64_t lo, int64_t hi, T* y) {
  constexpr int64_t BLOCK = 2048;
  alignas(32) float acc[BLOCK];
  for (int64_t c0 = lo; c0 < hi; c0 += BLOCK) {
    const int64_t n = std::min(BLOCK, hi - c0);
    int64_t vec = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    vec = n & ~int64_t(7);
    for (int64_t o = 0; o < vec; o += 8) _mm256_store_ps(acc + o, _mm256_setzero_ps());
    for (int64_t r = 0; r < R; ++r) {
      const __m256 sr = _mm256_set1_ps(sv[r]);
      const W* br = b + r * cols + c0;
      for (int64_t o = 0; o < vec; o += 8)
        _mm256_store_ps(acc + o, _mm256_fmadd_ps(sr, load8(br + o), _mm256_load_ps(acc + o)));
    }
    for (int64_t o = 0; o < vec; o += 8) add8(y + c0 + o, _mm256_load_ps(acc + o));
    if (vec < n) {  // the last columns, widened into 8 lanes (zeros past the end): the same sums
      const int64_t left = n - vec;
      __m256 c = _mm256_setzero_ps();
      alignas(32) float w[8] = {};
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t j = 0; j < left; ++j) w[j] = load(b, r * cols + c0 + vec + j);
        c = _mm256_fmadd_ps(_mm256_set1_ps(sv[r]), _mm256_load_ps(w), c);
      }
      _mm256_store_ps(w, c);
      for (int64_t j = 0; j < left; ++j) add_to(y, c0 + vec + j, w[j]);
      vec = n;
    }
#endif
    for (int64_t o = c0 + vec; o < c0 + n; ++o) {
      float sum = 0.f;
      for (int64_t r = 0; r < R; ++r) sum += sv[r] * load(b, r * cols + o);
      add_to(y, o, sum);
    }
  }
}

// one row's update: with ``split``, in one parallel region of the intra-op threads: each its share of
// A's rows (blocks of 4), a barrier, then its share of every part's output columns (units of 32): the
// same sums as without, in the same order (a row of A, a column of the output: one thread each)
template <typename T, typename W>
void one_row(const T* x, T* y, const Slot<W>& s, int64_t in, bool split) {
  std::vector<float> xf(in), sv(s.parts * s.rank);
  for (int64_t k = 0; k < in; ++k) xf[k] = load(x, k);
  const int64_t PR = s.parts * s.rank;
  const auto columns = [&](int64_t u0, int64_t u1) {  // output units [u0, u1) of all parts, in order
    int64_t first = 0;
    for (int64_t p = 0; p < s.parts; ++p) {
      const int64_t o0 = s.spans[3 * p], n = s.spans[3 * p + 1] - o0, units = (n + 31) / 32;
      const int64_t lo = std::max(u0, first) - first, hi = std::min(u1, first + units) - first;
      if (lo < hi)
        expand(s.bt + s.spans[3 * p + 2], s.cols, s.rank, sv.data() + p * s.rank, lo * 32, std::min(n, hi * 32), y + o0);
      first += units;
    }
    return first;
  };
  if (!split) {
    shrink(s.a, xf.data(), in, sv.data(), 0, PR);
    columns(0, INT64_MAX);
    return;
  }
  int64_t units = 0;
  for (int64_t p = 0; p < s.parts; ++p) units += (s.spans[3 * p + 1] - s.spans[3 * p] + 31) / 32;
  const int64_t blocks = (PR + 3) / 4;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    shrink(s.a, xf.data(), in, sv.data(), std::min(PR, blocks * t / nt * 4), std::min(PR, blocks * (t + 1) / nt * 4));
#pragma omp barrier
    columns(units * t / nt, units * (t + 1) / nt);
  }
}

// Slot<float>, Slot<at::Half> and Slot<at::BFloat16> at once: a slot's weights in its dtype
struct Slots {
  std::vector<Slot<float>> f32;
  std::vector<Slot<at::Half>> f16;
  std::vector<Slot<at::BFloat16>> bf16;
  std::vector<at::ScalarType> dtype;  // per slot; Undefined: no update
};

template <typename T>
void row(const at::Tensor& x, at::Tensor& y, int64_t r, const Slots& s, int64_t slot, int64_t in, bool split) {
  const T* xr = x.data_ptr<T>() + r * in;
  T* yr = y.data_ptr<T>() + r * y.size(1);
  switch (s.dtype[slot]) {
    case at::kHalf: one_row(xr, yr, s.f16[slot], in, split); break;
    case at::kBFloat16: one_row(xr, yr, s.bf16[slot], in, split); break;
    default: one_row(xr, yr, s.f32[slot], in, split);
  }
}

template <typename W>
void fill(Slot<W>& sl, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& spans) {
  sl.parts = spans.size(0), sl.rank = bt.size(0), sl.cols = bt.size(1);
  sl.a = a.data_ptr<W>(), sl.bt = bt.data_ptr<W>(), sl.spans = spans.data_ptr<int64_t>();
}

// a slot's weights checked against the module's input and output widths; their dtype
at::ScalarType check_slot(const at::Tensor& a, const at::Tensor& bt, const at::Tensor& spans, int64_t in, int64_t out,
                          int64_t s) {
  const at::ScalarType wt = a.scalar_type();
  TORCH_CHECK((wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16) && bt.scalar_type() == wt &&
                  spans.scalar_type() == at::kLong && a.is_contiguous() && bt.is_contiguous() && spans.is_contiguous() &&
                  a.dim() == 2 && a.size(1) == in && bt.dim() == 2 && spans.dim() == 2 && spans.size(1) == 3 &&
                  a.size(0) == spans.size(0) * bt.size(0),
              "lora_apply: slot ", s, "'s weights are not what the module's input takes (a [parts * rank, in] and ",
              "bt [rank, cols] in float32, float16 or bf16 alike, spans int64 [parts, 3])");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t p = 0; p < spans.size(0); ++p)
    TORCH_CHECK(sp[3 * p] >= 0 && sp[3 * p] <= sp[3 * p + 1] && sp[3 * p + 1] <= out && sp[3 * p + 2] >= 0 &&
                    sp[3 * p + 2] + sp[3 * p + 1] - sp[3 * p] <= bt.size(1),
                "lora_apply: a span outside the output");
  return wt;
}

// lora_around's work for stored weights W and rows T: the rows' updates with one_row's sums (the
// same bits), in the linear's region: the blocks of 4 rows of A of every row's adapter shared out
// over the threads, a barrier, and each thread's own columns of every row updated once the linear
// has written them.
template <typename T, typename W>
void around_rows(const T* x, T* y, int64_t in, int64_t out, const std::vector<int64_t>& job_rows,
                 const std::vector<const Slot<W>*>& jobs, const std::function<void(const Around&)>& linear) {
  const int64_t J = static_cast<int64_t>(jobs.size());
  std::vector<int64_t> first(J + 1, 0), blocks(J + 1, 0);  // each job's s values, and its blocks of A's rows
  for (int64_t j = 0; j < J; ++j) {
    const int64_t PR = jobs[j]->parts * jobs[j]->rank;
    first[j + 1] = first[j] + PR, blocks[j + 1] = blocks[j] + (PR + 3) / 4;
  }
  std::vector<float> xf(J * in), sv(first[J]);
  for (int64_t j = 0; j < J; ++j)
    for (int64_t k = 0; k < in; ++k) xf[j * in + k] = load(x + job_rows[j] * in, k);
  // this thread's blocks of A: fetched (prefetch) or multiplied into their s values
  const auto shrink_share = [&](int64_t t, int64_t nt, bool prefetch) {
    const int64_t b0 = blocks[J] * t / nt, b1 = blocks[J] * (t + 1) / nt;
    for (int64_t j = 0; j < J; ++j) {
      const int64_t lo = std::max(b0, blocks[j]), hi = std::min(b1, blocks[j + 1]), PR = first[j + 1] - first[j];
      if (lo >= hi) continue;
      const int64_t j0 = std::min(PR, (lo - blocks[j]) * 4), j1 = std::min(PR, (hi - blocks[j]) * 4);
      if (prefetch) fetch(jobs[j]->a + j0 * in, (j1 - j0) * in * static_cast<int64_t>(sizeof(W)));
      else shrink(jobs[j]->a, xf.data() + j * in, in, sv.data() + first[j], j0, j1);
    }
  };
  // each part of job j within columns [c0, c1): f(slot, p, lo, hi), lo and hi from the part's first column
  const auto parts_in = [&](int64_t j, int64_t c0, int64_t c1, auto&& f) {
    const Slot<W>& sl = *jobs[j];
    for (int64_t p = 0; p < sl.parts; ++p) {
      const int64_t o0 = sl.spans[3 * p], lo = std::max(c0, o0), hi = std::min(c1, sl.spans[3 * p + 1]);
      if (lo < hi) f(sl, p, lo - o0, hi - o0);
    }
  };
  Around around;
  around.before = [&](int64_t t, int64_t nt, int64_t c0, int64_t c1) {
    // its rows of A, then its columns of B (read after the linear's), requested at once: many lines
    // in flight (short streams, which the hardware prefetcher meets too late on its own)
    shrink_share(t, nt, true);
    for (int64_t j = 0; j < J; ++j)
      parts_in(j, c0, c1, [&](const Slot<W>& sl, int64_t p, int64_t lo, int64_t hi) {
        for (int64_t r = 0; r < sl.rank; ++r)
          fetch(sl.bt + sl.spans[3 * p + 2] + r * sl.cols + lo, (hi - lo) * static_cast<int64_t>(sizeof(W)));
      });
    shrink_share(t, nt, false);
  };
  around.after = [&](int64_t c0, int64_t c1) {
    for (int64_t j = 0; j < J; ++j) {
      T* yr = y + job_rows[j] * out;
      parts_in(j, c0, c1, [&](const Slot<W>& sl, int64_t p, int64_t lo, int64_t hi) {
        expand(sl.bt + sl.spans[3 * p + 2], sl.cols, sl.rank, sv.data() + first[j] + p * sl.rank, lo, hi,
               yr + sl.spans[3 * p]);
      });
    }
  };
  linear(around);
}

}  // namespace

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
  Slots slots;
  slots.f32.resize(S), slots.f16.resize(S), slots.bf16.resize(S);
  slots.dtype.assign(S, at::ScalarType::Undefined);
  for (int64_t s = 0; s < S; ++s) {
    if (!a[s].defined() || a[s].numel() == 0) continue;
    const at::ScalarType wt = check_slot(a[s], bt[s], spans[s], in, out, s);
    slots.dtype[s] = wt;
    if (wt == at::kHalf) fill(slots.f16[s], a[s], bt[s], spans[s]);
    else if (wt == at::kBFloat16) fill(slots.bf16[s], a[s], bt[s], spans[s]);
    else fill(slots.f32[s], a[s], bt[s], spans[s]);
  }
  const int32_t* slot_of = rows.data_ptr<int32_t>();
  std::vector<int64_t> single;  // rows done one by one
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && slot_of[e] == slot_of[t]) ++e;
    const int32_t s = slot_of[t];
    if (s >= 0 && s < S && slots.dtype[s] != at::ScalarType::Undefined) {
      if (e - t >= GEMM_ROWS) {  // a prefill chunk: ATen's GEMMs, in float32 (the weights widened)
        const int64_t parts = spans[s].size(0), rank = bt[s].size(0);
        const int64_t* sp = spans[s].data_ptr<int64_t>();
        const at::Tensor xs = x.narrow(0, t, e - t).to(at::kFloat);
        const at::Tensor sv = at::mm(xs, a[s].to(at::kFloat).t());
        const at::Tensor b = bt[s].to(at::kFloat);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t o0 = sp[3 * p], o1 = sp[3 * p + 1], c0 = sp[3 * p + 2];
          const at::Tensor d = at::mm(sv.narrow(1, p * rank, rank), b.narrow(1, c0, o1 - o0));
          at::Tensor dst = y.narrow(0, t, e - t).narrow(1, o0, o1 - o0);
          dst.copy_(dst.to(at::kFloat).add_(d));
        }
      } else {
        for (int64_t r = t; r < e; ++r) single.push_back(r);
      }
    }
    t = e;
  }
  const int64_t n = static_cast<int64_t>(single.size());
  const bool f32 = x.scalar_type() == at::kFloat;
  if (n >= at::get_num_threads()) {  // enough rows to keep every thread busy: a row each
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = single[i];
        f32 ? row<float>(x, y, r, slots, slot_of[r], in, false) : row<at::BFloat16>(x, y, r, slots, slot_of[r], in, false);
      }
    });
    return;
  }
  for (int64_t i = 0; i < n; ++i) {  // fewer rows than threads: each row's work split over them
    const int64_t r = single[i], s = slot_of[r];
    const bool split = a[s].numel() + bt[s].numel() >= SPLIT_WEIGHTS;
    f32 ? row<float>(x, y, r, slots, s, in, split) : row<at::BFloat16>(x, y, r, slots, s, in, split);
  }
}

bool lora_around(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                 const std::vector<at::Tensor>& bt, const std::vector<at::Tensor>& spans,
                 const std::function<void(const Around&)>& linear) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  y.is_contiguous(),
              "lora_around: contiguous rows x [T, in] and y [T, out], float32 or bf16 alike");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.numel() == x.size(0) && rows.is_contiguous(),
              "lora_around: rows int32 [T]");
  TORCH_CHECK(a.size() == bt.size() && a.size() == spans.size(), "lora_around: one a, bt, spans per slot");
  const int64_t T = x.size(0), in = x.size(1), out = y.size(1), S = static_cast<int64_t>(a.size());
  if (T >= GEMM_ROWS) return false;  // (runs of one adapter long enough for lora_apply's GEMMs)
  const int32_t* slot_of = rows.data_ptr<int32_t>();
  std::vector<int64_t> job_rows;
  at::ScalarType wt = at::ScalarType::Undefined;
  for (int64_t r = 0; r < T; ++r) {
    const int32_t s = slot_of[r];
    if (s < 0 || s >= S || !a[s].defined() || a[s].numel() == 0) continue;
    const at::ScalarType w = check_slot(a[s], bt[s], spans[s], in, out, s);
    if (wt != at::ScalarType::Undefined && w != wt) return false;  // (slots of one set share a dtype)
    wt = w;
    job_rows.push_back(r);
  }
  const auto go = [&](auto w) {
    using W = decltype(w);
    std::vector<Slot<W>> slots(S);
    std::vector<const Slot<W>*> jobs;
    for (const int64_t r : job_rows) {
      const int32_t s = slot_of[r];
      if (slots[s].a == nullptr) fill(slots[s], a[s], bt[s], spans[s]);
      jobs.push_back(&slots[s]);
    }
    if (x.scalar_type() == at::kFloat) around_rows(x.data_ptr<float>(), y.data_ptr<float>(), in, out, job_rows, jobs, linear);
    else around_rows(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), in, out, job_rows, jobs, linear);
  };
  if (job_rows.empty()) {  // no update: the linear alone
    Around none;
    none.before = [](int64_t, int64_t, int64_t, int64_t) {};
    none.after = [](int64_t, int64_t) {};
    linear(none);
  } else if (wt == at::kHalf) {
    go(at::Half());
  } else if (wt == at::kBFloat16) {
    go(at::BFloat16());
  } else {
    go(0.f);
  }
  return true;
}

// quant_linear with the rows' adapter updates in its region (DecodeStack's way for a few rows)
at::Tensor quant_linear_lora(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                             const std::vector<at::Tensor>& bt, const std::vector<at::Tensor>& spans) {
  TORCH_CHECK(x.dim() == 2 && !layout.empty() && layout[0] > 0, "quant_linear_lora: rows x [T, k]");
  at::Tensor y = at::empty({x.size(0), layout[0]}, x.options());
  const at::Tensor xs = x.contiguous();
  const bool done = lora_around(y, xs, rows, a, bt, spans, [&](const Around& around) {
    quant_linear_into(xs, packed, layout, bias, y, &around);
  });
  if (!done) {
    y = quant_linear(xs, packed, layout, bias);
    lora_apply(y, xs, rows, a, bt, spans);
  }
  return y;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor rows, Tensor[] a, Tensor[] bt, Tensor[] spans) -> ()");
  m.def(
      "quant_linear_lora(Tensor x, Tensor packed, int[] layout, Tensor? bias, Tensor rows, Tensor[] a, Tensor[] bt, "
      "Tensor[] spans) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("lora_apply", &astrai_cpu::lora_apply);
  m.impl("quant_linear_lora", &astrai_cpu::quant_linear_lora);
}
