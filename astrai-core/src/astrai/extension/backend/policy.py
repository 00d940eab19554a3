"""Attention backend selection: ``attn_backend()``, ``ASTR_BACKEND``, ``bind_step()``, ``attention()``.

Who chooses, strongest first:

1. ``attn_backend(...)`` context (a ``contextvars.ContextVar``: per thread and
   per asyncio task; a new thread starts with no selection);
2. an engine's ``EngineConfig.attention_backend`` (``astrai serve --attention-backend``);
3. the ``ASTR_BACKEND`` environment variable;
4. automatic: the first backend by ``priority`` (cuda 10, flash 20, cpu 50,
   torch_native 100) that is available and whose ``supports()`` returns None.

Choices 1-3 are strict: if the named backend is missing, broken, unavailable or
rejects the step, ``BackendUnavailable`` (``PluginError`` for a broken plugin) is
raised; nothing switches silently.

The choice is read once per request, where it is submitted (``requested_backend``:
the engine keeps it with the request, so the scheduler thread honours the caller's
context), and resolved to a backend once per step (``bind_step``: the backend's
``prepare`` runs, and ``KVCache.backend`` carries it to every layer). ``attention()``
reads nothing but the step's ``KVCache``.

Over 300 lines because the registry is one class: discovery, availability, the strict and the
automatic choice, and the start-up check of what a pool or model needs (``check_features``) share
its state and are read together.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from astrai.errors import BackendUnavailable, PluginError
from astrai.extension.backend.base import ATTENTION_BACKENDS, AttentionBackend, check_backend_class
from astrai.extension.backend.layers import call_forward, lacks, layer_view
from astrai.extension.backend.selection import (  # noqa: F401 - the policy's public names
    ATTN_BACKEND,
    AUTOMATIC,
    ENV_VAR,
    BackendChoice,
    attn_backend,
    requested_backend,
)
from astrai.extension.kernels import KernelTable
from astrai.plugins import LoadedPlugins, PluginFailure, load_plugins

if TYPE_CHECKING:
    import torch

    from astrai.kvcache.cache import KVCache

logger = logging.getLogger(__name__)


def load_attention_backends() -> LoadedPlugins:
    """Every installed ``astrai.attention_backends`` class (validated; failures kept)."""
    return load_plugins(ATTENTION_BACKENDS, check_backend_class)


class BackendRegistry:
    """The attention backends of a process: classes, load failures, one instance each, and the
    fused kernels the instances lend the model (``kernels``, a ``KernelTable``).

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
        #: The fused kernels of the backends loaded for use (``AttentionBackend.kernels``).
        self.kernels = KernelTable()

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
        """The one instance of a loaded backend (which must be available): the backend loaded for
        use, whose fused kernels (``AttentionBackend.kernels``) then join ``kernels``."""
        with self._lock:
            if name not in self._instances:
                backend = self._classes[name]()
                self.kernels.add(backend)
                self._instances[name] = backend
            return self._instances[name]

    def load(self) -> list[tuple[str, bool, str]]:
        """Load every available backend for use (their fused kernels in ``kernels``); returns
        ``available_backends()``.

        An engine calls this when it starts, so that a plugin which builds kernels on first
        use does so before the first request, and its fused kernels serve the first step.
        """
        rows = self.available_backends()
        for name in self._order:
            if self.availability(name)[0]:
                self.instance(name)
        return rows

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

    def check_choice(self, choice: BackendChoice) -> None:
        """Raise ``BackendUnavailable`` with ``resolve``'s reason when an explicit ``choice`` cannot
        be used on this machine (misspelled, not installed, broken, unavailable); nothing for
        automatic selection. Loads nothing."""
        if choice.name is not None:
            self._usable(choice.name, choice.source)

    def _explicit(self, name: str, source: str) -> AttentionBackend:
        self._usable(name, source)
        return self.instance(name)

    def _usable(self, name: str, source: str) -> None:
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

    def resolve(self, choice: BackendChoice, q: torch.Tensor, kv_cache: KVCache) -> AttentionBackend:
        """The backend that runs this step for ``choice``; raises ``BackendUnavailable`` (see module doc).

        ``q`` and ``kv_cache`` as ``AttentionBackend.supports`` takes them.
        """
        if choice.name is not None:
            backend = self._explicit(choice.name, choice.source)
            reason = lacks(backend, kv_cache) or backend.supports(q, kv_cache)
            if reason is not None:
                raise BackendUnavailable(
                    f"attention backend {choice.name!r} (from {choice.source}) cannot run this call: {reason}"
                )
            return backend
        reasons = []
        for backend in self._automatic():
            reason = lacks(backend, kv_cache) or backend.supports(q, kv_cache)
            if reason is None:
                return backend
            reasons.append(f"{backend.name}: {reason}")
        raise BackendUnavailable(
            "no attention backend can run this call (" + "; ".join(reasons or ["none installed"]) + ")"
        )

    def check_features(self, choice: BackendChoice, features: frozenset[str], what: str) -> None:
        """Raise ``BackendUnavailable`` when ``choice`` cannot serve a pool or model that needs
        ``features`` (``AttentionBackend.features``; ``what`` names the need): the backend chosen
        lacks one, or (automatic) no available backend has them all. The message names the
        backends that have them."""
        able = [n for n in self._order if features <= self._classes[n].features and self.availability(n)[0]]
        names = ", ".join(able) or "none installed here"
        if choice.name is not None:
            cls = self._classes.get(choice.name)
            if cls is not None and not features <= cls.features:
                raise BackendUnavailable(
                    f"attention backend {choice.name!r} (from {choice.source}) cannot serve {what}; "
                    f"backends that can: {names}"
                )
        elif not able:
            raise BackendUnavailable(f"no available attention backend can serve {what}")

    def select(self, q: torch.Tensor, kv_cache: KVCache) -> AttentionBackend:
        """``resolve(requested_backend(), q, kv_cache)``: the choice in force in this context."""
        return self.resolve(requested_backend(), q, kv_cache)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """``select(q, kv_cache).forward(...)``; see ``AttentionBackend.forward``."""
        backend = self.select(q, kv_cache)
        layer_id, kv_cache = layer_view(backend, q, layer_id, kv_cache)
        return call_forward(backend, q, k, v, layer_id, kv_cache, scale, window, softcap)


