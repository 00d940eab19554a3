"""Sampling: per-row strategies composed into a pipeline that draws the next token of a batch.

Built-in strategies are registered in the ``astrai.sampling`` entry-point group
(``temperature``, ``top_k``, ``top_p``, ``min_p``) next to third-party ones such as ``typical_p``.
"""

from __future__ import annotations

from astrai.sampling.base import BaseSamplingStrategy, SamplingStrategy
from astrai.sampling.min_p import MinPStrategy
from astrai.sampling.params import SamplingBatch, SamplingParams
from astrai.sampling.penalties import apply_penalties
from astrai.sampling.pipeline import SamplingPipeline, sample
from astrai.sampling.temperature import TemperatureStrategy
from astrai.sampling.top_k import TopKStrategy
from astrai.sampling.top_p import TopPStrategy

__all__ = [
    "SamplingStrategy",
    "BaseSamplingStrategy",
    "TemperatureStrategy",
    "TopKStrategy",
    "TopPStrategy",
    "MinPStrategy",
    "SamplingPipeline",
    "SamplingParams",
    "SamplingBatch",
    "sample",
    "apply_penalties",
]
