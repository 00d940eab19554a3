"""Log-probabilities of the model's own distribution, for the rows of a step that ask for them.

A token's log-prob is ``log_softmax`` of the raw logits (float32, before penalties, temperature
or any filter), as vLLM returns by default; ``top`` holds the k most likely tokens of the same
distribution. One ``log_softmax`` and one ``topk`` serve every row that asked, and the results
reach the host in one copy, so a step in which no row asks pays nothing. ``TokenLogprob`` is a
contract of the step's result: this module imports torch only when ``token_logprobs`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_LOGPROBS", "TokenLogprob", "token_logprobs"]

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` bound)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-prob and the ``k`` most likely tokens at its position (descending)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: Sequence[int]) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``token_ids[i]`` under row ``i`` of ``logits``, with row ``i``'s ``top_k[i]`` best.

    Args:
        logits: ``[R, V]`` raw logits of the rows that asked (any float dtype; computed in float32).
        token_ids: int64 ``[R]`` on the same device: the token each row scores.
        top_k: per row, how many alternatives to return (0..V).

    One host copy for every row (a device sync, like reading the sampled ids).
    """
    if not len(top_k):
        return []
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, token_ids.view(-1, 1))
        k = max(top_k)
        if k:
            top = lp.topk(k, dim=-1)
            values = torch.cat([chosen, top.values], dim=1).tolist()
            ids = top.indices.tolist()
        else:
            values, ids = chosen.tolist(), [[]] * len(top_k)
    return [
        TokenLogprob(tok, row[0], tuple(zip(row_ids[:n], row[1 : n + 1], strict=True)))
        for tok, row, row_ids, n in zip(token_ids.tolist(), values, ids, top_k, strict=True)
    ]
