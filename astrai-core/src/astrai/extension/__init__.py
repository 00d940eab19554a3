"""Attention backends: the ABC, the selection policy, torch_native and rotary.

Model code calls ``attention(...)`` and ``apply_rotary_emb(...)`` from here;
``attn_backend``/``ATTN_BACKEND``/``ASTR_BACKEND`` choose the backend, and the engine's
model runner resolves it once per step with ``bind_step`` (see
``astrai.extension.backend.policy``). ``astrai.extension.ops`` holds the raw
compiled-kernel wrappers, which never fall back. A backend plugin imports what it needs
from ``astrai.extension.api`` alone.
"""

from __future__ import annotations

from astrai.extension.backend.base import AttentionBackend
from astrai.extension.backend.policy import (
    ATTN_BACKEND,
    AUTOMATIC,
    BackendChoice,
    attention,
    attn_backend,
    available_backends,
    bind_step,
    load_backends,
    requested_backend,
)
from astrai.extension.backend.rotary import RotaryEmbedding, apply_rotary_emb

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
