"""Top-p (nucleus): keep the smallest set of most likely tokens whose probability reaches top_p."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from astrai.sampling.base import SamplingStrategy

if TYPE_CHECKING:
    from astrai.sampling.batch import SamplingBatch

__all__ = ["TopPStrategy"]

CANDIDATES = 256
"""Tokens examined before falling back to a full sort, when top-k does not bound the row."""


def _cutoff(desc: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nucleus cut-off of rows whose logits ``desc`` ``[R, m]`` are sorted descending.

    ``lse`` ``[R, 1]`` is the logsumexp over the full vocabulary, so probabilities are the
    true ones even when ``desc`` holds only the top m logits. Returns the ``[R, 1]``
    logit of the last kept token and ``[R]`` bool: whether the top m reach ``top_p``
    (otherwise the cut-off lies past them and the row needs every logit).
    """
    probs = (desc - lse).exp_()
    cum = probs.cumsum(dim=-1)
    before = F.pad(cum[:, :-1], (1, 0))  # mass strictly ahead of each token; 0 for the top one
    n_keep = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    return desc.gather(1, n_keep - 1), cum[:, -1] >= top_p


class TopPStrategy(SamplingStrategy):
    """Keep, per row, the most likely tokens until their probability reaches ``top_p``.

    Probabilities are ``softmax`` of the incoming (temperature-scaled, top-k filtered)
    logits in float32. The top token is always kept; tokens tied with the last kept one
    are kept too. ``top_p == 1`` rows and greedy rows are untouched; skipped when no
    sampled row sets top_p.

    Cost: a ``topk`` of m candidates and a logsumexp instead of a full sort. When every
    top-p row also sets top_k, m is their largest top_k and, as in the pipeline's order,
    top-k is assumed to have run already: the m candidates then hold every finite logit,
    so the logsumexp runs over them alone. Otherwise m is :data:`CANDIDATES`, and rows
    whose nucleus is wider are sorted in full; finding them synchronises the device once.
    """

    name = "top_p"

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if not batch.needs_top_p:
            return logits
        vocab = logits.shape[-1]
        top_p = batch.top_p
        active = (top_p < 1.0) & ~batch.greedy
        bounded = 0 < batch.top_p_k_bound <= vocab
        m = batch.top_p_k_bound if bounded else min(CANDIDATES, vocab)
        desc = logits.topk(m, dim=-1, sorted=True).values
        # Bounded: top-k already left at most m finite logits, so the candidates hold all the mass.
        lse = torch.logsumexp(desc if bounded else logits, dim=-1, keepdim=True)
        cut, covered = _cutoff(desc, lse, top_p)
        if m < vocab and not bounded:
            wide = (active & ~covered).nonzero().squeeze(1)  # device sync
            if wide.numel():
                desc = logits.index_select(0, wide).sort(dim=-1, descending=True).values
                cut.index_copy_(
                    0, wide, _cutoff(desc, lse.index_select(0, wide), top_p.index_select(0, wide))[0]
                )
        cut.masked_fill_(~active.unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < cut, float("-inf"))