_registry: BackendRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> BackendRegistry:
    """The process-wide registry, discovered on first use (one discovery per process)."""
    global _registry
    registry = _registry  # lock-free fast path: this runs for every step
    if registry is not None:
        return registry
    with _registry_lock:
        if _registry is None:
            _registry = BackendRegistry.discover()
        return _registry


def current_registry() -> BackendRegistry | None:
    """The process-wide registry if one was discovered, else ``None``; never discovers (a fused
    op's kernel lookup, ``astrai.extension.fused.kernel_for``: no registry, no loaded backend)."""
    return _registry


def reset_registry() -> None:
    """Forget the discovered registry, its backends and their kernels: the next call discovers
    again (tests, after installs)."""
    global _registry
    with _registry_lock:
        _registry = None


def bind_step(kv_cache: KVCache, q: torch.Tensor, choice: BackendChoice | None = None) -> AttentionBackend:
    """Resolve the step's attention backend once, let it ``prepare``, and keep it in ``kv_cache.backend``.

    ``choice`` defaults to ``requested_backend()`` (read here); ``q`` carries the query layout
    (see ``AttentionBackend.supports``). Raises ``BackendUnavailable`` (or ``PluginError``).
    """
    backend = get_registry().resolve(requested_backend() if choice is None else choice, q, kv_cache)
    backend.prepare(q, kv_cache)
    kv_cache.backend = backend
    return backend


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    kv_cache: KVCache,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write this step's K/V for ``layer_id`` and attend, on the step's backend (``kv_cache.backend``).

    ``q [T, n_heads, head_dim]``, ``k``/``v [T, n_kv_heads, head_dim]`` (RoPE
    applied) -> ``o [T, n_heads, head_dim]``, model dtype, on the pool's device. ``window`` and
    ``softcap``: the layer's sliding window and score soft-cap (0: none; see
    ``AttentionBackend.forward``). A step that nobody bound (a direct call, outside the engine) is
    bound here, on its first layer, for the selection in force (``bind_step``); raises as the
    module doc says.
    """
    backend = kv_cache.backend
    if backend is None:
        backend = bind_step(kv_cache, q)
    layer_id, kv_cache = layer_view(backend, q, layer_id, kv_cache)
    return call_forward(backend, q, k, v, layer_id, kv_cache, scale, window, softcap)


def check_features(features: frozenset[str], what: str, default: str | None = None) -> None:
    """``BackendRegistry.check_features`` for the selection in force (``requested_backend(default)``)."""
    if features:
        get_registry().check_features(requested_backend(default), frozenset(features), what)


def available_backends() -> list[tuple[str, bool, str]]:
    """``(name, available, reason)`` of every backend, by priority; see ``BackendRegistry``."""
    return get_registry().available_backends()


def load_backends() -> list[tuple[str, bool, str]]:
    """Load every available backend of the process registry (``BackendRegistry.load``)."""
    return get_registry().load()
