"""Entry-point groups of astrai, and the loaders that read them.

This is the only module that spells a group name.
"""

from __future__ import annotations

ATTENTION_BACKENDS = "astrai.attention_backends"
PROTOCOLS = "astrai.protocols"
SAMPLING = "astrai.sampling"
MODELS = "astrai.models"
HOOKS = "astrai.plugins"
