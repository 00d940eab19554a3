"""The ``AttentionBackend`` ABC: cache I/O plus attention for one layer of one step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from astrai.plugins import check_class

if TYPE_CHECKING:
    import torch

    from astrai.kvcache.cache import KVCache


class AttentionBackend(ABC):
    """One way to write new K/V into the pool and attend over it.

    Implementations are registered in the ``astrai.attention_backends`` entry-point
    group; the entry-point name is the backend's ``name`` (what ``ASTR_BACKEND``
    takes). A backend module must import cheaply: heavy imports (compiled
    kernels, flash_attn) happen inside methods.
    """

    #: Entry-point name, e.g. ``"torch_native"``.
    name: str = ""
    #: Lower runs first in automatic selection (cuda 10, flash 20, torch_native 100).
    priority: int = 100

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether this backend can run in this process at all.

        Returns ``(ok, reason)``; ``reason`` says why not (missing package,
        no CUDA device, kernels not built) and is empty when ``ok``. Must not
        raise and must not allocate device memory.
        """

    @classmethod  # noqa: B027 - an optional hook: nothing by default
    def install(cls) -> None:
        """Put this backend's process-wide kernels in place (``astrai.extension.fused`` ops, rotary).

        Called once per process by the registry when it loads the backend for use (its first
        instance), after ``is_available()`` said yes; never by a capability check. Default: nothing.
        """

    @abstractmethod
    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """Capability check for one step.

        ``q`` carries the step's query layout: its dtype, device and ``[n_heads, head_dim]``
        (the engine passes a zero-row tensor; values are never read). Returns ``None`` when
        this backend can run the step, else a short reason (``"dtype torch.float32 not
        supported"``, ``"head_dim 80 not supported"``, ``"device cpu"``). Host facts only:
        must not synchronise the device.
        """

    def prepare(self, q: torch.Tensor, kv_cache: KVCache) -> None:  # noqa: B027 - optional hook
        """Derive what this backend reads in every layer, once per step, before the first layer.

        ``q`` as in ``supports``. Stash it in ``kv_cache.plan[self.name]``, or fill the
        ``KVCache`` fields only this backend reads (they are ``None`` until then). Runs only
        for the steps this backend runs; a ``forward`` called without it (a direct call)
        must prepare for itself. Default: nothing.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend.

        Shapes: ``q [T, n_heads, head_dim]``, ``k``/``v [T, n_kv_heads, head_dim]``
        (RoPE already applied to ``q`` and ``k``), in the model dtype, on the
        pool's device; ``T = kv_cache.num_tokens``. Writes ``k``/``v`` into
        ``kv_cache.k_buffer[layer_id, kv_cache.out_cache_loc]`` (and ``v_buffer``),
        then returns ``o [T, n_heads, head_dim]``: for each request, causal
        attention of its new tokens over its ``seq_len`` cached-plus-new tokens
        (a new token at position ``p`` sees positions ``0..p``). ``n_heads`` is a
        multiple of ``n_kv_heads`` (grouped-query attention). Reads what ``prepare`` made;
        must not mutate anything but the pool's new slots and its own ``plan`` entry.
        """


ATTENTION_BACKENDS = "astrai.attention_backends"
"""The entry-point group of ``AttentionBackend`` subclasses; the name is what ``ASTR_BACKEND`` takes."""


def check_backend_class(name: str, plugin: object, origin: str) -> type[AttentionBackend]:
    """Validate an ``astrai.attention_backends`` plugin: an ``AttentionBackend`` named ``name``.

    ``origin`` names the entry point and distribution for the message. Raises PluginError.
    """
    return check_class(AttentionBackend, name, plugin, origin)
