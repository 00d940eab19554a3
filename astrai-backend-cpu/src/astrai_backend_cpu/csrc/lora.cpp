// astrai_cpu::lora_apply: the LoRA updates of a step's rows, added in place to a linear's output
// (astrai.lora). Rows of several adapters, and rows of none, share one call: the base product
// ran once for all of them, and each row adds its own adapter's low-rank update.
//
// y [T, out] and x [T, in]: float32 or bf16, the same dtype, contiguous rows. rows int32 [T]: each
// row's adapter slot, -1 for none. Per slot s (empty tensors where the module has no update for
// it), float32, float16 or bf16 (a slot's two alike: the adapter's storage, EngineConfig.lora_dtype),
// in blocks that a row reads as few long streams (astrai.lora.layers' layout):
//   a[s] [P*R/4, ceil(in/16), 4, 16]: the A of each of its P parts, zero-padded to rank R (a multiple
//     of 4), its rows in groups of 4 and each group's columns 16 at a time, the 4 rows side by side
//     (a[g, k, i, l] = A[4g + i, 16k + l], zeros past in);
//   b[s] [C/16, R, 16]: each part's scaled B in blocks of 16 output columns, a block's R rows of 16
//     one after another (b[c, r, l] = B[16c + l, r]), each part starting at a block (zeros between);
//   spans[s] int64 [P, 3]: part p adds s_p @ B_p^T to y[:, o0:o1], its B from column c0 (a multiple
//     of 16), with s_p = x @ A[p*R:(p+1)*R].T.
// Sums are float32, of the stored weights widened exactly to float32. Rows of A as [R, in] and B as
// [R, C] read R short streams each (a rank-16 B of a 576-wide projection: 16 streams of 1,152 bytes),
// which the hardware prefetchers ramp up on too late: eight rows of the default model on eight
// adapters read them at 10-15 GB/s (2 Zen 4 cores, 78 MB a step) against ~30 in these blocks.
//
// A run of at least RUN_ROWS consecutive rows of one slot (a prefill chunk) goes in tiles of 4 rows
// that share each read of the slot's weights (A's groups, then B's blocks, from L1 and L2 for the
// rest of the run's tiles), every chunk's tiles in one parallel region: a prefill of 8 x 80 rows on 8
// rank-16 adapters of the default model took 160 ms more than the base's through ATen's float32
// GEMMs on the weights widened per chunk (~4 ATen calls and parallel regions per module and
// adapter); other rows (decode, speculative verification) are done row by row, each row's update
// summed in float32 and added to y with one rounding. With at least as many rows as threads the
// rows are spread over the threads; with fewer (a lone stream), each row's work is split over them in
// one parallel region: A's rows, a barrier, then the output columns of every part (its bytes are read
// at the bandwidth of every core, not one's, at the cost of one fork and join a module).
//
// lora_around (the whole-step kernel's way on quantized weights, fewer adapter rows than threads:
// a lone stream's, which lora_apply would split over the threads in two regions): the same updates,
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
#include <memory>
#include <type_traits>
#include <vector>

namespace astrai_cpu {
namespace {

// a run of at least RUN_ROWS consecutive rows of one slot (a prefill chunk) goes in tiles of TILE
// rows that share each read of the slot's weights; shorter runs (decode, verification) row by row
constexpr int64_t RUN_ROWS = 16, TILE = 4;
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

// A slot's weights, stored as W (float, at::Half or at::BFloat16), in the layout of the module
// comment: a [groups, kb, 4, 16], b [cb, R, 16]
template <typename W>
struct Slot {
  const W* a = nullptr;
  const W* b = nullptr;
  const int64_t* spans = nullptr;
  int64_t parts = 0, rank = 0, kb = 0;
  // part p's first column block
  const W* part(int64_t p) const { return b + spans[3 * p + 2] * rank; }
};

// sv[j] = A[j] . xf for the rows [j0, j1) of A (multiples of 4: whole groups), xf zero-padded to
// kb * 16 values. A group's 4 rows are read as one stream, 16 weights of each a step, each row's
// sums in 16 lanes added up at the end (the same order whatever W is).
template <typename W>
void shrink(const W* a, const float* xf, int64_t kb, float* sv, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += 4) {
    const W* g = a + j * kb * 16;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 c[8];
    for (auto& v : c) v = _mm256_setzero_ps();
    for (int64_t k = 0; k < kb; ++k, g += 64) {
      const __m256 x0 = _mm256_loadu_ps(xf + k * 16), x1 = _mm256_loadu_ps(xf + k * 16 + 8);
      for (int i = 0; i < 4; ++i) {
        c[2 * i] = _mm256_fmadd_ps(load8(g + 16 * i), x0, c[2 * i]);
        c[2 * i + 1] = _mm256_fmadd_ps(load8(g + 16 * i + 8), x1, c[2 * i + 1]);
      }
    }
    for (int i = 0; i < 4; ++i) sv[j + i] = hsum(_mm256_add_ps(c[2 * i], c[2 * i + 1]));
#else
    float c[4][16] = {};
    for (int64_t k = 0; k < kb; ++k, g += 64)
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 16; ++l) c[i][l] += load(g, 16 * i + l) * xf[k * 16 + l];
    for (int i = 0; i < 4; ++i) {
      float sum = 0.f;
      for (int l = 0; l < 16; ++l) sum += c[i][l];
      sv[j + i] = sum;
    }
#endif
  }
}

