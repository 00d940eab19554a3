// astrai_cpu::logits_out: where an LM head's float32 logits go (quant_linear's and linear_packed's
// float_out).
//
// A step's logits are the one large temporary it allocates afresh: Gemma 3's 262,144 float32 logits
// are 32 MiB at 32 rows, at or past glibc's mmap threshold (which cannot be raised past 32 MiB), so
// each step mapped a new block and faulted its 8,192 pages in again: ~8 ms of a ~65 ms step on 2 Zen
// 4 vCPUs (the allocator keeps smaller freed blocks in its heap: astrai.malloc). Outputs of
// LOGITS_KEPT_BYTES and more therefore come from one buffer kept between calls, whenever the
// previous step is done with it: nothing but the cache holds its storage any more (a caller that
// still holds a view of the last logits gets a fresh block, never memory that it reads). The buffer
// kept is the latest block allocated while the kept one was free, so it grows to the largest step's
// logits and stays there (one block: 32 MiB for Gemma at 32 rows).
#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>

#include "kernels.h"

namespace {

constexpr int64_t LOGITS_KEPT_BYTES = int64_t{16} << 20;

}  // namespace

namespace astrai_cpu {

at::Tensor logits_out(int64_t rows, int64_t cols) {
  const int64_t numel = rows * cols;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  if (numel * 4 < LOGITS_KEPT_BYTES) return at::empty({rows, cols}, options);
  static std::mutex lock;
  static auto* kept = new at::Tensor();  // never destroyed: no teardown order with torch's allocator
  std::lock_guard<std::mutex> guard(lock);
  const bool free = kept->defined() && kept->storage().use_count() == 1;
  if (free && kept->numel() >= numel) return kept->narrow(0, 0, numel).view({rows, cols});
  at::Tensor fresh = at::empty({numel}, options);
  if (!kept->defined() || free) *kept = fresh;  // a busy one stays: its holder will let it go
  return fresh.view({rows, cols});
}

}  // namespace astrai_cpu
