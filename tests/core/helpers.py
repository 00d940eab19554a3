"""What the scheduler and policy tests of core share: requests queued directly on an
``InferenceScheduler`` (``submit``, stepped by ``run_until_done``), their prompts, and a stop checker
that matches nothing (``Stopper``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from astrai.engine import GenerateResult
from astrai.model import IncrementalDecoder
from astrai.request import Request
from astrai.sampling import SamplingParams
from astrai.stopping import StopChecker

EOS = 1
GREEDY = {"temperature": 0.0, "ignore_eos": True}
_ids = itertools.count()


class Stopper:
    """A ``StopChecker`` without stop strings: never a match; each token's text is ``<id>`` when
    ``text``, else empty."""

    def __init__(self, text: bool = False) -> None:
        self.text = text

    def push(self, token: int) -> tuple[str, None]:
        return (f"<{token}>" if self.text else ""), None

    def flush(self) -> tuple[str, None]:
        return "", None


def submit(
    sched: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    priority: int = 0,
    rid: str | None = None,
    done: list[str] | None = None,
    **params: Any,
) -> GenerateResult:
    """Queue one greedy request (``params`` over ``GREEDY``) on ``sched``; returns its result, bound
    to its ``Request`` (``request_of``). ``done`` collects request ids as they end."""
    p = SamplingParams(**{**GREEDY, **params})
    rid = rid or f"r{next(_ids)}"
    on_done = None if done is None else (lambda r: done.append(r.request_id))
    result = GenerateResult(rid, len(prompt_ids), on_done=on_done)
    req = Request(
        rid,
        list(prompt_ids),
        p,
        result,
        StopChecker(IncrementalDecoder(tokenizer), p.stop),
        priority=priority,
    )
    result.bind(req)
    sched.submit(req)
    return result


def request_of(result: GenerateResult) -> Request:
    """The scheduler's ``Request`` behind a result ``submit`` returned (for tests that look inside)."""
    return result._request


def run_until_done(sched: Any, results: Sequence[GenerateResult], limit: int = 500) -> None:
    """Step ``sched`` on this thread until every result is done (AssertionError after ``limit`` steps)."""
    for _ in range(limit):
        if all(r.done for r in results):
            return
        sched.step()
    raise AssertionError("requests did not finish")


def prompt(n: int, start: int = 2) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, distinct prompts for distinct ``start``."""
    return [start + (7 * i) % 90 for i in range(n)]
