// astrai_cpu::categorical: one token per row of a step's float32 logits, drawn from softmax(logits /
// temperature) by astrai.sampling.noise.categorical's two-level exponential race, on the same
// counter-based noise: the block b of tokens [256 b, 256 b + 256) with the largest mass_b / E_b
// (E = -log(u), u = the hash of (seed, step, b) on noise stream 1), then inside it the token j
// with the largest p_j / E_j (stream 0, counter j). A row's token is a function of its logits,
// temperature, seed and step alone, as the Python race's is.
//
// In PyTorch a sampled step costs a copy of the logits, a softmax (a [B, V] tensor written and
// read again) and a sum over blocks: on 2 Zen 4 cores ~20 ms of a 32-row step of Gemma 3's
// 262,144-token vocabulary, a quarter of the step. Here the logits are read once, in place: each
// 256-token block's maximum and its sum of exp(x - max) (the block still in L1 for the second
// look), the blocks spread over the threads in pieces of 64; then per row the blocks' masses are
// brought to the row's maximum (sum * exp(block max - row max)), the block race run, and the
// winning block's 256 exps computed again for the inner race (against the block's own maximum:
// a common factor, the same argmax). The probabilities are never normalised (the race's argmax
// does not change with a common factor), so the draws match the Python race's wherever its two
// best ratios are not within a float32 rounding of each other.
//
// Rows the softmax turns to NaN (a NaN logit, +inf, or every logit -inf) give token 0, as the
// Python race gives for a row of NaN probabilities.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t BLOCK = 256;     // astrai.sampling.noise.BLOCK
constexpr int64_t PER_ITEM = 64;   // blocks a work item (64 KB of logits)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// astrai.sampling.noise's hash in uint32 arithmetic (its int64 tensor ops masked to 32 bits)
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline uint32_t row_key(int64_t seed, int64_t step, uint32_t stream) {
  const auto s = static_cast<uint64_t>(seed);
  uint32_t key = mix32(static_cast<uint32_t>(s) ^ 0x3C6EF372u);
  key = mix32(key ^ (static_cast<uint32_t>(s >> 32) ^ 0xA54FF53Au));
  key = mix32(key ^ (static_cast<uint32_t>(step) ^ 0x510E527Fu));
  return mix32(key ^ ((stream * 0x9E3779B9u) ^ 0x1F83D9ABu));
}

// exponential_noise of one cell: -log(u), u = (23 high bits of the hash + 1/2) / 2^23
inline float exponential(uint32_t key, int64_t id) {
  const uint32_t x = mix32(mix32(static_cast<uint32_t>(id) * 0x9E3779B9u + key) ^ key);
  const float u = (static_cast<float>(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -std::log(u);
}

struct Block {
  float max;  // of the block's x / t (-inf: every one -inf)
  float sum;  // of exp(x / t - max) over the block (0 when max is -inf)
};

// x[0, n) / t (t == 1: x itself), n <= BLOCK: the block's maximum and sum of exps; nan set when
// the block holds a NaN. -inf entries add exactly 0.
__attribute__((optimize("no-reciprocal-math"))) Block scan(const float* x, int64_t n, float t, bool& nan) {
  const bool scaled = t != 1.0f;
#if defined(__AVX512F__)
  const __m512 vt = _mm512_set1_ps(t), ninf = _mm512_set1_ps(NEG_INF);
  __m512 best = ninf;
  __mmask16 bad = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 v = _mm512_mask_loadu_ps(ninf, live, x + i);
    if (scaled) v = _mm512_div_ps(v, vt);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  const float m = _mm512_reduce_max_ps(best);
  if (bad) nan = true;
  if (m == NEG_INF || bad) return {m, 0.0f};
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 v = _mm512_mask_loadu_ps(ninf, live, x + i);
    if (scaled) v = _mm512_div_ps(v, vt);
    const __mmask16 finite = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(finite, astrai_cpu::exp_ps(_mm512_sub_ps(v, vm))));
  }
  return {m, _mm512_reduce_add_ps(acc)};
#else
  float m = NEG_INF;
  for (int64_t i = 0; i < n; ++i) {
    const float v = scaled ? x[i] / t : x[i];
    if (std::isnan(v)) nan = true;
    m = std::max(m, v);
  }
  if (m == NEG_INF || nan) return {m, 0.0f};
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = scaled ? x[i] / t : x[i];
    if (v != NEG_INF) s += std::exp(v - m);
  }
  return {m, s};
