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
