"""Min-p: keep the tokens at least ``min_p`` times as likely as the row's most likely one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astrai.sampling.base import SamplingStrategy

if TYPE_CHECKING:
    import torch

    from astrai.sampling.batch import SamplingBatch

__all__ = ["MinPStrategy"]


class MinPStrategy(SamplingStrategy):
    """``p[i] < min_p * max(p)`` -> ``-inf`` per sampled row; ``min_p == 0`` and greedy rows keep all.

    Since ``p[i] / max(p) = exp(logit[i] - max(logit))``, the test runs on the incoming
    (temperature-scaled, top-k/top-p filtered) logits without a softmax, as Hugging Face's
    ``MinPLogitsWarper`` and vLLM do after temperature. Ties with the top token are kept, so a
    row keeps at least one token. Skipped when no sampled row sets min_p. In place; no sync.
    """

    name = "min_p"

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if not batch.needs_min_p:
            return logits
        min_p = batch.min_p.masked_fill(batch.greedy, 0.0)  # log(0) = -inf: the row keeps everything
        floor = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
        return logits.masked_fill_(logits < floor, float("-inf"))
