"""What a caller asked for: ``attn_backend()``, ``ASTR_BACKEND``, ``requested_backend()`` (see ``policy``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from enum import Enum
from typing import NamedTuple

ENV_VAR = "ASTR_BACKEND"


class ATTN_BACKEND(str, Enum):  # noqa: N801 - the documented public name (mirrors sdpa_kernel's enum)
    """The backends astrai knows by name, in the order of their priority; the value is the
    entry-point name (``cpu``, ``cuda`` and ``flash`` come with their distributions)."""

    CUDA = "cuda"
    FLASH = "flash"
    CPU = "cpu"
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


class BackendChoice(NamedTuple):
    """The attention backend a request asked for: a ``name`` chosen explicitly (strict), with the
    ``source`` of the choice for error messages, or ``AUTOMATIC`` (``name`` None)."""

    name: str | None
    source: str


AUTOMATIC = BackendChoice(None, "automatic")


def requested_backend(default: str | None = None) -> BackendChoice:
    """The selection in force here: the ``attn_backend()`` context, else ``default`` (an engine's
    ``EngineConfig.attention_backend``), else ``ASTR_BACKEND``, else ``AUTOMATIC``."""
    name = _SELECTED.get()
    if name is not None:
        return BackendChoice(name, "attn_backend()")
    if default:
        return BackendChoice(default, "EngineConfig.attention_backend")
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return BackendChoice(env, f"{ENV_VAR}={env}")
    return AUTOMATIC
