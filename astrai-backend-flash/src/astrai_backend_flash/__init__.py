"""The flash-attn attention backend of astrai: entry point ``flash`` in ``astrai.attention_backends``.

``FlashAttnBackend`` (``backend.py``) runs flash-attn 2's paged kernels over astrai's KV
pool; ``plan.py`` maps the pool's layout to flash-attn's block tables once per step;
``kernels.py`` finds the flash-attn functions and says why they cannot run here.
"""

from __future__ import annotations

from astrai_backend_flash.backend import FlashAttnBackend

__all__ = ["FlashAttnBackend"]
