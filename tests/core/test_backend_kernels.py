"""Kernels reach the model through the backend registry, not through module globals.

Loading a backend for use (``load_backends()``: its instance made, then its ``kernels()`` asked
on the first lookup) fills that registry's ``KernelTable`` and changes no module global: not of
``astrai.extension`` and its modules, not of the model's modules that run the kernels, not of
the installed backend plugins.
"""

from __future__ import annotations

import sys

import pytest
import torch

from astrai.extension import fused
from astrai.extension.backend import policy

#: Modules whose globals loading a backend must leave alone (those of them that are imported).
WATCHED = ("astrai.extension", "astrai.model", "astrai.kvcache", "astrai_backend_")


def _watched_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.startswith(WATCHED) and sys.modules[name] is not None)


def _fingerprint(value: object) -> object:
    """What a module global is: its identity and, for a container, the identities it holds (a
    table filled in place keeps its identity)."""
    if isinstance(value, dict):
        return id(value), tuple((k, id(v)) for k, v in value.items())
    if isinstance(value, (list, set, frozenset, tuple)):
        return id(value), tuple(sorted(id(v) for v in value))
    return id(value)


def _globals(modules: list[str]) -> dict[tuple[str, str], object]:
    return {(m, k): _fingerprint(v) for m in modules for k, v in vars(sys.modules[m]).items()}


@pytest.fixture
def discovered():
    """A registry discovered anew (the backend classes imported, each asked whether it can run),
    and nothing of it loaded yet; forgotten after the test."""
    policy.reset_registry()
    registry = policy.get_registry()
    rows = registry.available_backends()
    yield registry, rows
    policy.reset_registry()


def test_loading_backends_changes_no_module_global(discovered):
    registry, rows = discovered
    modules = _watched_modules()
    before = _globals(modules)
    assert policy.load_backends() == rows
    for device_type in ("cpu", "cuda", "meta"):  # every loaded backend is asked for its kernels
        registry.kernels.for_device(device_type)
    with torch.no_grad():
        fused.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5)
    assert sorted(set(_watched_modules()) - set(modules)) == []  # nothing new imported to hide a change
    after = _globals(modules)
    changed = sorted(
        f"{m}.{k}" for m, k in before.keys() | after.keys() if before.get((m, k)) != after.get((m, k))
    )
    assert changed == []


def test_the_kernels_are_the_loaded_backends_own(discovered):
    registry, rows = discovered
    loaded = [name for name, ok, _ in rows if ok]
    with torch.no_grad():
        assert fused.kernel_for("rms_norm", torch.ones(1)) is None  # discovered, nothing loaded: no kernel
    policy.load_backends()
    lent = {}
    for name in reversed(loaded):  # the most preferred last: it wins an op
        lent.update(registry.instance(name).kernels("cpu"))
    assert set(registry.kernels.for_device("cpu")) == set(lent)
    if "cpu" in loaded:  # astrai-backend-cpu installed and built here
        assert {"rms_norm", "add_rms_norm", "rotary"} <= set(lent)
        with torch.no_grad():
            assert fused.kernel_for("rms_norm", torch.ones(1)) is registry.kernels.get("rms_norm", "cpu")
    policy.reset_registry()  # forgetting the registry forgets its kernels
    with torch.no_grad():
        assert fused.kernel_for("rms_norm", torch.ones(1)) is None
