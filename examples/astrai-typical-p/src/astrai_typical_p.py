"""Locally typical sampling for astrai, registered as entry point ``typical_p`` in ``astrai.sampling``.

A row keeps the tokens whose information content ``-log p`` is closest to the entropy of
its distribution, the fewest of them whose probability reaches ``typical_p`` (Meister et
al., 2023; transformers' ``TypicalLogitsWarper``). A request selects it by setting
``typical_p`` (``SamplingParams.extra``); configuration (``--sampling typical_p=0.9``) sets
it for every request.
"""

from __future__ import annotations

import torch

from astrai.errors import RequestRejected
from astrai.sampling import SamplingBatch, SamplingParams, SamplingStrategy

__all__ = ["TypicalPStrategy"]


class TypicalPStrategy(SamplingStrategy):
    """Keep the most typical tokens up to ``typical_p`` of the mass, per row; 1 leaves the row as it is.

    With ``log p = log_softmax(logits)`` and the entropy ``H = -sum(p log p)``, tokens are
    ranked by ``|-log p - H|``; a row keeps them in that order up to and including the
    first at which the cumulative probability reaches ``typical_p``, and the tokens tied
    with that one's score. That is transformers' ``TypicalLogitsWarper`` with
    ``min_tokens_to_keep=1``: the most typical token always stays. A ``-inf`` input has
    ``p = 0``, adds nothing to ``H`` (``p log p`` is taken as 0, never ``0 * -inf``) and
    ranks last. Rows with ``typical_p == 1`` are not written. In place; one sort of
    ``[B, V]``; vectorised over rows; no device synchronisation.
    """

    name = "typical_p"
    extra_params = ("typical_p",)

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)  # a finite number
        value = params.extra.get("typical_p", 1.0)
        if not 0.0 < value <= 1.0:
            raise RequestRejected(f"typical_p must be in (0, 1], got {value!r}")

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        mass = batch.extra_tensor("typical_p", 1.0).unsqueeze(1)  # [B, 1] f32; 1 = off
        logp = torch.log_softmax(logits, dim=-1)  # [B, V]; -inf where logits are -inf
        p = logp.exp()
        entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(dim=-1, keepdim=True)  # [B, 1]
        score = (logp.neg() - entropy).abs_()  # [B, V]; +inf for filtered tokens
        ranked, order = score.sort(dim=-1)
        reached = p.gather(1, order).cumsum_(dim=-1) < mass  # [B, V]: tokens before the cut
        last = reached.sum(dim=-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)  # [B, 1]
        cut = ranked.gather(1, last)  # [B, 1]: the score of the last kept token
        return logits.masked_fill_((score > cut) & (mass < 1.0), float("-inf"))
