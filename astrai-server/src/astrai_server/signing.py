"""Opaque signatures of text the server hands out and must recognise when a client sends it back.

Anthropic's thinking blocks carry a ``signature`` so that a later turn can send the thinking back and
the server can tell that it wrote it, unmodified. astrai's is an HMAC-SHA256 of the text under the
builder's ``signing_key`` (the ``signing_key`` setting, else random per process: a restart, or another
replica with a key of its own, then refuses the signatures made before), with a purpose string so that
a signature made for one use is no signature for another. Base64, as Anthropic's look.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

__all__ = ["sign", "verify"]


def _mac(key: bytes, purpose: str, text: str) -> bytes:
    return hmac.new(key, f"astrai/1\0{purpose}\0{text}".encode(), hashlib.sha256).digest()


def sign(key: bytes, purpose: str, text: str) -> str:
    """The signature of ``text`` for ``purpose`` under ``key``: 44 characters of base64."""
    return base64.b64encode(_mac(key, purpose, text)).decode("ascii")


def verify(key: bytes, purpose: str, text: str, signature: str) -> bool:
    """Whether ``signature`` is ``sign(key, purpose, text)`` (compared in constant time)."""
    return hmac.compare_digest(sign(key, purpose, text).encode("ascii"), signature.encode("utf-8", "replace"))