// y[o] += sum_r sv[r] * B[r][o] for o in [lo, hi) of a part (b: its first column block, y: its first
// output column). Each block of 16 columns is one contiguous read of R * 16 weights, its sums in
// registers, r in order from zero; a block cut by lo or hi is summed whole (B's columns are padded
// to blocks with zeros) and only its columns in [lo, hi) added.
template <typename W, typename T>
void expand(const W* b, int64_t R, const float* sv, int64_t lo, int64_t hi, T* y) {
  for (int64_t bo = lo / 16; bo * 16 < hi; ++bo) {
    const W* q = b + bo * R * 16;
    const int64_t o = bo * 16, from = std::max(lo, o), to = std::min(hi, o + 16);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 c0 = _mm256_setzero_ps(), c1 = c0;
    for (int64_t r = 0; r < R; ++r, q += 16) {
      const __m256 s = _mm256_set1_ps(sv[r]);
      c0 = _mm256_fmadd_ps(s, load8(q), c0);
      c1 = _mm256_fmadd_ps(s, load8(q + 8), c1);
    }
    if (from == o && to == o + 16) {
      add8(y + o, c0);
      add8(y + o + 8, c1);
      continue;
    }
    alignas(32) float w[16];
    _mm256_store_ps(w, c0);
    _mm256_store_ps(w + 8, c1);
#else
    float w[16] = {};
    for (int64_t r = 0; r < R; ++r, q += 16)
      for (int l = 0; l < 16; ++l) w[l] += sv[r] * load(q, l);
#endif
    for (int64_t c = from; c < to; ++c) add_to(y, c, w[c - o]);
  }
}

