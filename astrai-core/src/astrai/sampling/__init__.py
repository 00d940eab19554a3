"""Sampling: per-row strategies composed into a pipeline that draws the next token of a batch.

Built-in strategies are registered in the ``astrai.sampling`` entry-point group
(``temperature``, ``top_k``, ``top_p``, ``min_p``) next to third-party ones such as ``typical_p``.
The names below load on first use, so ``from astrai.sampling.params import SamplingParams`` (a
request's parameters, a contract) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.lazy import lazy_attributes

if TYPE_CHECKING:
    from astrai.sampling.base import BaseSamplingStrategy, SamplingStrategy
    from astrai.sampling.batch import SamplingBatch
    from astrai.sampling.min_p import MinPStrategy
    from astrai.sampling.params import SamplingParams
    from astrai.sampling.penalties import apply_penalties
    from astrai.sampling.pipeline import SamplingPipeline, sample
    from astrai.sampling.temperature import TemperatureStrategy
    from astrai.sampling.top_k import TopKStrategy
    from astrai.sampling.top_p import TopPStrategy

#: Public name -> the module that defines it (imported by ``__getattr__`` on first use).
_LAZY = {
    "SamplingStrategy": "astrai.sampling.base",
    "BaseSamplingStrategy": "astrai.sampling.base",
    "TemperatureStrategy": "astrai.sampling.temperature",
    "TopKStrategy": "astrai.sampling.top_k",
    "TopPStrategy": "astrai.sampling.top_p",
    "MinPStrategy": "astrai.sampling.min_p",
    "SamplingPipeline": "astrai.sampling.pipeline",
    "SamplingParams": "astrai.sampling.params",
    "SamplingBatch": "astrai.sampling.batch",
    "sample": "astrai.sampling.pipeline",
    "apply_penalties": "astrai.sampling.penalties",
}

__all__ = [
    "BaseSamplingStrategy",
    "MinPStrategy",
    "SamplingBatch",
    "SamplingParams",
    "SamplingPipeline",
    "SamplingStrategy",
    "TemperatureStrategy",
    "TopKStrategy",
    "TopPStrategy",
    "apply_penalties",
    "sample",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
