"""BatchPolicy without a model: every decision read off the StepPlan it returns.

A real ``PagePool`` on a tiny config (one layer, one head, head dim 2) holds the pages; the
"model" is the test, which hands ``update`` the tokens a step sampled. The pool's invariants
are checked after every test (``pool_guard``).
"""

from __future__ import annotations

import pytest
from helpers import Stopper

from astrai.batching import BatchPolicy
from astrai.config import EngineConfig
from astrai.extension import AUTOMATIC, BackendChoice
from astrai.kvcache import KVConfig, PagePool, check_pool_invariants
from astrai.request import FinishReason, Request
from astrai.sampling import SamplingParams
from astrai.step import StepPlan, StepResult

EOS = 1


class Sink:
    def __init__(self) -> None:
        self.pieces: list[str] = []

    def deliver_piece(self, piece: str) -> None:
        self.pieces.append(piece)

    def deliver_final(self, request: Request) -> None:
        raise AssertionError("the policy never delivers: the scheduler does")


def pool(n_tokens: int | None = 64, page_size: int = 4, rows: int = 4, radix: bool = True) -> PagePool:
    return PagePool(1, 1, 1, 2, KVConfig(rows, 64, page_size, n_tokens, prefix_caching=radix))


_arrivals = iter(range(10**6))


