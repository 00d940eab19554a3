"""Thinking budgets (``astrai.thinking``): the state of one output's thinking, and the engine ending a
thinking at its budget with the end text's ids, under preemption, chunked prefill and n-gram
speculation, the pools' invariants checked after each test (``pool_guard``)."""

from __future__ import annotations

import pytest

from astrai.sampling import SamplingParams
from astrai.thinking import ThinkingFormat, ThinkingState

END = (7, 8, 9)


def _state(budget: int | None, inside: bool = True) -> ThinkingState:
    return ThinkingState(budget, ThinkingFormat(inside=inside), END)


def test_the_budget_forces_the_end_ids_then_frees_the_answer() -> None:
    s = _state(2)
    assert (s.forced, s.draft_room()) == (None, 1)
    s.push(1, "a")
    assert (s.forced, s.draft_room()) == (None, 0)
    s.push(1, "b")
    forced = []
    while s.forced is not None:
        assert s.draft_room() == 0  # nothing is speculated past a forced token
        forced.append(s.forced)
        s.push(s.forced, "x")
    assert (tuple(forced), s.thought, s.thinking, s.draft_room()) == (END, 2, False, None)


def test_a_budget_of_zero_ends_at_once_and_a_thinking_that_ends_itself_is_untouched() -> None:
    assert _state(0).forced == END[0]
    s = _state(3)
    for piece in ("a", "</th", "ink>"):  # the close, split over pieces, before the budget
        s.push(1, piece)
    assert (s.forced, s.thinking, s.thought) == (None, False, 2)


@pytest.mark.parametrize(
    ("pieces", "thinks"),
    [((" ", "<th", "ink>", "a"), True), (("Hello",), False), (("<", "b"), False)],
    ids=["opens", "answers", "not-the-tag"],
)
def test_an_output_outside_the_block_thinks_only_if_it_opens_it(pieces: tuple, thinks: bool) -> None:
    s = _state(1, inside=False)
    for piece in pieces:
        s.push(1, piece)
    assert (s.forced is not None) is thinks


def _forced_at(ids: list[int], end: tuple[int, ...]) -> int:
    return next(i for i in range(len(ids)) if tuple(ids[i : i + len(end)]) == end)


@pytest.mark.parametrize(
    "config",
    [
        {"n_tokens": 48, "max_batch_size": 4, "max_prefill_tokens": 8},  # preemption, chunked prefill
        {"speculative": "ngram", "n_tokens": 4096},
    ],
    ids=["preempted-chunked", "speculative"],
)
def test_the_engine_ends_each_thinking_at_its_budget(tiny_engine, tiny_tokenizer, config: dict) -> None:
    """Greedy thinking is the model's own up to the budget, then the end text's ids, then the answer
    runs on to ``max_tokens``; an aborted request in the same batch frees its KV."""
    engine = tiny_engine(page_size=4, **config)
    fmt = ThinkingFormat(inside=True)
    end = tuple(tiny_tokenizer.encode(fmt.end))
    prompts = [tiny_tokenizer.encode(f"question {i} is", add_special_tokens=True) for i in range(4)]
    free = [engine.submit(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in prompts]
    budgets = [0, 3, 5, 9]
    runs = [
        engine.submit(
            p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, thinking_budget=b, thinking=fmt)
        )
        for p, b in zip(prompts, budgets, strict=True)
    ]
    aborted = engine.submit(prompts[0], SamplingParams(max_tokens=24, thinking_budget=2, thinking=fmt))
    engine.abort(aborted.request_id)
    for r, f, budget in zip(runs, free, budgets, strict=True):
        r.wait_completion()
        f.wait_completion()
        r.raise_for_error()
        ids = list(r.output_ids)
        assert ids[:budget] == list(f.output_ids)[:budget]  # the thinking ran free up to its budget
        assert _forced_at(ids, end) == budget
        assert len(ids) == 24  # the answer continued, bounded by max_tokens
    aborted.wait_completion()
    stats = engine.get_stats()
    assert stats["spec_drafts" if "speculative" in config else "preemptions"] > 0


def test_a_budget_is_refused_beyond_max_tokens_and_below_zero() -> None:
    from astrai.errors import RequestRejected

    for bad in (-1, 5):
        with pytest.raises(RequestRejected) as err:
            SamplingParams(max_tokens=4, thinking_budget=bad)
        assert err.value.param == "thinking_budget"


def test_the_think_parsers_say_how_their_thinking_is_written() -> None:
    from astrai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
    from astrai.reasoning.none import NoneReasoningParser
    from astrai.reasoning.qwen3 import Qwen3ReasoningParser

    assert Qwen3ReasoningParser("assistant\n").thinking_format() == ThinkingFormat(inside=False)
    assert Qwen3ReasoningParser("assistant\n<think>\n").thinking_format() == ThinkingFormat(inside=True)
    assert DeepSeekR1ReasoningParser("x").thinking_format() == ThinkingFormat(inside=True)
    assert Qwen3ReasoningParser("<think>\n\n</think>\n\n").thinking_format() is None  # thinking off
    assert NoneReasoningParser("").thinking_format() is None
