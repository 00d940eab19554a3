"""Attention backends: the ABC, the selection policy, torch_native and rotary.

Model code calls ``attention(...)`` and ``apply_rotary_emb(...)`` from here;
``attn_backend``/``ATTN_BACKEND``/``ASTR_BACKEND`` choose the backend, and the engine's
model runner resolves it once per step with ``bind_step`` (see
``astrai.extension.backend.policy``). ``astrai.extension.ops`` holds the raw
compiled-kernel wrappers, which never fall back. A backend plugin imports what it needs
from ``astrai.extension.api`` alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.lazy import lazy_attributes

if TYPE_CHECKING:
    from astrai.extension.backend.base import AttentionBackend
    from astrai.extension.backend.policy import attention, available_backends, bind_step, load_backends
    from astrai.extension.backend.rotary import RotaryEmbedding, apply_rotary_emb
    from astrai.extension.backend.selection import (
        ATTN_BACKEND,
        AUTOMATIC,
        BackendChoice,
        attn_backend,
        requested_backend,
    )

#: Public name -> the module that defines it (imported by ``__getattr__`` on first use), so that the
#: torch-free contracts (``astrai.extension.backend.selection``: ``BackendChoice``, ``ATTN_BACKEND``)
#: import without torch.
_LAZY = {
    "ATTN_BACKEND": "astrai.extension.backend.selection",
    "AUTOMATIC": "astrai.extension.backend.selection",
    "AttentionBackend": "astrai.extension.backend.base",
    "BackendChoice": "astrai.extension.backend.selection",
    "RotaryEmbedding": "astrai.extension.backend.rotary",
    "apply_rotary_emb": "astrai.extension.backend.rotary",
    "attention": "astrai.extension.backend.policy",
    "attn_backend": "astrai.extension.backend.selection",
    "available_backends": "astrai.extension.backend.policy",
    "bind_step": "astrai.extension.backend.policy",
    "load_backends": "astrai.extension.backend.policy",
    "requested_backend": "astrai.extension.backend.selection",
}

__all__ = [
    "ATTN_BACKEND",
    "AUTOMATIC",
    "AttentionBackend",
    "BackendChoice",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "attention",
    "attn_backend",
    "available_backends",
    "bind_step",
    "load_backends",
    "requested_backend",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
