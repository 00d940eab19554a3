"""The kernel sources and compiler flags, shared by setup.py (AOT), the JIT build and compile_check.

Standard library only: setup.py loads this file by path, before anything is installed.
"""

from __future__ import annotations

from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"

#: CUDA translation units: plain CUDA, no torch header, each compiles standalone.
KERNELS = ("decode.cu", "prefill.cu", "rotary.cu")
#: The torch op registration (the one file that includes torch headers).
BINDINGS = "bindings.cpp"
#: Architectures CI compiles for (A100 and H100/H200); a JIT build targets the device it runs on.
CI_ARCHS = ("80", "90")

#: Flags of every nvcc compile (the JIT and AOT builds add torch's own, e.g. -std and the
#: __CUDA_NO_HALF_OPERATORS__ family, which the kernels are written to respect).
NVCC_FLAGS = ("-O3", "-lineinfo")
CXX_FLAGS = ("-O3",)
#: What compile_check adds: torch's defines, and any compiler, ptxas or spill warning fails.
NVCC_STRICT_FLAGS = (
    "-std=c++17",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "-Xcompiler=-Wall,-Wextra,-Werror",
    "--Werror=all-warnings",
    "-Xptxas=-Werror,-warn-spills,-warn-lmem-usage",
)


def kernel_paths() -> list[Path]:
    """Absolute paths of the .cu files."""
    return [CSRC / name for name in KERNELS]


def all_sources() -> list[Path]:
    """Every source of the extension library: the kernels and the bindings."""
    return [*kernel_paths(), CSRC / BINDINGS]
