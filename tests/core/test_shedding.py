"""Load shedding and priorities in the scheduler (issue 17): a bounded queue, a queue timeout,
priority order for admission and preemption, unique ids in flight.

The scheduler is stepped by hand on the tiny model, so every order asserted is deterministic;
``pool_guard`` checks the pool holds nothing afterwards.
"""

from __future__ import annotations

import itertools
import time

import pytest
from helpers import EOS, prompt, request_of, run_until_done
from helpers import submit as _submit

from astrai.config import EngineConfig
from astrai.errors import Overloaded, RequestRejected
from astrai.kvcache import KVConfig, PagePool
from astrai.request import FinishReason
from astrai.scheduler import InferenceScheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")
_ids = itertools.count()


def submit(sched, tokenizer, prompt_ids, **params):
    """One greedy request of 4 tokens unless told: ``(its result, its Request)``."""
    result = _submit(sched, tokenizer, prompt_ids, **{"max_tokens": 4, **params})
    return result, request_of(result)


def make_scheduler(
    model, pool_guard, max_batch_size=1, n_tokens=512, max_queued=None, queue_timeout=None, priority=False
):
    cfg = model.config
    kv = KVConfig(max_batch_size=max_batch_size, max_seq_len=128, page_size=4, n_tokens=n_tokens)
    pool = PagePool(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, kv)
    pool_guard(pool)
    config = EngineConfig(
        max_prefill_tokens=512,
        max_queued_requests=max_queued,
        queue_timeout=queue_timeout,
        scheduling_policy="priority" if priority else "fcfs",
    )
    return InferenceScheduler(model, pool, config, eos_token_ids=[EOS])


def test_a_full_queue_refuses_at_once_and_takes_requests_again_as_it_drains(
    tiny_model, tiny_tokenizer, pool_guard
):
    sched = make_scheduler(tiny_model, pool_guard, max_queued=2)
    first = [submit(sched, tiny_tokenizer, prompt(5))[0] for _ in range(2)]
    with pytest.raises(Overloaded, match="2 requests are waiting"):
        submit(sched, tiny_tokenizer, prompt(5))
    assert sched.queued == 2 and sched.counters["total_tasks"] == 2  # the refused one was never counted
    sched.step()  # one is admitted (a batch of one): one place in the queue is free again
    assert sched.queued == 1
    third, _ = submit(sched, tiny_tokenizer, prompt(5))
    with pytest.raises(Overloaded):
        submit(sched, tiny_tokenizer, prompt(5))
    run_until_done(sched, [*first, third])
    assert all(r.finish_reason is FinishReason.LENGTH for r in [*first, third])
    assert sched.queued == 0


def test_an_aborted_waiting_request_frees_its_place_in_the_queue(tiny_model, tiny_tokenizer, pool_guard):
    sched = make_scheduler(tiny_model, pool_guard, max_queued=1)
    running, _ = submit(sched, tiny_tokenizer, prompt(5), max_tokens=20)
    sched.step()
    waiting, _ = submit(sched, tiny_tokenizer, prompt(5))
    with pytest.raises(Overloaded):
        submit(sched, tiny_tokenizer, prompt(5))
    sched.abort(waiting.request_id)
    sched.step()
    assert waiting.finish_reason is FinishReason.ABORT and sched.queued == 0
    again, _ = submit(sched, tiny_tokenizer, prompt(5))
    run_until_done(sched, [running, again])


def test_a_request_that_waits_past_the_queue_timeout_ends_overloaded_and_the_running_one_goes_on(
    tiny_model, tiny_tokenizer, reference, pool_guard
):
    sched = make_scheduler(tiny_model, pool_guard, queue_timeout=0.05)
    running, _ = submit(sched, tiny_tokenizer, prompt(6), max_tokens=12)
    sched.step()  # admitted: a running request never times out
    late, _ = submit(sched, tiny_tokenizer, prompt(5))
    time.sleep(0.08)
    sched.step()
    assert late.done and late.finish_reason is FinishReason.ERROR and isinstance(late.error, Overloaded)
    assert "waited 0.05 s" in str(late.error) and late.output_ids == []
    assert sched.queued == 0
    run_until_done(sched, [running])
    assert running.output_ids == reference(tiny_model, prompt(6), 12)


def test_priority_orders_admission_smaller_first_then_arrival(tiny_model, tiny_tokenizer, pool_guard):
    sched = make_scheduler(tiny_model, pool_guard, priority=True)
    done: list[str] = []
    results = [submit(sched, tiny_tokenizer, prompt(5), rid="occupant", done=done, max_tokens=6)[0]]
    sched.step()  # the occupant runs; the rest queue behind it in the batch of one
    for rid, prio in [("p5", 5), ("p1a", 1), ("p-2", -2), ("p3", 3), ("p1b", 1)]:
        results.append(submit(sched, tiny_tokenizer, prompt(4), priority=prio, rid=rid, done=done)[0])
    run_until_done(sched, results)
    assert done == ["occupant", "p-2", "p1a", "p1b", "p3", "p5"]


def test_fcfs_keeps_arrival_order_and_refuses_a_priority(tiny_model, tiny_tokenizer, pool_guard):
    sched = make_scheduler(tiny_model, pool_guard)
    done: list[str] = []
    results = [submit(sched, tiny_tokenizer, prompt(4), rid=f"a{i}", done=done)[0] for i in range(4)]
    with pytest.raises(RequestRejected, match="scheduling-policy priority") as caught:
        submit(sched, tiny_tokenizer, prompt(4), priority=1)
    assert caught.value.param == "priority"
    run_until_done(sched, results)
    assert done == ["a0", "a1", "a2", "a3"]


@pytest.mark.parametrize("priority", [False, True])
def test_preemption_takes_the_lowest_priority_first_under_priority_and_the_newest_under_fcfs(
    tiny_model, tiny_tokenizer, reference, pool_guard, priority
):
    # two requests fit at admission (the watermark reserves part of their output) but not at full length
    sched = make_scheduler(tiny_model, pool_guard, max_batch_size=2, n_tokens=48, priority=priority)
    older, old_req = submit(sched, tiny_tokenizer, prompt(10), priority=5 if priority else 0, max_tokens=30)
    newer, new_req = submit(sched, tiny_tokenizer, prompt(10, start=3), max_tokens=30)
    sched.step()
    assert old_req.req_idx >= 0 and new_req.req_idx >= 0  # both admitted together
    run_until_done(sched, [older, newer])
    victim, spared = (old_req, new_req) if priority else (new_req, old_req)
    assert victim.preemptions >= 1 and spared.preemptions == 0
    assert older.output_ids == reference(tiny_model, prompt(10), 30)  # recomputed, not re-emitted
    assert newer.output_ids == reference(tiny_model, prompt(10, start=3), 30)


def test_a_request_id_in_flight_is_refused_and_free_again_once_it_ends(
    tiny_model, tiny_tokenizer, pool_guard
):
    sched = make_scheduler(tiny_model, pool_guard)
    first, _ = submit(sched, tiny_tokenizer, prompt(4), rid="same")
    with pytest.raises(RequestRejected, match="in flight already"):
        submit(sched, tiny_tokenizer, prompt(4), rid="same")
    run_until_done(sched, [first])
    second, _ = submit(sched, tiny_tokenizer, prompt(4), rid="same")
    run_until_done(sched, [second])
    assert second.finish_reason is FinishReason.LENGTH


def test_the_engine_config_refuses_impossible_shedding_options() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="queue_timeout"):
        EngineConfig(queue_timeout=0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        EngineConfig(max_queued_requests=0)  # every request waits until a step admits it
