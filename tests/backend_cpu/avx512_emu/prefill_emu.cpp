// astrai_cpu::prefill_attention's AVX512-BF16 kernel (csrc/prefill.cpp, unchanged) on any x86-64
// CPU: the intrinsics it calls are avx512_emu.h's emulations, and the ops register as
// torch.ops.astrai_cpu_avx512_emu.* (beside the real build's astrai_cpu.*).
//
// The torch headers come first, compiled for this machine; only then is the file told that its
// target has AVX512-F and AVX512-BF16, so that its `#if defined(__AVX512BF16__)` code compiles.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_emu.h"

#define __AVX512F__ 1
#define __AVX512BF16__ 1
#define astrai_cpu astrai_cpu_avx512_emu

#include "prefill.cpp"
