"""Attention backends: the ABC, the selection policy, torch_native and rotary.

Model code calls ``attention(...)`` and ``apply_rotary_emb(...)`` from here;
``attn_backend``/``ATTN_BACKEND``/``ASTR_BACKEND`` choose the backend (see
``astrai.extension.backend.policy``). ``astrai.extension.ops`` holds the raw
compiled-kernel wrappers, which never fall back.
"""

from __future__ import annotations

from astrai.extension.backend.base import AttentionBackend
from astrai.extension.backend.policy import ATTN_BACKEND, attention, attn_backend, available_backends
from astrai.extension.backend.rotary import RotaryEmbedding, apply_rotary_emb

__all__ = [
    "ATTN_BACKEND",
    "AttentionBackend",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "attention",
    "attn_backend",
    "available_backends",
]
