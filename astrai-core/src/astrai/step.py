"""One engine step's data, both ways: ``StepPlan`` (the batching policy's decision, with what the model
runner may read of each row's request) and ``StepResult`` (what the runner computed).

The scheduler's step is ``plan = policy.schedule(); result = runner.run(plan); policy.update(plan,
result)``: the policy owns the requests and is the only one to change them; the runner reads the
plan (``RowInput`` per row: parameters, ids, the grammar matcher's state) and returns a result,
without holding or writing a request. No torch here: a plan and a result are host values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astrai.extension.backend.selection import AUTOMATIC, BackendChoice

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob
    from astrai.sampling.params import SamplingParams

__all__ = ["RowInput", "StepPlan", "StepResult"]


@dataclass(frozen=True)
class RowInput:
    """What the model runner reads of one row's request; the request's own objects, read only."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # generated so far: penalties count them, a seeded row's noise steps by them
    scored: int  # prompt tokens whose log-probs were computed already (``Request.prompt_logprobs``)
    matcher: Any = None  # the row's ``GrammarMatcher`` (it fills its row of a bitmask), or None
    forced: int | None = None  # the token the row must produce (a thinking's forced end), or None
    lora: int = -1  # the slot of the row's LoRA adapter (``astrai.lora``); -1: the base model


@dataclass(frozen=True)
class StepPlan:
    """One engine step as the policy decided it: host-side, plain values.

    Row ``i`` is request ``request_ids[i]`` on pool row ``req_indices[i]``: it had ``starts[i]``
    positions computed and brings ``q_lens[i]`` tokens (``input_ids``, row after row), and its
    last one is sampled when ``sample[i]``. Decode rows come first, then prefill chunks.
    ``scored[i]``: the row's request wants the log-probs of its prompt (empty: no row does).
    ``backend`` is the attention choice every row's request made. ``finished`` names the
    requests that ended and were released since the previous plan (their KV is free): the
    caller delivers them. A plan without rows runs nothing. ``drafts[i]`` (empty: no row has
    any): the last ``drafts[i]`` tokens of row ``i`` are speculative drafts after its one decode
    token; such a row is sampled at each of its ``1 + drafts[i]`` positions (verification).
    ``rows[i]`` is what the runner reads of row ``i``'s request (not compared: plans compare by
    their decisions).
    """

    request_ids: tuple[str, ...] = ()
    req_indices: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    q_lens: tuple[int, ...] = ()
    sample: tuple[bool, ...] = ()
    input_ids: tuple[int, ...] = ()
    scored: tuple[bool, ...] = ()
    backend: BackendChoice = AUTOMATIC
    finished: tuple[str, ...] = ()
    drafts: tuple[int, ...] = ()
    rows: tuple[RowInput, ...] = field(default=(), compare=False, repr=False)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Positions each row holds after the step."""
        return tuple(s + q for s, q in zip(self.starts, self.q_lens, strict=True))

    @property
    def num_tokens(self) -> int:  # T
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        """Every row brings one token and is sampled (the common case, with a cheaper layout)."""
        return len(self.input_ids) == len(self.q_lens) and all(self.sample)


@dataclass
class StepResult:
    """What the runner computed for a plan.

    ``next_ids`` and ``logprobs``: per sampled row that did not fail, in row order, its next token
    (a row with drafts: the drafts the model confirmed, then its own token, as a list) and its
    log-probs (None where not asked). ``prompt_logprobs``: by row index, the prompt log-probs the
    row's chunk computed, in position order, to be appended to its request's. ``failed``: by row
    index, the error of each row that failed on its own (the others are unaffected). ``pooled``:
    a pooling model's step (its rows sample nothing): by row index, the vector of each sampled row
    that did not fail (``next_ids`` is then empty).
    """

    next_ids: list[int | list[int]] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    failed: dict[int, Exception] = field(default_factory=dict)
    pooled: dict[int, list[float]] = field(default_factory=dict)
