"""Temperature: divide each sampled row's logits by its temperature."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.sampling.base import SamplingStrategy

if TYPE_CHECKING:
    import torch

    from astrai.sampling.batch import SamplingBatch

__all__ = ["TemperatureStrategy"]


class TemperatureStrategy(SamplingStrategy):
    """``logits[i] /= temperature[i]``; temperature 0 rows (greedy) are left unchanged.

    Greedy rows divide by 1 rather than 0, so a mixed batch has no inf/nan and the greedy
    rows keep their exact logits. Skipped when every sampled row has temperature 1.
    In place; no device synchronisation.
    """

    name = "temperature"

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if not batch.needs_temperature:
            return logits
        t = batch.temperature
        return logits.div_(t.masked_fill(t == 0.0, 1.0).unsqueeze(1))
