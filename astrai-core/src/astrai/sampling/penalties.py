"""Repetition, frequency and presence penalties, logit bias and banned tokens, applied to raw logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from astrai.sampling.batch import SamplingBatch

__all__ = ["apply_penalties"]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalise seen tokens, add each row's logit bias and ban tokens, in place.

    First the repetition penalty (Hugging Face / vLLM): a token seen in the prompt or the
    output (``batch.seen_ids[i]``) has its logit divided by ``repetition_penalty[i]`` when
    positive, multiplied when negative. Then OpenAI's
    ``logits[i, t] -= frequency_penalty[i] * count[i, t] + presence_penalty[i] * (count[i, t] > 0)``
    where ``count`` counts token ``t`` in ``batch.output_ids[i]``; then
    ``logits[i, t] += logit_bias[i][t]``; last, banned ``(row, token)`` pairs (EOS before
    ``min_tokens``) become ``-inf``. Rows without penalties, bias or bans are unchanged;
    each part is skipped when no row needs it. Ids outside ``[0, V)`` (padding, or a bias
    for a token the model does not have) are ignored.

    Args:
        logits: float32 ``[B, V]`` on ``batch.device``; modified in place.
        batch: the step's rows.

    Returns:
        ``logits``. No device synchronisation; the only dense work is one ``[B, V + 1]``
        buffer per part, the per-token counting is a scatter over the ids.
    """
    n_rows, vocab = logits.shape
    seen = batch.seen_ids
    if batch.needs_repetition and seen is not None and seen.shape[1] > 0:
        seen = seen.masked_fill((seen < 0) | (seen >= vocab), vocab)
        mask = logits.new_zeros(n_rows, vocab + 1, dtype=torch.bool).scatter_(1, seen, True)[:, :vocab]
        p = batch.repetition_penalty.unsqueeze(1)
        logits.copy_(torch.where(mask, torch.where(logits > 0, logits / p, logits * p), logits))
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
    if batch.has_bans:
        tokens = batch.ban_tokens.clamp(max=vocab - 1)  # ids are checked against the vocabulary at submit
        logits.index_put_((batch.ban_rows, tokens), logits.new_tensor(float("-inf")))
    return logits
