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
    core.tiny_model, core.tiny_tokenizer, core.pool_guard, core.make_engine, core.tiny_engine,
)


@pytest.fixture(scope="session")
def cpu_kernels():
    """Build (or load from the cache) the CPU kernels and install the fused ones, as loading the
    backend does; a missing compiler skips with the reason."""
    from astrai.errors import KernelUnavailable
    from astrai_backend_cpu import load_kernels
    from astrai_backend_cpu.backend import CpuBackend

    try:
        path = load_kernels()
    except KernelUnavailable as err:
        if "no C++ compiler" in str(err):
            pytest.skip(str(err))
        raise
    CpuBackend.install()
    return path


@pytest.fixture(autouse=True)
def fresh_registry():
    """Each test discovers the backends anew (tests may select them by name)."""
    from astrai.extension.backend.policy import reset_registry

    reset_registry()
    yield
    reset_registry()
