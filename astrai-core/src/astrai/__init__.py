"""astrai: an LLM inference engine built as a layered plugin framework.

The engine API is importable from here::

    from astrai import InferenceEngine, SamplingParams

    with InferenceEngine.from_model() as engine:      # the default model
        print(engine.generate("Once upon a time", max_tokens=32))

``InferenceEngine``, ``EngineConfig``, ``SamplingParams`` and ``GenerateResult`` load on first
use, so ``import astrai`` stays cheap (no torch). ``astrai.hookimpl`` marks a hook plugin's
implementations (see ``astrai.hookspecs``); the entry-point groups are named in ``astrai.plugins``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.hookspecs import hookimpl
from astrai.lazy import lazy_attributes

if TYPE_CHECKING:
    from astrai.config import EngineConfig
    from astrai.engine import InferenceEngine
    from astrai.result import GenerateResult
    from astrai.sampling.params import SamplingParams

__version__ = "0.1.0"

#: Public name -> the module that defines it (imported by ``__getattr__`` on first use).
_LAZY = {
    "InferenceEngine": "astrai.engine",
    "EngineConfig": "astrai.config",
    "GenerateResult": "astrai.result",
    "SamplingParams": "astrai.sampling.params",
}

__all__ = ["EngineConfig", "GenerateResult", "InferenceEngine", "SamplingParams", "__version__", "hookimpl"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
