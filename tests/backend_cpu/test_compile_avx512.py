"""The kernels' AVX512-BF16 code compiles on any machine whose compiler targets AVX512-BF16.

That code (the prefill kernel, the bf16 GEMM and quantized linears, paged decode's bf16 paths) is
built only where the CPU has the instructions (``-march=native``), so on other machines neither the
build nor the other tests see it. ``python -m astrai_backend_cpu.compile_check`` compiles it with the
build's flags for a Sapphire Rapids target; it does not run it (that needs such a CPU: the tests of
the prefill kernel, the linears and the decode stack run there; the prefill kernel's also run here
on an emulation of its intrinsics, ``test_prefill_kernel.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from astrai_backend_cpu import compile_check


@pytest.fixture(scope="module")
def avx512_target():
    if shutil.which(compile_check.compiler()) is None:
        pytest.skip(f"no C++ compiler ({compile_check.compiler()})")
    macros = compile_check.target_macros(compile_check.DEFAULT_MARCH)
    if macros is None or "__AVX512BF16__" not in macros:
        pytest.skip(f"the compiler does not target AVX512-BF16 (-march={compile_check.DEFAULT_MARCH})")
    return compile_check.DEFAULT_MARCH


def test_the_avx512_sources_are_the_kernels_with_avx512_code():
    names = {src.name for src in compile_check.avx512_sources()}
    assert {"prefill.cpp", "paged_decode.cpp", "linear.cpp", "quant.cpp"} <= names


def test_avx512_bf16_code_compiles_for_a_target_that_has_it(avx512_target):
    sources = [src.name for src in compile_check.avx512_sources()]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai_backend_cpu.compile_check",
            "--march",
            avx512_target,
            "-j",
            "2",
            "--syntax-only",  # types and the target's intrinsics, as the build checks them, in less time
            *sources,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in sources:
        assert f"ok   {name} (-march={avx512_target})" in proc.stdout
