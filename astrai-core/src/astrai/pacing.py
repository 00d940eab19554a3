"""``StepPacer``: how many prompt tokens a step may prefill while other requests decode.

A step runs every decoding request's next token and the prefill chunks together, so a large chunk
holds back every stream's next token for as long as it takes: on 2 CPU cores, a 2,048-token chunk
beside 32 decoding requests made their inter-token p99 several times its p50. With
``EngineConfig.prefill_step_ratio`` set (``--prefill-step-ratio``), the policy (``astrai.batching``)
asks the pacer for each step's prefill budget: a step that decodes may take at most ``ratio`` times
as long as a step that only decodes, so the budget is the prompt tokens that fit in the remaining
``(ratio - 1)`` decode steps' time, at the measured cost of a prefill token, between ``min_tokens``
and ``max_prefill_tokens``. A step without decoding requests prefills the whole budget (nobody waits
on it), and so does any step before both costs are measured.

The costs are exponential moving averages of what the scheduler observes (``observe``): the seconds
of a decode-only step, and the seconds a step's prefill tokens added beyond that, per token.
Timing-dependent by nature: which tokens a step carries then depends on the machine's speed (a
row's result does not, up to the order of float sums where a prompt is cut differently).
"""

from __future__ import annotations

__all__ = ["StepPacer"]


class StepPacer:
    """Per-step prefill budgets from measured step times (see the module)."""

    #: weight of the newest observation in the moving averages
    ALPHA = 0.3

    def __init__(self, max_prefill_tokens: int, ratio: float | None, min_tokens: int = 64) -> None:
        if ratio is not None and not ratio > 1:
            raise ValueError(f"prefill_step_ratio must be > 1, got {ratio}")
        self.max_tokens, self.ratio = max_prefill_tokens, ratio
        self.min_tokens = min(min_tokens, max_prefill_tokens)
        self.decode_s: float | None = None  # a decode-only step's seconds
        self.token_s: float | None = None  # a prefill token's seconds beyond the decode rows

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A step that ran ``decode_rows`` one-token rows and ``prefill_tokens`` other tokens."""
        if self.ratio is None or seconds <= 0:
            return
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = self._blend(self.decode_s, seconds)
        elif decode_rows and self.decode_s is not None:
            extra = seconds - self.decode_s
            if extra > 0:
                self.token_s = self._blend(self.token_s, extra / prefill_tokens)
        elif not decode_rows:
            self.token_s = self._blend(self.token_s, seconds / prefill_tokens)

    def budget(self, decoding: bool) -> int:
        """The prompt tokens the next step may prefill; ``decoding``: requests decode in it."""
        if self.ratio is None or not decoding or self.decode_s is None or self.token_s is None:
            return self.max_tokens
        fits = int((self.ratio - 1) * self.decode_s / self.token_s)
        return max(self.min_tokens, min(self.max_tokens, fits))