def request(
    rid: str, prompt: list[int], max_tokens: int = 4, backend: BackendChoice | None = None
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    req = Request(rid, prompt, params, Sink(), Stopper(text=True), backend=backend)
    req.arrival = next(_arrivals)
    return req


def tokens(n: int, start: int = 10) -> list[int]:
    return [start + i for i in range(n)]


def run(policy: BatchPolicy, plan: StepPlan, token: int = 7) -> None:
    """What the runner would return: ``token`` for every sampled row."""
    policy.update(plan, StepResult([token] * sum(plan.sample)))


@pytest.fixture(autouse=True)
def _no_leaks():
    made: list[BatchPolicy] = []
    yield made
    for policy in made:
        for req in policy.drain():
            assert req.req_idx == -1
        check_pool_invariants(policy.pool)
        assert policy.pool.stats()["kv_tokens_in_use"] == 0


@pytest.fixture
def make(_no_leaks):
    def make(p: PagePool, **kw) -> BatchPolicy:
        policy = BatchPolicy(p, EngineConfig(**kw), eos_token_ids={EOS})
        _no_leaks.append(policy)
        return policy

    return make


def test_admission_follows_arrival_and_the_plan_carries_each_rows_tokens(make):
    policy = make(pool())
    a, b, c = request("a", tokens(5)), request("b", tokens(3, 50)), request("c", tokens(2, 80))
    for r in (a, b, c):
        policy.add(r)
    plan = policy.schedule()
    assert plan.request_ids == ("a", "b", "c")
    assert plan.q_lens == (5, 3, 2) and plan.starts == (0, 0, 0) and plan.sample == (True, True, True)
    assert plan.input_ids == (*tokens(5), *tokens(3, 50), *tokens(2, 80))
    assert plan.seq_lens == (5, 3, 2) and not plan.is_decode and plan.backend == AUTOMATIC
    assert len(set(plan.req_indices)) == 3 and plan.finished == ()
    run(policy, plan)
    plan = policy.schedule()  # every request now decodes its sampled token at its own position
    assert plan.request_ids == ("a", "b", "c") and plan.q_lens == (1, 1, 1)
    assert plan.starts == (5, 3, 2) and plan.input_ids == (7, 7, 7) and plan.is_decode
    assert a.sink.pieces == ["<7>"]
    run(policy, plan)


def test_a_request_that_cannot_fit_now_does_not_block_the_ones_behind_it(make):
    policy = make(pool(n_tokens=32))
    policy.add(request("a", tokens(8), max_tokens=16))
    run(policy, policy.schedule())
    big, small = request("big", tokens(20, 30)), request("small", tokens(3, 60), max_tokens=2)
    policy.add(big)
    policy.add(small)
    plan = policy.schedule()  # 20 + 1 tokens need 6 pages; a holds 3 of 8 and keeps a page of headroom
    assert plan.request_ids == ("a", "small") and plan.q_lens == (1, 3)
    assert [r.request_id for r in policy.waiting] == ["big"]
    run(policy, plan)
    assert policy.schedule().request_ids == ("a", "small")  # no page was freed: big is not even retried


def test_the_newest_running_request_is_preempted_when_a_decode_cannot_grow(make):
    policy = make(pool(n_tokens=20, radix=False))  # 5 pages of 4
    old, new = request("old", tokens(4), max_tokens=8), request("new", tokens(8, 40), max_tokens=8)
    policy.add(old)
    run(policy, policy.schedule())
    policy.add(new)
    plan = policy.schedule()  # 12 slots for new's prefill and first decode + a page of headroom for old: fits
    assert plan.request_ids == ("old", "new") and plan.q_lens == (1, 8)
    run(policy, plan)
    plans = []
    while not policy.counters["preemptions"]:
        plans.append(policy.schedule())
        run(policy, plans[-1])
    # old's 9th position needs a page when new holds the last three: new, the newest, gives way
    assert [p.request_ids for p in plans] == [("old", "new")] * 3 + [("old",)]
    assert plans[-1].starts == (8,) and old.num_computed == 9
    assert [r.request_id for r in policy.waiting] == ["new"] and new.req_idx == -1 and new.num_computed == 0
    assert new.tokens == [*tokens(8, 40), 7, 7, 7, 7]  # it recomputes them later, re-emitting nothing
    plan = policy.schedule()  # nothing freed since: new waits while old runs on
    assert plan.request_ids == ("old",)
    run(policy, plan)


def test_a_request_sharing_a_prefix_being_computed_waits_for_its_pages(make):
    policy = make(pool(n_tokens=128, rows=4), max_prefill_tokens=8)
    shared = tokens(16)
    first, second = request("first", [*shared, 90, 91]), request("second", [*shared, 95])
    policy.add(first)
    plan = policy.schedule()
    assert plan.request_ids == ("first",) and plan.q_lens == (8,)
    run(policy, plan)
    policy.add(second)
    plan = policy.schedule()  # first is still computing the 16 shared tokens: second waits for them
    assert plan.request_ids == ("first",) and plan.starts == (8,) and plan.q_lens == (8,)
    assert [r.request_id for r in policy.waiting] == ["second"]
    run(policy, plan)  # the chunk's complete pages are recorded at once
    plan = policy.schedule()
    # second starts after a 16-token hit: its last prompt token is a decode row, planned first
    assert plan.request_ids == ("second", "first")
    assert plan.starts == (16, 16) and plan.q_lens == (1, 2) and plan.sample == (True, True)
    assert policy.counters["prefix_hit_tokens"] == 16 and second.cached_tokens == 16
    run(policy, plan)


def test_the_prefill_budget_is_split_oldest_first_after_the_decode_rows(make):
    policy = make(pool(n_tokens=128), max_prefill_tokens=8)
    policy.add(request("d", tokens(3)))
    run(policy, policy.schedule())
    policy.add(request("p1", tokens(5, 30)))
    policy.add(request("p2", tokens(20, 60)))
    plan = policy.schedule()
    assert plan.request_ids == ("d", "p1", "p2")
    assert plan.q_lens == (1, 5, 3) and plan.sample == (True, True, False)
    run(policy, plan)
    plan = policy.schedule()  # p2 continues where its chunk ended, under a fresh budget
    assert plan.request_ids == ("d", "p1", "p2") and plan.q_lens == (1, 1, 8) and plan.starts[2] == 3
    run(policy, plan)


def test_finished_requests_are_released_and_named_by_the_next_plan(make):
    policy = make(pool())
    short, long = request("short", tokens(3), max_tokens=1), request("long", tokens(3, 40), max_tokens=3)
    policy.add(short)
    policy.add(long)
    plan = policy.schedule()
    run(policy, plan)
    assert short.finish_reason is FinishReason.LENGTH and short.req_idx >= 0
    plan = policy.schedule()
    assert plan.finished == ("short",) and short.req_idx == -1 and plan.request_ids == ("long",)
    policy.update(plan, StepResult([EOS]))  # EOS ends it
    assert long.finish_reason is FinishReason.STOP
    assert policy.schedule() == StepPlan(finished=("long",))
    assert policy.pool.stats()["kv_tokens_cached"] == 4  # long's complete first page is kept in the radix


def test_one_step_runs_on_one_attention_backend(make):
    policy = make(pool())
    flash = BackendChoice("flash", "attn_backend()")
    policy.add(request("auto", tokens(3)))
    policy.add(request("flash", tokens(3, 40), backend=flash))
    plan = policy.schedule()
    assert plan.request_ids == ("auto",) and plan.backend == AUTOMATIC
    assert [r.request_id for r in policy.waiting] == ["flash"]
    policy.update(plan, StepResult(failed={0: RuntimeError("injected")}))  # the row failed alone
    assert policy.schedule().finished == ("auto",)  # released; now the flash request runs alone
    plan = policy.schedule()
    assert plan.request_ids == ("flash",) and plan.backend == flash
    run(policy, plan)


def test_a_stream_callback_that_raises_fails_only_its_request(make):
    policy = make(pool())
    bad, good = request("bad", tokens(3)), request("good", tokens(3, 40))

    def boom(piece: str) -> None:
        raise RuntimeError("client gone")

    bad.sink.deliver_piece = boom
    policy.add(bad)
    policy.add(good)
    run(policy, policy.schedule())
    assert bad.finish_reason is FinishReason.ERROR and "client gone" in str(bad.error)
    assert good.finish_reason is None and good.sink.pieces == ["<7>"]
    plan = policy.schedule()
    assert plan.finished == ("bad",) and plan.request_ids == ("good",)
    run(policy, plan)


def test_with_a_prefill_step_ratio_prefill_is_cut_beside_decode_rows_only(make):
    """``prefill_step_ratio`` (``astrai.pacing``): the pacer's budget, from the step times it was
    shown, bounds a step's prefill tokens while a request decodes; alone, a prompt takes them all."""
    policy = make(pool(n_tokens=256), max_prefill_tokens=64, prefill_step_ratio=3.0)
    policy.pacer.min_tokens = 4
    policy.pacer.observe(1, 0, 0.010)  # a decode step 10 ms, a prompt token 2 ms: 10 tokens fit
    policy.pacer.observe(1, 100, 0.210)
    policy.add(request("long", tokens(40, 30)))
    plan = policy.schedule()
    assert plan.q_lens == (40,)  # nobody decodes: the whole budget
    run(policy, plan)
    policy.add(request("next", tokens(40, 80)))
    plan = policy.schedule()
    assert plan.request_ids == ("long", "next") and plan.q_lens == (1, 10)
    policy.observe(plan, 0.030)  # 1 decode row and 10 tokens in 30 ms: 2 ms a token, unchanged
    assert policy.pacer.token_s == pytest.approx(0.002)
    run(policy, plan)