// one row's update: with ``split``, in one parallel region of the intra-op threads: each its share of
// A's groups of 4 rows, a barrier, then its share of every part's output columns (units of 32): the
// same sums as without, in the same order (a row of A, a column of the output: one thread each)
template <typename T, typename W>
void one_row(const T* x, T* y, const Slot<W>& s, int64_t in, bool split) {
  std::vector<float> xf(s.kb * 16, 0.f), sv(s.parts * s.rank);
  for (int64_t k = 0; k < in; ++k) xf[k] = load(x, k);
  const int64_t PR = s.parts * s.rank;
  const auto columns = [&](int64_t u0, int64_t u1) {  // output units [u0, u1) of all parts, in order
    int64_t first = 0;
    for (int64_t p = 0; p < s.parts; ++p) {
      const int64_t o0 = s.spans[3 * p], n = s.spans[3 * p + 1] - o0, units = (n + 31) / 32;
      const int64_t lo = std::max(u0, first) - first, hi = std::min(u1, first + units) - first;
      if (lo < hi) expand(s.part(p), s.rank, sv.data() + p * s.rank, lo * 32, std::min(n, hi * 32), y + o0);
      first += units;
    }
    return first;
  };
  if (!split) {
    shrink(s.a, xf.data(), s.kb, sv.data(), 0, PR);
    columns(0, INT64_MAX);
    return;
  }
  int64_t units = 0;
  for (int64_t p = 0; p < s.parts; ++p) units += (s.spans[3 * p + 1] - s.spans[3 * p] + 31) / 32;
  const int64_t groups = PR / 4;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    shrink(s.a, xf.data(), s.kb, sv.data(), groups * t / nt * 4, groups * (t + 1) / nt * 4);
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
void fill(Slot<W>& sl, const at::Tensor& a, const at::Tensor& b, const at::Tensor& spans) {
  sl.parts = spans.size(0), sl.rank = b.size(1), sl.kb = a.size(1);
  sl.a = a.data_ptr<W>(), sl.b = b.data_ptr<W>(), sl.spans = spans.data_ptr<int64_t>();
}

// a slot's weights checked against the module's input and output widths; their dtype
at::ScalarType check_slot(const at::Tensor& a, const at::Tensor& b, const at::Tensor& spans, int64_t in, int64_t out,
                          int64_t s) {
  const at::ScalarType wt = a.scalar_type();
  TORCH_CHECK((wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16) && b.scalar_type() == wt &&
                  spans.scalar_type() == at::kLong && a.is_contiguous() && b.is_contiguous() && spans.is_contiguous() &&
                  a.dim() == 4 && a.size(1) == (in + 15) / 16 && a.size(2) == 4 && a.size(3) == 16 && b.dim() == 3 &&
                  b.size(2) == 16 && spans.dim() == 2 && spans.size(1) == 3 &&
                  a.size(0) * 4 == spans.size(0) * b.size(1),
              "lora_apply: slot ", s, "'s weights are not what the module's input takes (a [parts * rank / 4, ",
              "ceil(in / 16), 4, 16] and b [column blocks, rank, 16] in float32, float16 or bf16 alike, spans ",
              "int64 [parts, 3])");
  const int64_t* sp = spans.data_ptr<int64_t>();
  for (int64_t p = 0; p < spans.size(0); ++p)
    TORCH_CHECK(sp[3 * p] >= 0 && sp[3 * p] <= sp[3 * p + 1] && sp[3 * p + 1] <= out && sp[3 * p + 2] >= 0 &&
                    sp[3 * p + 2] % 16 == 0 && sp[3 * p + 2] + sp[3 * p + 1] - sp[3 * p] <= b.size(0) * 16,
                "lora_apply: a span outside the output");
  return wt;
}

// rows [r0, r0 + nr) of one slot (nr <= TILE; a prefill chunk's): their s values from each of A's
// groups read once for them all, then their updates from each block of B read once; sums float32,
// each row's update added to y with one rounding. xf [TILE, kb * 16] and sv [TILE, parts * rank]:
// the caller's scratch. Rows past nr are computed on zeros and dropped.
template <typename T, typename W>
void tile(const T* x, T* y, int64_t in, int64_t out, int64_t r0, int64_t nr, const Slot<W>& s, float* xf, float* sv) {
  const int64_t kb = s.kb, PR = s.parts * s.rank, R = s.rank;
  for (int64_t r = 0; r < TILE; ++r) {
    float* xr = xf + r * kb * 16;
    const int64_t n = r < nr ? in : 0;
    for (int64_t k = 0; k < n; ++k) xr[k] = load(x + (r0 + r) * in, k);
    std::fill(xr + n, xr + kb * 16, 0.f);
  }
  for (int64_t j = 0; j < PR; j += 4) {
    const W* g = s.a + j * kb * 16;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 c[TILE][4];
    for (auto& row : c)
      for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t k = 0; k < kb; ++k, g += 64) {
      for (int i = 0; i < 4; ++i) {
        const __m256 w0 = load8(g + 16 * i), w1 = load8(g + 16 * i + 8);
        for (int64_t r = 0; r < TILE; ++r) {
          const float* xr = xf + r * kb * 16 + k * 16;
          c[r][i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), c[r][i]));
        }
      }
    }
    for (int64_t r = 0; r < TILE; ++r)
      for (int i = 0; i < 4; ++i) sv[r * PR + j + i] = hsum(c[r][i]);
#else
    for (int64_t r = 0; r < TILE; ++r)
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
        for (int64_t k = 0; k < kb * 16; ++k) sum += load(g, (k / 16) * 64 + 16 * i + k % 16) * xf[r * kb * 16 + k];
        sv[r * PR + j + i] = sum;
      }
