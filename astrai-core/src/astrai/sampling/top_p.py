"""Top-p (nucleus): keep the smallest set of most likely tokens whose probability reaches top_p."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from astrai.extension.fused import kernel_for
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


BINS = 1024
"""Bins of :func:`_candidates`'s histogram: 1/32 nat wide below a row's largest logit, the last open."""


def _candidates(rows: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """How many of its largest logits each of ``rows`` ``[R, V]`` needs for its nucleus, int64 ``[R]``:
    one pass that sums each row's probabilities (``exp(x - lse)``) in bins of the logits' distance
    below the row's largest, then the tokens of the bins down to one past the bin where the mass
    reaches ``top_p``."""
    top = rows.amax(dim=-1, keepdim=True)
    at = (top - rows).mul_(BINS / 32).clamp_(max=BINS - 1).long()  # -inf logits: the last bin
    mass = torch.zeros(rows.shape[0], BINS, dtype=torch.float64, device=rows.device)
    mass.scatter_add_(1, at, (rows - lse).exp_().double())
    count = torch.zeros(rows.shape[0], BINS, dtype=torch.int64, device=rows.device)
    count.scatter_add_(1, at, torch.ones_like(at))
    reach = (mass.cumsum(dim=-1) < top_p.double().unsqueeze(1)).sum(dim=-1, keepdim=True)
    return count.cumsum(dim=-1).gather(1, (reach + 1).clamp_(max=BINS - 1)).squeeze(1)


def _wide_cutoff(rows: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """:func:`_cutoff`'s ``[R, 1]`` logit for rows whose nucleus is wider than the first candidates.

    Rows go in groups by the power of two at or above the candidates :func:`_candidates` gives them
    (at most a few dozen groups, whatever the rows); each group takes that many of its largest
    logits where that is less than the vocabulary, and keeps the cut-off where they reach ``top_p``
    by ``_cutoff``'s own sums: the very cut-off a full sort gives (the same prefix of the same sums).
    The rest, and a group's rows whose candidates fall short, are sorted in full. Synchronises the
    device once a group."""
    vocab = rows.shape[-1]
    cut = torch.empty_like(lse)
    sizes = _candidates(rows, lse, top_p).clamp_(min=1)
    groups = torch.ceil(torch.log2(sizes.double())).long()
    for group in groups.unique().tolist():  # device sync
        ids = (groups == group).nonzero().squeeze(1)
        part, part_lse, part_p = (
            rows.index_select(0, ids),
            lse.index_select(0, ids),
            top_p.index_select(0, ids),
        )
        m = 1 << group
        if m < vocab:
            got, covered = _cutoff(part.topk(m, dim=-1, sorted=True).values, part_lse, part_p)
            short = (~covered).nonzero().squeeze(1)  # device sync
            if short.numel():
                desc = part.index_select(0, short).sort(dim=-1, descending=True).values
                got.index_copy_(
                    0, short, _cutoff(desc, part_lse.index_select(0, short), part_p.index_select(0, short))[0]
                )
        else:
            got = _cutoff(part.sort(dim=-1, descending=True).values, part_lse, part_p)[0]
        cut.index_copy_(0, ids, got)
    return cut


class TopPStrategy(SamplingStrategy):
    """Keep, per row, the most likely tokens until their probability reaches ``top_p``.

    Probabilities are ``softmax`` of the incoming (temperature-scaled, top-k filtered)
    logits in float32. The top token is always kept; tokens tied with the last kept one
    are kept too. ``top_p == 1`` rows and greedy rows are untouched; skipped when no
    sampled row sets top_p.

    Cost: a ``topk`` of m candidates and a logsumexp instead of a full sort. When every
    top-p row also sets top_k, m is their largest top_k and, as in the pipeline's order,
    top-k is assumed to have run already: the m candidates then hold every finite logit,
    so the logsumexp runs over them alone. Otherwise m is :data:`CANDIDATES`; rows whose
    nucleus is wider take the largest logits that a histogram of their probabilities says their
    nuclei need (:func:`_candidates`), a full sort only where those fall short (a flat row):
    on Gemma 3's 262,144 logits, ~4 ms against ~21 ms a row for a sort. Finding them synchronises
    the device once or twice. Where a backend lends the ``top_p`` kernel (the CPU plugin's
    ``csrc/top_p.cpp``: a few reads of the row and a sort of a few thousand tokens at most, ~0.35 ms
    a row of Gemma's), rows not bounded by top-k run on it instead; its sums are in double, so its
    cut-off is PyTorch's but where a token's mass ahead is within a float32 rounding of top_p.
    """

    name = "top_p"

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if not batch.needs_top_p:
            return logits
        vocab = logits.shape[-1]
        top_p = batch.top_p
        active = (top_p < 1.0) & ~batch.greedy
        bounded = 0 < batch.top_p_k_bound <= vocab
        kernel = None if bounded else kernel_for("top_p", logits)
        if (
            kernel is not None
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(-1) == 1
        ):
            return kernel(logits, top_p.masked_fill(~active, 1.0))  # in place, no sort (astrai_cpu::top_p)
        m = batch.top_p_k_bound if bounded else min(CANDIDATES, vocab)
        desc = logits.topk(m, dim=-1, sorted=True).values
        # Bounded: top-k already left at most m finite logits, so the candidates hold all the mass.
        lse = torch.logsumexp(desc if bounded else logits, dim=-1, keepdim=True)
        cut, covered = _cutoff(desc, lse, top_p)
        if m < vocab and not bounded:
            wide = (active & ~covered).nonzero().squeeze(1)  # device sync
            if wide.numel():
                cut.index_copy_(
                    0,
                    wide,
                    _wide_cutoff(
                        logits.index_select(0, wide), lse.index_select(0, wide), top_p.index_select(0, wide)
                    ),
                )
        cut.masked_fill_(~active.unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < cut, float("-inf"))
