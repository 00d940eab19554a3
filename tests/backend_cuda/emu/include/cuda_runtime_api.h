// CPU emulator: the CUDA runtime types and calls the astrai kernels use.
#pragma once
#include "cuda_runtime.h"
