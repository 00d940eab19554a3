"""Fixtures of the CPU backend tests: the kernel built once (skips where it cannot build)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_CORE = Path(__file__).parents[1] / "core"
# the dense reference and the hand-built ragged steps of the torch_native tests
sys.path.insert(0, str(_CORE))
# and the core tests' fixtures (tiny model and tokenizer, engines checked for leaked KV), under a name
# of their own: "conftest" is this module's
_spec = importlib.util.spec_from_file_location("astrai_core_test_fixtures", _CORE / "conftest.py")
core = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(core)
tiny_model, tiny_tokenizer, pool_guard, make_engine, tiny_engine = (
    core.tiny_model,
    core.tiny_tokenizer,
    core.pool_guard,
    core.make_engine,
    core.tiny_engine,
)


@pytest.fixture(scope="session")
def cpu_kernels():
    """Build (or load from the cache) the CPU kernels; a missing compiler skips with the reason.
    A test that uses it runs with every available backend loaded (``fresh_registry``): the CPU
    plugin's fused kernels serve the model, as after an engine's start."""
    from astrai.errors import KernelUnavailable
    from astrai_backend_cpu import load_kernels

    try:
        return load_kernels()
    except KernelUnavailable as err:
        if "no C++ compiler" in str(err):
            pytest.skip(str(err))
        raise


@pytest.fixture(autouse=True)
def fresh_registry(request):
    """Each test discovers the backends anew (tests may select them by name), and one that uses
    ``cpu_kernels`` loads them all, as an engine does when it starts."""
    from astrai.extension.backend.policy import load_backends, reset_registry

    reset_registry()
    if "cpu_kernels" in request.fixturenames:
        request.getfixturevalue("cpu_kernels")
        load_backends()
    yield
    reset_registry()


@pytest.fixture
def in_force(cpu_kernels):
    """``{op: kernel}`` in force for CPU tensors: the very dict the model's lookups read (a test
    may pin a kernel in it, or take one out, for a while)."""
    from astrai.extension.backend.policy import get_registry

    return get_registry().kernels.for_device("cpu")


@pytest.fixture(scope="session")
def avx512_emulated(tmp_path_factory):
    """``torch.ops.astrai_cpu_avx512_emu``: csrc/prefill.cpp's AVX512-BF16 kernel compiled for this
    machine with its intrinsics emulated (``avx512_emu/``), so that it runs on any x86-64 CPU; skips
    without a C++ compiler or off x86-64."""
    import os
    import platform
    import shutil

    import torch
    from torch.utils.cpp_extension import load

    from astrai_backend_cpu.build import CXX_FLAGS, SOURCES

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("the AVX-512 emulation builds with a C++ compiler for x86-64")
    emu = Path(__file__).parent / "avx512_emu"
    load(
        name="astrai_cpu_avx512_emu",
        sources=[str(emu / "prefill_emu.cpp")],
        extra_include_paths=[str(emu), str(SOURCES[0].parent)],
        # the build's flags for this machine's baseline (its -march=native would not matter: the
        # kernel's instructions are emulated), warnings about 512-bit vectors' ABI off
        extra_cflags=[f for f in CXX_FLAGS if not f.startswith("-march")] + ["-Wno-psabi"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path_factory.mktemp("avx512-emu")),
        is_python_module=False,
    )
    return torch.ops.astrai_cpu_avx512_emu