#endif
  }
  for (int64_t p = 0; p < s.parts; ++p) {
    const int64_t o0 = s.spans[3 * p], n = s.spans[3 * p + 1] - o0;
    for (int64_t o = 0; o < n; o += 16) {
      const W* q = s.part(p) + o * R;
      alignas(32) float w[TILE][16];
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      __m256 acc[TILE][2];
      for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
      for (int64_t j = 0; j < R; ++j, q += 16) {
        const __m256 b0 = load8(q), b1 = load8(q + 8);
        for (int64_t r = 0; r < TILE; ++r) {
          const __m256 sj = _mm256_set1_ps(sv[r * PR + p * R + j]);
          acc[r][0] = _mm256_fmadd_ps(sj, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(sj, b1, acc[r][1]);
        }
      }
      if (o + 16 <= n) {
        for (int64_t r = 0; r < nr; ++r) {
          T* yr = y + (r0 + r) * out + o0 + o;
          add8(yr, acc[r][0]);
          add8(yr + 8, acc[r][1]);
        }
        continue;
      }
      for (int64_t r = 0; r < TILE; ++r) _mm256_store_ps(w[r], acc[r][0]), _mm256_store_ps(w[r] + 8, acc[r][1]);
#else
      for (int64_t r = 0; r < TILE; ++r) {
        std::fill(w[r], w[r] + 16, 0.f);
        for (int64_t j = 0; j < R; ++j)
          for (int l = 0; l < 16; ++l) w[r][l] += sv[r * PR + p * R + j] * load(q, j * 16 + l);
      }
#endif
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t c = o; c < std::min(n, o + 16); ++c) add_to(y + (r0 + r) * out + o0, c, w[r][c - o]);
    }
  }
}

// lora_around's work for stored weights W and rows T: the rows' updates with one_row's sums (the
// same bits), in the linear's region: the groups of 4 rows of A of every row's adapter shared out
// over the threads, a barrier, and each thread's own columns of every row updated once the linear
// has written them.
template <typename T, typename W>
void around_rows(const T* x, T* y, int64_t in, int64_t out, const std::vector<int64_t>& job_rows,
                 const std::vector<const Slot<W>*>& jobs, const std::function<void(const Around&)>& linear) {
  const int64_t J = static_cast<int64_t>(jobs.size()), kb = (in + 15) / 16;
  std::vector<int64_t> first(J + 1, 0), groups(J + 1, 0);  // each job's s values, and its groups of A's rows
  for (int64_t j = 0; j < J; ++j) {
    const int64_t PR = jobs[j]->parts * jobs[j]->rank;
    first[j + 1] = first[j] + PR, groups[j + 1] = groups[j] + PR / 4;
  }
  std::vector<float> xf(J * kb * 16, 0.f), sv(first[J]);
  for (int64_t j = 0; j < J; ++j)
    for (int64_t k = 0; k < in; ++k) xf[j * kb * 16 + k] = load(x + job_rows[j] * in, k);
  // this thread's groups of A: fetched (prefetch) or multiplied into their s values
  const auto shrink_share = [&](int64_t t, int64_t nt, bool prefetch) {
    const int64_t g0 = groups[J] * t / nt, g1 = groups[J] * (t + 1) / nt;
    for (int64_t j = 0; j < J; ++j) {
      const int64_t lo = std::max(g0, groups[j]), hi = std::min(g1, groups[j + 1]);
      if (lo >= hi) continue;
      const int64_t j0 = (lo - groups[j]) * 4, j1 = (hi - groups[j]) * 4;
      if (prefetch) fetch(jobs[j]->a + j0 * kb * 16, (j1 - j0) * kb * 16 * static_cast<int64_t>(sizeof(W)));
      else shrink(jobs[j]->a, xf.data() + j * kb * 16, kb, sv.data() + first[j], j0, j1);
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
    // its groups of A, then its column blocks of B (read after the linear's), requested at once
    shrink_share(t, nt, true);
    for (int64_t j = 0; j < J; ++j)
      parts_in(j, c0, c1, [&](const Slot<W>& sl, int64_t p, int64_t lo, int64_t hi) {
        fetch(sl.part(p) + lo / 16 * sl.rank * 16, ((hi + 15) / 16 - lo / 16) * sl.rank * 16 * static_cast<int64_t>(sizeof(W)));
      });
    shrink_share(t, nt, false);
  };
  around.after = [&](int64_t c0, int64_t c1) {
    for (int64_t j = 0; j < J; ++j) {
      T* yr = y + job_rows[j] * out;
      parts_in(j, c0, c1, [&](const Slot<W>& sl, int64_t p, int64_t lo, int64_t hi) {
        expand(sl.part(p), sl.rank, sv.data() + first[j] + p * sl.rank, lo, hi, yr + sl.spans[3 * p]);
      });
    }
  };
  linear(around);
}

}  // namespace

// One module's slots, checked (lora_slots): their weights in their dtypes and, per slot, how many
// weights A and B hold and the s values of a row (parts * rank)
struct LoraSlots {
  Slots slots;
  std::vector<int64_t> weights, pr;
  std::vector<at::Tensor> held;  // every slot's a, b and spans, alive while the pointers are read
  int64_t in = 0, out = 0;
};

