// CPU emulator of a CUDA grid for the astrai kernels. Blocks run one after another; the threads
// of a block are ucontext fibers on one OS thread, switched only at barriers (__syncthreads,
// warp-collective operations), which therefore keep their CUDA semantics:
//   - a barrier completes when every thread of the block (or warp) has arrived; threads that
//     exit while others wait are a deadlock, reported as an error (as a hang would be on a GPU);
//   - between barriers the threads run in a fresh pseudo-random order each round, and random
//     warps sit rounds out (drifting apart by whole phases), so a thread that reads what
//     another writes without a barrier in between sees it only by chance;
//   - shared memory is filled with 0xff (NaN in every float type) before each block, so a read
//     of shared memory the kernel never wrote shows up in its output;
//   - cp.async targets and ldmatrix rows are checked to be 16-byte aligned shared memory.
// An error abandons the launch; the launcher returns cudaErrorLaunchFailure and
// emu_last_error() says why.
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_runtime.h"

dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};

ucontext_t g_main;
std::vector<Fiber> g_fibers;
unsigned g_current = 0;
const std::function<void()>* g_body = nullptr;
bool g_failed = false;
std::string g_error;
uint64_t g_progress = 0;
unsigned char* g_smem = nullptr;
std::minstd_rand g_rng;  // the thread order of each round (seeded per launch: reproducible)
size_t g_smem_size = 0;

// Barrier state: the block's, and each warp's.
unsigned g_block_arrived = 0, g_block_gen = 0;
std::vector<unsigned> g_warp_arrived, g_warp_gen;
std::vector<unsigned char> g_exchange;  // [warp][lane][up to 64 bytes]
constexpr size_t kExchangeBytes = 64;

void yield() { swapcontext(&g_fibers[g_current].ctx, &g_main); }

void fail(const std::string& what) {
  if (!g_failed) {
    g_failed = true;
    char where[96];
    std::snprintf(where, sizeof where, " (block %u,%u,%u thread %u)", blockIdx.x, blockIdx.y, blockIdx.z,
                  g_current);
    g_error = what + where;
  }
  yield();  // never resumed: the launch is abandoned
}

void fiber_entry() {
  (*g_body)();
  g_fibers[g_current].done = true;
  ++g_progress;
  yield();
}

void barrier(unsigned& arrived, unsigned& gen, unsigned members) {
  const unsigned my_gen = gen;
  ++g_progress;
  if (++arrived == members) {
    arrived = 0;
    ++gen;
    return;
  }
  while (gen == my_gen) yield();
}

unsigned threads_per_block() { return blockDim.x * blockDim.y * blockDim.z; }

void run_block() {
  const unsigned n = threads_per_block();
  std::memset(g_smem, 0xff, g_smem_size);
  g_block_arrived = 0;
  g_warp_arrived.assign((n + 31) / 32, 0);
  g_warp_gen.assign((n + 31) / 32, 0);
  g_exchange.assign(size_t((n + 31) / 32) * 32 * kExchangeBytes, 0);
  g_fibers.resize(n);
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = g_fibers[t];
    f.done = false;
    f.stack.resize(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &g_main;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  std::vector<unsigned> order(n);
  for (unsigned t = 0; t < n; ++t) order[t] = t;
  const unsigned n_warps = (n + 31) / 32;
  for (uint64_t round = 0;; ++round) {
    // Every fourth round resumes all warps; the others pause a random half of them, so that
    // warps drift apart by whole phases between block barriers.
    const bool full = round % 4 == 3;
    const uint64_t paused = full || n_warps == 1 ? 0 : g_rng() & ((n_warps >= 64 ? ~0ull : (1ull << n_warps) - 1) >> 1);
    bool live = false;
    const uint64_t before = g_progress;
    for (unsigned i = n; i > 1; --i) std::swap(order[i - 1], order[g_rng() % i]);
    for (unsigned i = 0; i < n && !g_failed; ++i) {
      const unsigned t = order[i];
      if (g_fibers[t].done) continue;
      live = true;
      if ((paused >> (t / 32)) & 1) continue;
      g_current = t;
      threadIdx = dim3(t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y));
      swapcontext(&g_main, &g_fibers[t].ctx);
    }
    if (g_failed || !live) return;
    if (full && g_progress == before) {
      g_failed = true;
      g_error = "deadlock: threads wait at a barrier that the others never reach (exited or diverged)";
      return;
    }
  }
}

}  // namespace

void emu_syncthreads() { barrier(g_block_arrived, g_block_gen, threads_per_block()); }

void emu_syncwarp() {
  const unsigned w = g_current / 32;
  barrier(g_warp_arrived[w], g_warp_gen[w], 32);
}

unsigned emu_lane() { return g_current % 32; }

void emu_warp_exchange(const void* mine, size_t bytes, void* all) {
  if (bytes > kExchangeBytes) fail("warp exchange of more than 64 bytes");
  if (threads_per_block() % 32) fail("warp-collective operation in a block that is not whole warps");
  const unsigned w = g_current / 32;
  unsigned char* slots = g_exchange.data() + size_t(w) * 32 * kExchangeBytes;
  std::memcpy(slots + emu_lane() * kExchangeBytes, mine, bytes);
  emu_syncwarp();
  for (unsigned l = 0; l < 32; ++l)
    std::memcpy(static_cast<unsigned char*>(all) + l * bytes, slots + l * kExchangeBytes, bytes);
  emu_syncwarp();
}

uint64_t emu_shfl_xor(uint64_t bits, int lane_mask) {
  uint64_t all[32];
  emu_warp_exchange(&bits, sizeof bits, all);
  return all[(emu_lane() ^ unsigned(lane_mask)) % 32];
}

void emu_check_smem(const void* p, size_t bytes, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < g_smem || c + bytes > g_smem + g_smem_size) fail(std::string(what) + " outside shared memory");
  const size_t align = bytes < 16 ? bytes : 16;  // cp.async of 4 or 8 bytes: their size; else 16
  if (reinterpret_cast<uintptr_t>(p) % align) fail(std::string(what) + " not " + std::to_string(align) + "-byte aligned");
}

void emu_fail(const char* what) { fail(what); }

cudaError_t emu_run_grid(const cudaLaunchConfig_t& config, unsigned char* smem, size_t smem_size,
                         const std::function<void()>& body) {
  if (config.dynamicSmemBytes > smem_size) {
    g_error = "dynamic shared memory request above the emulator's 228 KiB";
    return cudaErrorInvalidValue;
  }
  g_failed = false;
  g_error.clear();
  g_rng.seed(12345);
  g_body = &body;
  g_smem = smem;
  g_smem_size = config.dynamicSmemBytes;
  gridDim = config.gridDim;
  blockDim = config.blockDim;
  for (unsigned z = 0; z < gridDim.z; ++z)
    for (unsigned y = 0; y < gridDim.y; ++y)
      for (unsigned x = 0; x < gridDim.x; ++x) {
        blockIdx = dim3(x, y, z);
        run_block();
        if (g_failed) return cudaErrorLaunchFailure;
      }
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : err == cudaErrorInvalidValue ? "invalid argument" : "launch failure";
}

extern "C" const char* emu_last_error() { return g_error.c_str(); }
