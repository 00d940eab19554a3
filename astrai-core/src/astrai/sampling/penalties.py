"""Frequency/presence penalties and logit bias, as the OpenAI API defines them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from astrai.sampling.params import SamplingBatch

__all__ = ["apply_penalties"]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalise generated tokens and add each row's logit bias, in place.

    ``logits[i, t] -= frequency_penalty[i] * count[i, t] + presence_penalty[i] * (count[i, t] > 0)``
    where ``count`` counts token ``t`` in ``batch.output_ids[i]``; then
    ``logits[i, t] += logit_bias[i][t]``. Rows without penalties or bias are unchanged;
    each part is skipped when no row needs it. Ids outside ``[0, V)`` (padding, or a bias
    for a token the model does not have) are ignored.

    Args:
        logits: float32 ``[B, V]`` on ``batch.device``; modified in place.
        batch: the step's rows.

    Returns:
        ``logits``. No device synchronisation; the only dense work is one ``[B, V + 1]``
        buffer, the per-token counting is a scatter over the generated ids.
    """
    n_rows, vocab = logits.shape
    ids = batch.output_ids
    if batch.needs_penalties and ids is not None and ids.shape[1] > 0:
        # Padding and out-of-vocabulary ids land in a spill column V that is dropped.
        ids = ids.masked_fill((ids < 0) | (ids >= vocab), vocab)
        penalty = logits.new_zeros(n_rows, vocab + 1)
        # Presence: a plain scatter (every occurrence writes the same value); frequency: one
        # increment per occurrence, so the sum is presence + frequency * count.
        penalty.scatter_(1, ids, batch.presence_penalty.unsqueeze(1).expand(ids.shape))
        penalty.scatter_add_(1, ids, batch.frequency_penalty.unsqueeze(1).expand(ids.shape))
        logits.sub_(penalty[:, :vocab])
    if batch.has_logit_bias:
        known = batch.bias_tokens < vocab
        tokens = batch.bias_tokens.clamp(max=vocab - 1)
        logits.index_put_((batch.bias_rows, tokens), batch.bias_values * known, accumulate=True)
    return logits
