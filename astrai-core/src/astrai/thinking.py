"""Thinking budgets: the engine ends a thinking that used its budget (``SamplingParams.thinking_budget``).

A thinking model writes its reasoning inside a block (``<think>...</think>``) before its answer.
``ThinkingFormat`` says, in text, how the block opens and closes, what the engine writes to end it
(``end``, the reasoning parser's ``end_of_thinking``) and whether the prompt opened it already.
``ThinkingState`` follows one request's output, on the scheduler thread, once per accepted token:

- before the block: the output opens it (its text, whitespace aside, starts with ``open``) or not
  (then the request does not think and the budget never applies);
- inside: each token counts; the output closing the block itself (``close`` appears in its text)
  ends the thinking untouched; the ``budget``-th token without it starts the forced end;
- forcing: the next tokens are ``end``'s ids, one per step (``forced``: the model runner puts
  it in place of the sampled token, ``astrai.runner``), then the answer continues freely.

The close is looked for in the decoded text, not in token ids: a tokenizer without a ``</think>``
token lets the model spell it in several ways. Speculative drafts never cross the budget
(``draft_room``). Preemption and chunked prefill leave the state alone: it is a function of the
accepted tokens, which a recompute does not accept again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ThinkingFormat", "ThinkingState"]

_BEFORE, _INSIDE, _FORCING, _DONE = range(4)


@dataclass(frozen=True)
class ThinkingFormat:
    """How a model's thinking block is written (text), for the engine to end it at a budget."""

    open: str = "<think>"
    close: str = "</think>"
    end: str = "\n</think>\n\n"  # written to end a thinking at its budget (holds ``close``)
    inside: bool = False  # the prompt opened the block: the output starts inside it


class ThinkingState:
    """One request's place in its thinking (see the module doc). ``end_ids``: ``fmt.end`` encoded."""

    def __init__(self, budget: int | None, fmt: ThinkingFormat, end_ids: Sequence[int]) -> None:
        self.budget, self.fmt, self.end_ids = budget, fmt, tuple(end_ids)
        self.phase = _INSIDE if fmt.inside else _BEFORE
        self.thought = 0  # tokens inside the block so far (the forced end not included)
        self.head = ""  # the output's text while before the block
        self.tail = ""  # the last characters inside it (a close split over pieces)
        self.at = 0  # forced tokens accepted
        self._check_budget()

    @property
    def thinking(self) -> bool:
        """Inside the block (forced end included)."""
        return self.phase in (_INSIDE, _FORCING)

    @property
    def forced(self) -> int | None:
        """The token the next step must produce (None: sampled freely)."""
        return self.end_ids[self.at] if self.phase == _FORCING else None

    def draft_room(self) -> int | None:
        """The most speculative drafts a step may verify without crossing the budget (None: no bound)."""
        if self.phase == _DONE or self.budget is None:
            return None
        if self.phase == _INSIDE:
            return max(self.budget - self.thought - 1, 0)
        return 0  # before the block (it may open in any token) and while forcing

    def push(self, token: int, piece: str) -> None:
        """Account one accepted token, whose decoded text is ``piece`` (maybe "" while bytes are held)."""
        if self.phase == _FORCING:
            self.at += 1
            if self.at == len(self.end_ids):
                self.phase = _DONE
        elif self.phase == _BEFORE:
            self.head += piece
            text = self.head.lstrip()
            if text.startswith(self.fmt.open):
                self.phase, self.tail = _INSIDE, text[len(self.fmt.open) :]
                self._check_budget()
            elif text and not self.fmt.open.startswith(text):
                self.phase = _DONE
        elif self.phase == _INSIDE:
            self.tail = (self.tail + piece)[-(len(self.fmt.close) + len(piece)) :]
            if self.fmt.close in self.tail:
                self.phase = _DONE
            else:
                self.thought += 1
                self._check_budget()

    def _check_budget(self) -> None:
        if self.phase == _INSIDE and self.budget is not None and self.thought >= self.budget:
            self.phase = _FORCING if self.end_ids else _DONE
