"""N-gram (prompt-lookup) speculative decoding: the proposer and when a step is worth verifying.

``NgramProposer.propose`` drafts up to ``k`` tokens for a decoding request by matching the last
``n`` tokens of its prompt and output (``n`` from ``n_max`` down to ``n_min``) against their most
recent earlier occurrence and copying what followed it (vLLM's ``NgramProposer``, SGLang's n-gram
speculation, llama.cpp's prompt lookup). The lookup is a per-request dictionary from each n-gram
to the position after its last occurrence, extended by the tokens added since the previous call:
O(``n_max - n_min + 1``) dictionary operations per generated token, never a scan of the history.

The batching policy (``astrai.batching``) makes a decode row with a draft of ``d`` tokens a row
of ``1 + d`` query tokens in the same ragged step; the runner (``astrai.runner``) verifies the
drafts against the model's greedy tokens and ``BatchPolicy.update`` rolls the rejected ones back.
Only requests whose next token is the argmax of the raw logits (``SamplingParams.plain_greedy``,
without log-probs) speculate: for them the output is the one decoding without speculation gives.

A draft costs: a verify step computes ``1 + d`` rows for such a request. ``worth`` keeps drafts
to steps where the tokens they are expected to add (each request's recent acceptance rate times
its draft length) pay for that; a request whose drafts keep being rejected drafts less and less
often (``observe``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: A step's cost that does not grow with its tokens (streaming the weights through the cores),
#: in tokens' worth of the part that does: a step of T tokens costs about ``WEIGHT_TOKENS + T``.
#: Measured on 2 AVX512-BF16 cores with SmolLM2-135M in bf16, verify rows on the whole-step decode
#: kernel (``benchmarks/spec_bench.py``'s machine): batch 1: 12.2 ms plain, 13.4 ms with 4 drafts,
#: 16.2 ms with 8; batch 8: 21.7 ms plain, 49.6 ms with 4 drafts per row.
WEIGHT_TOKENS = 10.0
#: Steps a request waits before it drafts again after a draft that was wholly rejected: doubles
#: with each such draft, up to this many, and is back to 0 after a draft with an accepted token.
MAX_COOLDOWN = 32
#: The most drafts per request and step (a verify row attends token by token on the CPU backend:
#: longer drafts would cost more than they are likely to save).
MAX_SPECULATIVE_TOKENS = 15


@dataclass
class NgramState:
    """One request's lookup table and its acceptance history (``Request.spec``)."""

    table: dict[tuple[int, ...], int] = field(
        default_factory=dict
    )  # n-gram -> position after its last occurrence
    indexed: int = 0  # tokens[:indexed] are in ``table`` (n-grams ending before indexed - 1)
    rate: float = 0.7  # running mean of the share of a draft that was accepted (a hopeful prior)
    cooldown: int = 0  # steps left without a draft
    backoff: int = 0  # the next cooldown after a rejected draft


class NgramProposer:
    """Drafts of up to ``k`` tokens from the longest matching n-gram, ``n_max`` down to ``n_min``."""

    def __init__(self, k: int = 4, n_min: int = 2, n_max: int = 4) -> None:
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min {n_min}, ngram_max {n_max}")
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, state: NgramState, tokens: Sequence[int], limit: int) -> list[int]:
        """At most ``min(k, limit)`` tokens that followed the last earlier occurrence of the longest
        suffix n-gram of ``tokens`` (empty: none found, or the request is cooling down)."""
        if state.cooldown > 0:
            state.cooldown -= 1
            return []
        self._index(state, tokens)
        n_tokens, table = len(tokens), state.table
        for n in range(min(self.n_max, n_tokens - 1), self.n_min - 1, -1):
            at = table.get(tuple(tokens[n_tokens - n :]))
            if at is not None:
                return list(tokens[at : at + min(self.k, limit)])
        return []

    def _index(self, state: NgramState, tokens: Sequence[int]) -> None:
        """Add the n-grams that end before the last token (each maps to the position after it)."""
        table, lo, hi = state.table, self.n_min, self.n_max
        for end in range(
            max(state.indexed, lo), len(tokens)
        ):  # an n-gram tokens[end - n : end], then tokens[end]
            for n in range(lo, min(hi, end) + 1):
                table[tuple(tokens[end - n : end])] = end
        state.indexed = max(state.indexed, len(tokens))

    @staticmethod
    def observe(state: NgramState, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` accepted."""
        state.rate = 0.5 * state.rate + 0.5 * accepted / drafted
        if accepted:
            state.backoff = 0
        else:
            state.cooldown = state.backoff
            state.backoff = min(max(1, 2 * state.backoff), MAX_COOLDOWN)

    @staticmethod
    def worth(rows: int, drafts: Sequence[tuple[NgramState, int]], ragged: bool = False) -> bool:
        """Whether a step of ``rows`` decode rows gains from verifying ``drafts`` (each request's
        state and draft length): the tokens they are expected to add, as a share of the ``rows``
        tokens the step gives anyway, must exceed the share the drafted tokens add to the step's
        cost (``WEIGHT_TOKENS + rows``; ``ragged``: the step has prefill rows too, which makes it
        costlier, so the same drafts add a smaller share: the estimate without them is kept)."""
        expected = sum(state.rate * d for state, d in drafts)
        drafted = sum(d for _, d in drafts)
        return expected * (WEIGHT_TOKENS + rows) > drafted * rows
