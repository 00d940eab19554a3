"""Top-k: keep each row's k highest logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from astrai.sampling.base import SamplingStrategy

if TYPE_CHECKING:
    from astrai.sampling.batch import SamplingBatch

__all__ = ["TopKStrategy"]


class TopKStrategy(SamplingStrategy):
    """Set every logit below the row's ``top_k``-th largest to ``-inf``.

    ``top_k == 0`` or ``top_k >= V`` keeps the row whole; greedy rows are untouched.
    Logits tied with the k-th value are kept. One ``torch.topk`` with the batch's
    largest k serves every row (each row reads its own k-th column). Skipped when no
    sampled row sets top_k. In place; no device synchronisation.
    """

    name = "top_k"

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[-1]
        k_max = min(batch.max_top_k, vocab)
        if k_max == 0:
            return logits
        k = batch.top_k
        active = (k > 0) & (k < vocab) & ~batch.greedy
        values = logits.topk(k_max, dim=-1, sorted=True).values  # [B, k_max], descending
        kth = values.gather(1, (k.clamp(1, k_max) - 1).unsqueeze(1))  # [B, 1]
        kth.masked_fill_(~active.unsqueeze(1), float("-inf"))  # inactive rows: nothing is below -inf
        return logits.masked_fill_(logits < kth, float("-inf"))
