"""Admission under KV pressure (issue 16, finding 7): the pool fills without thrashing.

A pool that holds a few requests used to admit every request whose prompt fitted the free pages
(admissions of one step each counting the same pages), then preempt them in turn as they grew,
and readmit a preempted one as soon as its own recorded pages were back: dozens of preemptions,
one request preempted again and again. Admission now keeps room for the running requests' growth
(``astrai.batching``'s watermark). The first tests read the policy's decisions on a pool without a
model; the last drives the tiny model through a scheduler step by step against the unbatched
greedy reference, with the pool's invariants checked after every step.
"""

from __future__ import annotations

import itertools
import random

import pytest
from helpers import Stopper

from astrai.batching import BatchPolicy
from astrai.config import EngineConfig
from astrai.engine import GenerateResult
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held, check_pool_invariants
from astrai.model import IncrementalDecoder
from astrai.request import Request
from astrai.sampling import SamplingParams
from astrai.scheduler import InferenceScheduler
from astrai.step import StepResult
from astrai.stopping import StopChecker

EOS = 1
_ids = itertools.count()


def request(n_prompt: int, max_tokens: int, start: int = 10) -> Request:
    rid = next(_ids)
    req = Request(
        f"r{rid}",
        [start + i for i in range(n_prompt)],
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        GenerateResult(f"r{rid}", n_prompt),
        Stopper(),
    )
    req.arrival = rid
    return req


@pytest.fixture
def policy(pool_guard):
    """A policy over 64 slots in pages of 4, 8 rows, no radix; drained and checked afterwards."""
    pool = PagePool(1, 1, 1, 2, KVConfig(8, 128, 4, 64, prefix_caching=False))
    pool_guard(pool)
    policy = BatchPolicy(pool, eos_token_ids={EOS})
    yield policy
    policy.drain()


def step(policy: BatchPolicy) -> tuple[str, ...]:
    """One step, every sampled row given token 7; the ids of the rows it ran."""
    plan = policy.schedule()
    policy.update(plan, StepResult([7] * sum(plan.sample)))
    check_pool_invariants(policy.pool)
    return plan.request_ids


def test_the_requests_admitted_in_one_step_share_the_free_pages_instead_of_each_counting_them(policy):
    reqs = [request(20, 12, start=10 + 30 * i) for i in range(4)]  # each fits the 64 empty slots alone
    for r in reqs:
        policy.add(r)
    # each reserves its 20 tokens and 30% of the 11 positions it may still take: 24 slots, 6 pages;
    # two fit in 16 pages, and run to their end without a preemption (the old admission took all four)
    ran = [step(policy)]
    assert ran[0] == (reqs[0].request_id, reqs[1].request_id)
    assert [r.request_id for r in policy.waiting] == [reqs[2].request_id, reqs[3].request_id]
    while not all(r.finished for r in reqs):
        ran.append(step(policy))
    assert max(map(len, ran)) == 2 and policy.counters["preemptions"] == 0


def test_a_preempted_request_returns_before_newer_ones_once_it_can_run_to_its_end(policy):
    a, b, c = request(3, 35), request(16, 31, start=40), request(13, 38, start=70)
    for r in (a, b, c):
        policy.add(r)
    assert step(policy) == (a.request_id, b.request_id)  # c waits: the three reserves exceed 64 slots
    while not policy.counters["preemptions"]:  # a and b outgrow their reserves: the newest gives way
        step(policy)
    assert b.preemptions == 1 and b.req_idx == -1 and policy.counters["max_preemptions"] == 1
    # c would fit beside a's reserve, but it never ran: it waits behind b, and b needs room for its
    # 38 tokens and all 8 positions it may still take (not just its tokens), so it waits for a's end
    while not a.finished:
        assert step(policy) == (a.request_id,)
        assert [r.request_id for r in policy.waiting] == [b.request_id, c.request_id]
    assert step(policy) == (b.request_id,)  # a released, b readmitted
    while not b.finished:
        assert step(policy) == (b.request_id,)
    while not c.finished:
        step(policy)
    assert (a.preemptions, b.preemptions, c.preemptions) == (0, 1, 0)
    assert policy.counters == {**policy.counters, "preemptions": 1, "max_preemptions": 1}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("n_tokens", "chunk"), [(120, 2048), (160, 16)])
def test_a_flood_on_a_tight_pool_preempts_no_request_more_than_twice_and_every_answer_is_as_alone(
    tiny_model, tiny_tokenizer, reference, pool_guard, n_tokens, chunk
):
    cfg = tiny_model.config
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        KVConfig(max_batch_size=12, max_seq_len=128, page_size=4, n_tokens=n_tokens),
    )
    pool_guard(pool)
    sched = InferenceScheduler(tiny_model, pool, EngineConfig(max_prefill_tokens=chunk), eos_token_ids=[EOS])
    rng = random.Random(n_tokens)
    prompts = [[rng.randrange(2, 97) for _ in range(rng.randrange(20, 41))] for _ in range(12)]
    assert sum(len(p) + 16 for p in prompts) > 3 * n_tokens  # the pool holds a few of them at a time
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = []
    for i, p in enumerate(prompts):
        result = GenerateResult(f"f{i}", len(p))
        req = Request(f"f{i}", p, params, result, StopChecker(IncrementalDecoder(tiny_tokenizer), []))
        sched.submit(req)
        reqs.append((req, result))
    for _ in range(2000):
        if all(result.done for _, result in reqs):
            break
        sched.step()
        check_pool_invariants(pool)
    preemptions = {req.request_id: req.preemptions for req, _ in reqs}
    assert max(preemptions.values()) <= 2, preemptions
    for (_, result), p in zip(reqs, prompts, strict=True):
        assert result.done and result.error is None
        assert result.output_ids == reference(tiny_model, p, 16)
        assert result.text == tiny_tokenizer.decode(result.output_ids).rstrip("\ufffd")  # nothing sent twice
    stats = sched.stats()
    assert stats["max_preemptions"] == max(preemptions.values())
    assert stats["active_tasks"] == stats["waiting_queue"] == 0
    assert_nothing_held(pool)
