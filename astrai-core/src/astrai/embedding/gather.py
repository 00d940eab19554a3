"""``Gatherer``: the inputs waiting for an encoder, taken one forward pass at a time.

A pass takes the inputs waiting, in arrival order, up to ``max_tokens`` tokens and ``max_inputs``
inputs (an input longer than the token budget runs alone).

**Regathering.** An encoder's pass costs more per input when it is small: on 2 cores,
all-MiniLM-L6-v2 in float32 took 17 ms for one sentence of 63 tokens and 85 ms for eight (in bf16
on its kernels, 5.5 and 35 ms). Clients that send
one request after another (a RAG indexer's workers, a benchmark's) come back a few milliseconds
after their answers; a worker that started its next pass on whatever was waiting at that moment
split them into two cohorts that never met again: eight such clients got passes of four on
average. So after a pass that answered ``n`` requests, the next one waits until ``n`` requests have
arrived since it ended, or until ``regather`` of that pass's time has gone by (at most ``cap``
seconds), or until its budgets are full, whichever comes first. A lone client loses nothing (its
next input is the one awaited); an idle engine blocks as before; under a queue that fills the
budgets there is no wait; traffic of clients that never come back waits ``regather`` of a pass at
most (Triton's dynamic batcher has the same trade in its ``max_queue_delay``). The engine's
``regather`` is half a pass: eight clients sending one text after another, each answered in
JSON over HTTP on the same 2 Zen 4 cores, got 122 texts/s without the wait, ~140 with a quarter of a
pass and ~150 with a half (three or more runs each, alternating; a whole pass: no better than half).
"""

from __future__ import annotations

import queue
import time
from typing import Any

__all__ = ["Gatherer"]


class Gatherer:
    """The queue of inputs and the next pass's choice of them (see the module). An input has
    ``ids``, ``at`` (its ``time.perf_counter()`` on arrival) and ``opens`` (whether it is the first
    of its request's inputs)."""

    def __init__(self, max_tokens: int, max_inputs: int, regather: float = 0.25, cap: float = 0.05) -> None:
        self.max_tokens, self.max_inputs = max_tokens, max_inputs
        self.regather, self.cap = regather, cap
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: Any = None  # an input taken that did not fit the last pass: the next one's first
        self._answered, self._ended, self._took = 0, 0.0, 0.0

    def put(self, item: Any) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        """``next_pass`` returns what it has gathered, with ``stopped`` True."""
        self._queue.put(None)

    def ended(self, answered: int, started: float) -> None:
        """A pass that began at ``started`` (``perf_counter``) completed ``answered`` requests."""
        self._ended = time.perf_counter()
        self._answered, self._took = answered, self._ended - started

    def next_pass(self) -> tuple[list[Any], bool]:
        """The next pass's inputs (blocks until there is one) and whether a stop came."""
        batch: list[Any] = []
        tokens = back = 0
        deadline = self._ended + min(self.cap, self.regather * self._took)
        while True:
            if self._held is not None:
                item, self._held = self._held, None
            else:
                try:
                    if not batch:
                        item = self._queue.get()
                    else:
                        item = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:  # the deadline passed
                    return batch, False
            if item is None:
                return batch, True
            if batch and tokens + len(item.ids) > self.max_tokens:
                self._held = item
                return batch, False
            batch.append(item)
            tokens += len(item.ids)
            back += item.opens and item.at >= self._ended
            if len(batch) >= self.max_inputs or tokens >= self.max_tokens:
                return batch, False
            if back >= self._answered and self._queue.empty():
                return batch, False

    def leftover(self) -> list[Any]:
        """Every input still waiting (after the worker stopped)."""
        items = [self._held] if self._held is not None else []
        self._held = None
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)