std::shared_ptr<const LoraSlots> lora_slots(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                            const std::vector<at::Tensor>& spans, int64_t in, int64_t out) {
  TORCH_CHECK(a.size() == b.size() && a.size() == spans.size(), "lora_apply: one a, b, spans per slot");
  const int64_t S = static_cast<int64_t>(a.size());
  auto ls = std::make_shared<LoraSlots>();
  ls->in = in, ls->out = out;
  Slots& slots = ls->slots;
  slots.f32.resize(S), slots.f16.resize(S), slots.bf16.resize(S);
  slots.dtype.assign(S, at::ScalarType::Undefined);
  ls->weights.assign(S, 0), ls->pr.assign(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    if (!a[s].defined() || a[s].numel() == 0) continue;
    const at::ScalarType wt = check_slot(a[s], b[s], spans[s], in, out, s);
    slots.dtype[s] = wt;
    if (wt == at::kHalf) fill(slots.f16[s], a[s], b[s], spans[s]);
    else if (wt == at::kBFloat16) fill(slots.bf16[s], a[s], b[s], spans[s]);
    else fill(slots.f32[s], a[s], b[s], spans[s]);
    ls->weights[s] = a[s].numel() + b[s].numel(), ls->pr[s] = spans[s].size(0) * b[s].size(1);
    ls->held.insert(ls->held.end(), {a[s], b[s], spans[s]});
  }
  return ls;
}

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const LoraSlots& ls) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_apply: x [T, in], y [T, out]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_apply: x and y float32 or bf16 alike");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), "lora_apply: contiguous x and y");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.numel() == x.size(0) && rows.is_contiguous(),
              "lora_apply: rows int32 [T]");
  TORCH_CHECK(x.size(1) == ls.in && y.size(1) == ls.out, "lora_apply: x and y not the widths the slots were checked for");
  const int64_t T = x.size(0), in = x.size(1);
  const Slots& slots = ls.slots;
  const int64_t S = static_cast<int64_t>(slots.dtype.size());
  const int32_t* slot_of = rows.data_ptr<int32_t>();
  std::vector<int64_t> single;  // rows done one by one
  std::vector<std::pair<int64_t, int64_t>> tiles;  // a prefill chunk's: first row, rows
  int64_t max_pr = 0;
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && slot_of[e] == slot_of[t]) ++e;
    const int32_t s = slot_of[t];
    if (s >= 0 && s < S && slots.dtype[s] != at::ScalarType::Undefined) {
      if (e - t >= RUN_ROWS) {
        for (int64_t r = t; r < e; r += TILE) tiles.emplace_back(r, std::min(TILE, e - r));
        max_pr = std::max(max_pr, ls.pr[s]);
      } else {
        for (int64_t r = t; r < e; ++r) single.push_back(r);
      }
    }
    t = e;
  }
  const bool f32 = x.scalar_type() == at::kFloat;
  if (!tiles.empty()) {  // one region for every chunk's tiles, a thread's tiles one after another
    const int64_t kb = (in + 15) / 16, out = y.size(1);
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xf(TILE * kb * 16), sv(TILE * max_pr);
      for (int64_t i = begin; i < end; ++i) {
        const auto [r0, nr] = tiles[i];
        const int32_t s = slot_of[r0];
        const auto go = [&](const auto& slot) {
          if (f32) tile(x.data_ptr<float>(), y.data_ptr<float>(), in, out, r0, nr, slot, xf.data(), sv.data());
          else tile(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), in, out, r0, nr, slot, xf.data(), sv.data());
        };
        if (slots.dtype[s] == at::kHalf) go(slots.f16[s]);
        else if (slots.dtype[s] == at::kBFloat16) go(slots.bf16[s]);
        else go(slots.f32[s]);
      }
    });
  }
  const int64_t n = static_cast<int64_t>(single.size());
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
    const bool split = ls.weights[s] >= SPLIT_WEIGHTS;
    f32 ? row<float>(x, y, r, slots, s, in, split) : row<at::BFloat16>(x, y, r, slots, s, in, split);
  }
}

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& b, const std::vector<at::Tensor>& spans) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_apply: x [T, in], y [T, out]");
  lora_apply(y, x, rows, *lora_slots(a, b, spans, x.size(1), y.size(1)));
}