#endif
}

// The token of one row: the block race over its blocks' (max, sum), then the race inside the winner.
__attribute__((optimize("no-reciprocal-math"))) int64_t draw(const float* x, int64_t V, float t, const Block* blocks,
                                                              int64_t n_blocks, int64_t seed, int64_t step) {
  float m = NEG_INF;
  for (int64_t b = 0; b < n_blocks; ++b) m = std::max(m, blocks[b].max);
  if (!std::isfinite(m)) return 0;  // +inf (a NaN softmax) or every logit -inf
  const uint32_t outer = row_key(seed, step, 1), inner = row_key(seed, step, 0);
  int64_t block = 0;
  float best = -1.0f;
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float mass = blocks[b].sum == 0.0f ? 0.0f : blocks[b].sum * std::exp(blocks[b].max - m);
    const float r = mass / exponential(outer, b);
    if (r > best) {
      best = r;
      block = b;
    }
  }
  const int64_t lo = block * BLOCK, hi = std::min(V, lo + BLOCK);
  const float bm = blocks[block].max;
  int64_t pick = lo;
  best = -1.0f;
  for (int64_t j = lo; j < hi; ++j) {
    const float v = t != 1.0f ? x[j] / t : x[j];
    const float p = v == NEG_INF ? 0.0f : std::exp(v - bm);
    const float r = p / exponential(inner, j);
    if (r > best) {
      best = r;
      pick = j;
    }
  }
  return pick;
}

}  // namespace

namespace astrai_cpu {

at::Tensor categorical(const at::Tensor& logits, const c10::optional<at::Tensor>& temperature,
                       const at::Tensor& seeds, const at::Tensor& steps) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "categorical: logits must be float32 [B, V] with V > 0 and contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(V < (int64_t{1} << 31), "categorical: a vocabulary under 2^31 tokens");
  const auto check_rows = [B](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.dim() == 1 && t.size(0) == B && t.device().is_cpu(), "categorical: ",
                name, " must be a [B] ", type == at::kLong ? "int64" : "float32", " CPU tensor");
  };
  check_rows(seeds, at::kLong, "seeds");
  check_rows(steps, at::kLong, "steps");
  const at::Tensor seed_rows = seeds.contiguous(), step_rows = steps.contiguous();
  std::vector<float> t(static_cast<size_t>(B), 1.0f);
  if (temperature.has_value()) {
    check_rows(*temperature, at::kFloat, "temperature");
    const at::Tensor temps = temperature->contiguous();
    for (int64_t b = 0; b < B; ++b) {  // 0 (a greedy row, which takes its argmax elsewhere): as 1
      const float v = temps.data_ptr<float>()[b];
      t[b] = v == 0.0f ? 1.0f : v;
    }
  }
  const int64_t n_blocks = (V + BLOCK - 1) / BLOCK, items = (n_blocks + PER_ITEM - 1) / PER_ITEM;
  const float* x = logits.data_ptr<float>();
  std::vector<Block> blocks(static_cast<size_t>(B * n_blocks));
  std::vector<uint8_t> nan(static_cast<size_t>(B * items), 0);
  at::parallel_for(0, B * items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items, first = (item % items) * PER_ITEM, last = std::min(n_blocks, first + PER_ITEM);
      bool bad = false;
      for (int64_t k = first; k < last; ++k) {
        const int64_t lo = k * BLOCK;
        blocks[b * n_blocks + k] = scan(x + b * stride + lo, std::min(BLOCK, V - lo), t[b], bad);
      }
      nan[item] = bad;
    }
  });
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  const int64_t* seed = seed_rows.data_ptr<int64_t>();
  const int64_t* step = step_rows.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const bool bad = std::any_of(nan.begin() + b * items, nan.begin() + (b + 1) * items, [](uint8_t f) { return f; });
      ids[b] = bad ? 0 : draw(x + b * stride, V, t[b], blocks.data() + b * n_blocks, n_blocks, seed[b], step[b]);
    }
  });
  return out;
}

}  // namespace astrai_cpu

TORCH_LIBRARY_FRAGMENT(astrai_cpu, m) {
  m.def("categorical(Tensor logits, Tensor? temperature, Tensor seeds, Tensor steps) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai_cpu, CPU, m) { m.impl("categorical", &astrai_cpu::categorical); }
