"""Attention backend selection: ``attention()``, ``attn_backend()``, ``ASTR_BACKEND``.

Who chooses, strongest first:

1. ``attn_backend(...)`` context (a ``contextvars.ContextVar``: per thread and
   per asyncio task; a new thread starts with no selection, so enter the context
   in the thread that runs the model, e.g. the scheduler thread);
2. the ``ASTR_BACKEND`` environment variable, read at every selection;
3. automatic: per call, the first backend by ``priority`` (cuda 10, flash 20,
   torch_native 100) that is available and whose ``supports()`` returns None.

Choices 1 and 2 are strict: if the named backend is missing, broken,
unavailable or rejects the call, ``BackendUnavailable`` (``PluginError`` for a
broken plugin) is raised; nothing switches silently.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from enum import Enum
from typing import TYPE_CHECKING

from astrai.errors import BackendUnavailable, PluginError
from astrai.extension.backend.base import AttentionBackend
from astrai.plugins import PluginFailure, load_attention_backends

if TYPE_CHECKING:
    import torch

    from astrai.kvcache.cache import KVCache

logger = logging.getLogger(__name__)

ENV_VAR = "ASTR_BACKEND"


class ATTN_BACKEND(str, Enum):  # noqa: N801 - the spec's public name
    """The backends astrai knows by name; the value is the entry-point name."""

    CUDA = "cuda"
    FLASH = "flash"
    TORCH_NATIVE = "torch_native"


_SELECTED: ContextVar[str | None] = ContextVar("astrai_attn_backend", default=None)


@contextlib.contextmanager
def attn_backend(backend: ATTN_BACKEND | str) -> Iterator[None]:
    """Run the block with ``backend`` selected (strictly), like ``torch.nn.attention.sdpa_kernel``.

    Accepts an ``ATTN_BACKEND`` member or an entry-point name string; beats
    ``ASTR_BACKEND``; nests, and restores the previous selection on exit. An
    unknown name raises ``BackendUnavailable`` at the first ``attention()`` call.
    """
    if isinstance(backend, ATTN_BACKEND):
        name = backend.value
    elif isinstance(backend, str) and backend:
        name = backend
    else:
        raise TypeError(f"attn_backend() takes an ATTN_BACKEND member or a backend name, not {backend!r}")
    token = _SELECTED.set(name)
    try:
        yield
    finally:
        _SELECTED.reset(token)


def context_backend() -> str | None:
    """The backend chosen by an enclosing ``attn_backend(...)`` in this context, or None.

    Threads do not inherit it: the engine captures it when a request is submitted
    and the scheduler thread re-enters it for that request's steps.
    """
    return _SELECTED.get()


def requested_backend() -> tuple[str | None, str]:
    """The explicit selection in force here: ``(name, source)``, or ``(None, "automatic")``."""
    name = _SELECTED.get()
    if name is not None:
        return name, "attn_backend()"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"{ENV_VAR}={env}"
    return None, "automatic"


class BackendRegistry:
    """The attention backends of a process: classes, load failures, one instance each.

    Built by ``discover()`` from the entry points, or directly from in-memory
    classes (tests). Thread-safe; instances are created on first use.
    """

    def __init__(
        self,
        classes: Iterable[type[AttentionBackend]],
        failures: Mapping[str, PluginFailure] | None = None,
    ) -> None:
        self._classes: dict[str, type[AttentionBackend]] = {}
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
                raise PluginError(f"{cls!r} is not a subclass of AttentionBackend")
            self._classes.setdefault(cls.name, cls)
        self._failures = dict(failures or {})
        self._order = sorted(self._classes, key=lambda n: (self._classes[n].priority, n))
        self._lock = threading.Lock()
        self._availability: dict[str, tuple[bool, str]] = {}
        self._instances: dict[str, AttentionBackend] = {}
        self._auto: list[AttentionBackend] | None = None

    @classmethod
    def discover(cls) -> BackendRegistry:
        """A registry of every installed ``astrai.attention_backends`` plugin."""
        loaded = load_attention_backends()
        return cls(loaded.classes.values(), loaded.failures)

    def availability(self, name: str) -> tuple[bool, str]:
        """``cls.is_available()`` of a loaded backend, asked once."""
        with self._lock:
            if name not in self._availability:
                try:
                    self._availability[name] = self._classes[name].is_available()
                except Exception as err:  # the contract says it must not raise; don't let it kill selection
                    self._availability[name] = (False, f"is_available() raised {type(err).__name__}: {err}")
            return self._availability[name]

    def instance(self, name: str) -> AttentionBackend:
        """The one instance of a loaded backend (which must be available)."""
        with self._lock:
            if name not in self._instances:
                self._instances[name] = self._classes[name]()
            return self._instances[name]

    def available_backends(self) -> list[tuple[str, bool, str]]:
        """``(name, available, reason)`` for loaded, broken and known-but-missing backends."""
        rows = [(name, *self.availability(name)) for name in self._order]
        rows += [(name, False, f.describe()) for name, f in sorted(self._failures.items())]
        seen = {row[0] for row in rows}
        rows += [(b.value, False, "not installed") for b in ATTN_BACKEND if b.value not in seen]
        return rows

    def _automatic(self) -> list[AttentionBackend]:
        if self._auto is None:
            for failure in self._failures.values():
                logger.warning("skipping attention backend: %s", failure.describe())
            self._auto = [self.instance(n) for n in self._order if self.availability(n)[0]]
        return self._auto

    def _explicit(self, name: str, source: str) -> AttentionBackend:
        if name in self._failures:
            failure = self._failures[name]
            raise failure.as_error() from failure.error
        if name not in self._classes:
            known = {b.value for b in ATTN_BACKEND}
            installed = ", ".join(self._order) or "none"
            if name not in known:
                valid = ", ".join(sorted(known | set(self._classes)))
                raise BackendUnavailable(
                    f"invalid attention backend {name!r} (from {source}); valid values: {valid}"
                )
            raise BackendUnavailable(
                f"attention backend {name!r} (from {source}) not found; misspelled or not installed? "
                f"Installed: {installed}"
            )
        ok, reason = self.availability(name)
        if not ok:
            raise BackendUnavailable(f"attention backend {name!r} (from {source}) is unavailable: {reason}")
        return self.instance(name)

    def select(self, q: torch.Tensor, kv_cache: KVCache) -> AttentionBackend:
        """The backend that runs this call; raises ``BackendUnavailable`` (see module doc)."""
        name, source = requested_backend()
        if name is not None:
            backend = self._explicit(name, source)
            reason = backend.supports(q, kv_cache)
            if reason is not None:
                raise BackendUnavailable(
                    f"attention backend {name!r} (from {source}) cannot run this call: {reason}"
                )
            return backend
        reasons = []
        for backend in self._automatic():
            reason = backend.supports(q, kv_cache)
            if reason is None:
                return backend
            reasons.append(f"{backend.name}: {reason}")
        raise BackendUnavailable(
            "no attention backend can run this call (" + "; ".join(reasons or ["none installed"]) + ")"
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
    ) -> torch.Tensor:
        """``select(q, kv_cache).forward(...)``; see ``AttentionBackend.forward``."""
        return self.select(q, kv_cache).forward(q, k, v, layer_id, kv_cache, scale)


_registry: BackendRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> BackendRegistry:
    """The process-wide registry, discovered on first use (one discovery per process)."""
    global _registry
    registry = _registry  # lock-free fast path: this runs for every layer of every step
    if registry is not None:
        return registry
    with _registry_lock:
        if _registry is None:
            _registry = BackendRegistry.discover()
        return _registry


def reset_registry() -> None:
    """Forget the discovered registry: the next call discovers again (tests, after installs)."""
    global _registry
    with _registry_lock:
        _registry = None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, kv_cache: KVCache, scale: float
) -> torch.Tensor:
    """Write this step's K/V for ``layer_id`` and attend, with the selected backend.

    ``q [T, n_heads, head_dim]``, ``k``/``v [T, n_kv_heads, head_dim]`` (RoPE
    applied) -> ``o [T, n_heads, head_dim]``, model dtype, on the pool's device.
    Raises ``BackendUnavailable`` (or ``PluginError``) as the module doc says.
    """
    return get_registry().attention(q, k, v, layer_id, kv_cache, scale)


def available_backends() -> list[tuple[str, bool, str]]:
    """``(name, available, reason)`` of every backend, by priority; see ``BackendRegistry``."""
    return get_registry().available_backends()