bool lora_around(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const LoraSlots& ls,
                 const std::function<void(const Around&)>& linear) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  y.is_contiguous(),
              "lora_around: contiguous rows x [T, in] and y [T, out], float32 or bf16 alike");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.numel() == x.size(0) && rows.is_contiguous(),
              "lora_around: rows int32 [T]");
  TORCH_CHECK(x.size(1) == ls.in && y.size(1) == ls.out, "lora_around: x and y not the widths the slots were checked for");
  const int64_t T = x.size(0), in = x.size(1), out = y.size(1);
  const Slots& slots = ls.slots;
  const int64_t S = static_cast<int64_t>(slots.dtype.size());
  if (T >= RUN_ROWS) return false;  // (runs of one adapter long enough for lora_apply's tiles)
  const int32_t* slot_of = rows.data_ptr<int32_t>();
  std::vector<int64_t> job_rows;
  at::ScalarType wt = at::ScalarType::Undefined;
  for (int64_t r = 0; r < T; ++r) {
    const int32_t s = slot_of[r];
    if (s < 0 || s >= S || slots.dtype[s] == at::ScalarType::Undefined) continue;
    if (wt != at::ScalarType::Undefined && slots.dtype[s] != wt) return false;  // (slots of one set share a dtype)
    wt = slots.dtype[s];
    job_rows.push_back(r);
  }
  // as many adapter rows as threads: lora_apply's row a thread after the linear reads each row's
  // adapter as two long streams, and beats the shared region (the default model, 8 rows on 8
  // adapters, in process: the stack's step 15.5 -> 13.9 ms; a thread's rows' weights sent into its
  // L2 while it computed its columns of the linear did no better)
  if (static_cast<int64_t>(job_rows.size()) >= at::get_num_threads()) return false;
  const auto go = [&](const auto& typed) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(typed[0].a)>>;
    std::vector<const Slot<W>*> jobs;
    for (const int64_t r : job_rows) jobs.push_back(&typed[slot_of[r]]);
    if (x.scalar_type() == at::kFloat) around_rows(x.data_ptr<float>(), y.data_ptr<float>(), in, out, job_rows, jobs, linear);
    else around_rows(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), in, out, job_rows, jobs, linear);
  };
  if (job_rows.empty()) {  // no update: the linear alone
    Around none;
    none.before = [](int64_t, int64_t, int64_t, int64_t) {};
    none.after = [](int64_t, int64_t) {};
    linear(none);
  } else if (wt == at::kHalf) {
    go(slots.f16);
  } else if (wt == at::kBFloat16) {
    go(slots.bf16);
  } else {
    go(slots.f32);
  }
  return true;
}

bool lora_around(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                 const std::vector<at::Tensor>& b, const std::vector<at::Tensor>& spans,
                 const std::function<void(const Around&)>& linear) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_around: x [T, in], y [T, out]");
  return lora_around(y, x, rows, *lora_slots(a, b, spans, x.size(1), y.size(1)), linear);
}

// quant_linear with the rows' adapter updates in its region (DecodeStack's way for a few rows)
at::Tensor quant_linear_lora(const at::Tensor& x, const at::Tensor& packed, const std::vector<int64_t>& layout,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                             const std::vector<at::Tensor>& b, const std::vector<at::Tensor>& spans) {
  TORCH_CHECK(x.dim() == 2 && !layout.empty() && layout[0] > 0, "quant_linear_lora: rows x [T, k]");
  at::Tensor y = at::empty({x.size(0), layout[0]}, x.options());
  const at::Tensor xs = x.contiguous();
  const bool done = lora_around(y, xs, rows, a, b, spans, [&](const Around& around) {
    quant_linear_into(xs, packed, layout, bias, y, &around);
  });
  if (!done) {
    y = quant_linear(xs, packed, layout, bias);
    lora_apply(y, xs, rows, a, b, spans);
  }
  return y;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor rows, Tensor[] a, Tensor[] b, Tensor[] spans) -> ()");
  m.def(
      "quant_linear_lora(Tensor x, Tensor packed, int[] layout, Tensor? bias, Tensor rows, Tensor[] a, Tensor[] b, "
      "Tensor[] spans) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) {
  m.impl("lora_apply", static_cast<void (*)(at::Tensor, const at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&,
                                             const std::vector<at::Tensor>&, const std::vector<at::Tensor>&)>(
                           &astrai_cpu::lora_apply));
  m.impl("quant_linear_lora", &astrai_cpu::quant_linear_lora);
}
