"""InferenceScheduler on the tiny random model, checked against an unbatched greedy reference.

Tests that need an exact step-by-step picture drive a scheduler that was never
started, calling ``step()`` from the test thread; the others go through an engine.
"""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch
from helpers import EOS, GREEDY, prompt, run_until_done, submit

from astrai.config import EngineConfig
from astrai.errors import EngineNotReady, RequestRejected
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held, check_pool_invariants
from astrai.request import FinishReason
from astrai.sampling import SamplingParams
from astrai.scheduler import InferenceScheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")
_ids = itertools.count()


class Recorder(torch.nn.Module):
    """Wraps a model: records each forward's ragged layout, raises on demand."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.steps: list[tuple] = []
        self.fail_next = False

    def forward(self, input_ids, positions, kv_cache, logits_indices):
        self.steps.append((kv_cache.q_lens_host, tuple(logits_indices.tolist()), tuple(positions.tolist())))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step failure")
        return self.inner(input_ids, positions, kv_cache, logits_indices)


def make_pool(model, pool_guard, **kv):
    cfg = model.config
    kv = {"max_batch_size": 4, "max_seq_len": 128, "page_size": 4, "n_tokens": 256, **kv}
    pool = PagePool(
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, KVConfig(**kv)
    )
    pool_guard(pool)
    return pool


def test_one_forward_per_step_mixes_decodes_and_prefill_chunks(
    tiny_model, tiny_tokenizer, reference, pool_guard
):
    rec = Recorder(tiny_model)
    sched = InferenceScheduler(
        rec, make_pool(tiny_model, pool_guard), EngineConfig(max_prefill_tokens=8), eos_token_ids=[EOS]
    )
    a, b = prompt(5), prompt(20, start=11)
    ra = submit(sched, tiny_tokenizer, a, max_tokens=6)
    sched.step()
    rb = submit(sched, tiny_tokenizer, b, max_tokens=3)
    run_until_done(sched, [ra, rb])
    # B's 20-token prompt is split 8 + 8 + 4 while A decodes one token in the same forward.
    assert [s[0] for s in rec.steps] == [(5,), (1, 8), (1, 8), (1, 4), (1, 1), (1, 1)]
    # only rows that need a next token are sampled: A's row always, B's last prompt row once
    assert [s[1] for s in rec.steps] == [(4,), (0,), (0,), (0, 4), (0, 1), (0, 1)]
    assert rec.steps[1][2] == (5, *range(8))  # A at its own position 5, B's chunk at 0..7
    assert ra.output_ids == reference(tiny_model, a, 6)
    assert rb.output_ids == reference(tiny_model, b, 3)
    assert (ra.finish_reason, rb.finish_reason) == (FinishReason.LENGTH, FinishReason.LENGTH)
    assert_nothing_held(sched.pool)


@pytest.mark.parametrize("chunk", [1, 3, 2048])
def test_chunked_prefill_gives_the_same_greedy_tokens(tiny_engine, tiny_model, reference, chunk):
    engine = tiny_engine(max_prefill_tokens=chunk)
    prompts = [prompt(1), prompt(7, 3), prompt(13, 5), prompt(25, 9)]
    results = [engine.submit(p, SamplingParams(max_tokens=8, **GREEDY)) for p in prompts]
    for p, r in zip(prompts, results, strict=True):
        r.wait_completion()
        assert r.output_ids == reference(tiny_model, p, 8)


def test_prefix_cache_hits_through_the_scheduler(tiny_engine, tiny_model, reference):
    engine = tiny_engine(page_size=4)
    first = prompt(22)
    engine.submit(first, SamplingParams(max_tokens=5, **GREEDY)).wait_completion()
    assert wait_for(lambda: engine.get_stats()["kv_tokens_cached"] == 24)  # 22 + 4 decoded -> 6 pages
    second = first[:18] + prompt(6, start=50)
    r = engine.submit(second, SamplingParams(max_tokens=6, **GREEDY))
    r.wait_completion()
    assert engine.get_stats()["prefix_hit_tokens"] == 16  # the 4 complete pages the prompts share
    assert r.output_ids == reference(tiny_model, second, 6)
    again = engine.submit(first, SamplingParams(max_tokens=5, **GREEDY))
    again.wait_completion()
    assert engine.get_stats()["prefix_hit_tokens"] == 16 + 20  # a full hit stops a page short of the end
    assert again.output_ids == reference(tiny_model, first, 5)


def test_requests_sharing_a_prefix_being_computed_wait_for_its_pages(
    tiny_model, tiny_tokenizer, reference, pool_guard
):
    rec = Recorder(tiny_model)
    sched = InferenceScheduler(
        rec, make_pool(tiny_model, pool_guard), EngineConfig(max_prefill_tokens=32), eos_token_ids=[EOS]
    )
    shared = prompt(17)  # 4 complete pages of 4, and one token more
    a, b, c, d = shared + [50, 51], shared + [60], shared + [70, 71, 72], prompt(10, start=80)
    results = [submit(sched, tiny_tokenizer, p, max_tokens=4) for p in (a, b, c, d)]
    run_until_done(sched, results)
    # step 1: A computes the shared pages; B and C wait for them (D shares nothing and is admitted);
    # step 2: A and D decode, B and C start after the 16 shared positions, now a cache hit
    assert [s[0] for s in rec.steps[:2]] == [(19, 10), (1, 1, 2, 4)]
    assert rec.steps[1][2][2:] == (16, 17, 16, 17, 18, 19)
    assert sched.counters["prefix_hit_tokens"] == 32
    for p, r in zip((a, b, c, d), results, strict=True):
        assert r.output_ids == reference(tiny_model, p, 4)
    assert_nothing_held(sched.pool)


def test_a_request_sharing_only_a_short_head_does_not_wait(tiny_model, tiny_tokenizer, reference, pool_guard):
    rec = Recorder(tiny_model)
    sched = InferenceScheduler(
        rec, make_pool(tiny_model, pool_guard), EngineConfig(max_prefill_tokens=32), eos_token_ids=[EOS]
    )
    shared = prompt(17)
    a, e = shared + [50, 51], shared[:4] + prompt(16, start=31)  # e shares one page of its 20 tokens
    results = [submit(sched, tiny_tokenizer, p, max_tokens=3) for p in (a, e)]
    run_until_done(sched, results)
    assert rec.steps[0][0] == (19, 13)  # both admitted at once; e's prompt fills the rest of the budget
    assert [r.output_ids for r in results] == [reference(tiny_model, a, 3), reference(tiny_model, e, 3)]
    assert_nothing_held(sched.pool)


def test_without_prefix_caching_sharers_do_not_wait(tiny_model, tiny_tokenizer, reference, pool_guard):
    rec = Recorder(tiny_model)
    pool = make_pool(tiny_model, pool_guard, prefix_caching=False)
    sched = InferenceScheduler(rec, pool, EngineConfig(max_prefill_tokens=64), eos_token_ids=[EOS])
    shared = prompt(17)
    results = [submit(sched, tiny_tokenizer, shared + [60 + i], max_tokens=2) for i in range(3)]
    run_until_done(sched, results)
    assert rec.steps[0][0] == (18, 18, 18)
    assert_nothing_held(sched.pool)


def test_prefix_caching_off_and_contiguous_mode_give_the_same_tokens(tiny_engine, tiny_model, reference):
    prompts = [prompt(9), prompt(9)[:8] + [40], prompt(3)]
    for engine in (tiny_engine(prefix_caching=False), tiny_engine(paged=False, max_seq_len=64)):
        for p in prompts:
            r = engine.submit(p, SamplingParams(max_tokens=6, **GREEDY))
            r.wait_completion()
            assert r.output_ids == reference(tiny_model, p, 6)
        assert engine.get_stats()["prefix_hit_tokens"] == 0


def test_exhaustion_preempts_and_everyone_finishes_as_if_alone(
    tiny_engine, tiny_model, tiny_tokenizer, reference
):
    engine = tiny_engine(n_tokens=40, page_size=4, max_batch_size=4, max_prefill_tokens=16)
    prompts = [prompt(6), prompt(9, 4), prompt(5, 6), prompt(8, 8)]
    streams = [[] for _ in prompts]
    results = [
        engine.submit(p, SamplingParams(max_tokens=24, **GREEDY), on_piece=s.append)
        for p, s in zip(prompts, streams, strict=True)
    ]
    for p, r, s in zip(prompts, results, streams, strict=True):
        r.wait_completion()
        assert r.output_ids == reference(tiny_model, p, 24)
        assert r.finish_reason is FinishReason.LENGTH
        # recompute after preemption sends nothing twice
        assert "".join(s) == r.text == tiny_tokenizer.decode(r.output_ids).rstrip("\ufffd")
    assert engine.get_stats()["preemptions"] > 0


def test_a_request_that_cannot_be_admitted_does_not_block_later_ones(
    tiny_model, tiny_tokenizer, reference, pool_guard
):
    sched = InferenceScheduler(
        tiny_model, make_pool(tiny_model, pool_guard, n_tokens=32), eos_token_ids=[EOS]
    )
    r1 = submit(sched, tiny_tokenizer, prompt(8), max_tokens=16)
    sched.step()
    big, small = prompt(20, 3), prompt(3, 5)
    r2 = submit(sched, tiny_tokenizer, big, max_tokens=4)
    r3 = submit(sched, tiny_tokenizer, small, max_tokens=2)
    sched.step()
    assert [r.request_id for r in sched.waiting] == [r2.request_id]
    assert r3.request_id in {r.request_id for r in sched.running}
    run_until_done(sched, [r1, r2, r3])
    assert r2.output_ids == reference(tiny_model, big, 4)
    assert r3.output_ids == reference(tiny_model, small, 2)


def test_never_fitting_requests_are_rejected_at_submission(tiny_engine):
    engine = tiny_engine(max_seq_len=64)
    with pytest.raises(
        RequestRejected, match=r"50 tokens \+ max_tokens 20 = 70 tokens exceeds the limit of 64"
    ):
        engine.submit(prompt(50), SamplingParams(max_tokens=20))
    small_pool = tiny_engine(n_tokens=32)
    with pytest.raises(RequestRejected, match=r"= 40 tokens exceeds the limit of 32"):
        small_pool.submit(prompt(20), SamplingParams(max_tokens=20))
    with pytest.raises(RequestRejected, match="empty prompt"):
        engine.submit([], SamplingParams())
    with pytest.raises(RequestRejected, match="= 72 tokens"):  # one bad prompt withdraws the whole list
        engine.generate(["ok", "x" * 70], max_tokens=1)
    assert engine.generate("ok", max_tokens=2) is not None  # the engine keeps serving


@pytest.mark.parametrize("phase", ["prefill", "decode", "waiting"])
def test_abort_frees_the_request_within_one_step(tiny_model, tiny_tokenizer, reference, pool_guard, phase):
    pool = make_pool(tiny_model, pool_guard, max_batch_size=1)
    sched = InferenceScheduler(tiny_model, pool, EngineConfig(max_prefill_tokens=4), eos_token_ids=[EOS])
    ids = prompt(20)
    r = submit(sched, tiny_tokenizer, ids, max_tokens=30)
    if phase == "waiting":
        blocker = submit(sched, tiny_tokenizer, prompt(3), max_tokens=30)
        r, blocker = blocker, r  # the first one runs; abort the queued one
    sched.step()
    while phase == "decode" and len(sched.running[0].output_ids) < 2:
        sched.step()
    assert not r.done
    sched.abort(r.request_id)
    sched.step()
    assert r.done and r.finish_reason is FinishReason.ABORT
    if phase == "decode":
        assert r.output_ids == reference(tiny_model, ids, 2)
    if phase == "waiting":
        sched.abort(blocker.request_id)
        sched.step()
    check_pool_invariants(pool)
    assert_nothing_held(pool)


def _stop_between_two_tokens(tokenizer, ref):
    """A stop string made of the texts of two consecutive greedy tokens (k, k+1)."""
    texts = [tokenizer.decode([t]) for t in ref]
    full = "".join(texts)
    for k in range(2, len(ref) - 1):
        stop = texts[k] + texts[k + 1]
        if (
            texts[k].isprintable()
            and texts[k + 1].isprintable()
            and full.find(stop) == len("".join(texts[:k]))
        ):
            return k, stop, full
    raise AssertionError("no pair of printable tokens")


def test_stop_string_split_across_tokens_is_never_streamed(
    tiny_engine, tiny_model, tiny_tokenizer, reference
):
    engine = tiny_engine()
    ids = tiny_tokenizer.encode("hello there", add_special_tokens=True)
    ref = reference(tiny_model, ids, 40)
    k, stop, full = _stop_between_two_tokens(tiny_tokenizer, ref)
    pieces: list[str] = []
    r = engine.submit(
        ids, SamplingParams(max_tokens=40, stop=["\x00never", stop], **GREEDY), on_piece=pieces.append
    )
    r.wait_completion()
    assert (r.finish_reason, r.stop_sequence) == (FinishReason.STOP_SEQUENCE, stop)
    assert r.text == "".join(pieces) == full[: full.find(stop)]
    assert r.output_ids == ref[: k + 2]
    streamed = engine.generate(
        tiny_tokenizer.decode(ids[1:]), stream=True, stop=stop, max_tokens=40, **GREEDY
    )
    assert "".join(streamed) == r.text


def test_eos_model_stop_ids_and_max_tokens(make_engine, tiny_model, tiny_tokenizer, reference, monkeypatch):
    ids = prompt(6)
    ref = reference(tiny_model, ids, 8)
    monkeypatch.setattr(tiny_model.config, "eos_token_ids", [EOS, ref[3]])  # a model-level stop id
    engine = make_engine(tiny_model, tiny_tokenizer, page_size=4, n_tokens=256)
    stopped = engine.submit(ids, SamplingParams(max_tokens=8, temperature=0.0))
    stopped.wait_completion()
    assert (stopped.finish_reason, stopped.output_ids) == (FinishReason.STOP, ref[: ref.index(ref[3]) + 1])
    ignored = engine.submit(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ignored.wait_completion()
    assert (ignored.finish_reason, ignored.output_ids, ignored.completion_tokens) == (
        FinishReason.LENGTH,
        ref,
        8,
    )
    eos = engine.submit(ids, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={EOS: 100.0}))
    eos.wait_completion()
    assert (eos.finish_reason, eos.output_ids, eos.text) == (FinishReason.STOP, [EOS], "")


def test_per_request_sampling_parameters(tiny_engine, tiny_model, reference):
    engine = tiny_engine()
    ids = prompt(7)
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 12, "ignore_eos": True}
    alone = engine.submit(ids, SamplingParams(**seeded))
    alone.wait_completion()
    batch = [engine.submit(p, SamplingParams(**seeded)) for p in (prompt(3), ids, prompt(11, 4))]
    for r in batch:
        r.wait_completion()
    assert batch[1].output_ids == alone.output_ids  # a seeded row ignores its batch neighbours
    top1 = engine.submit(ids, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True))
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 1.0}
    penalised = engine.submit(ids, SamplingParams(max_tokens=16, **penalties, **GREEDY))
    biased = engine.submit(ids, SamplingParams(logit_bias={42: 100.0}, max_tokens=5, **GREEDY))
    for r in (top1, penalised, biased):
        r.wait_completion()
    assert top1.output_ids == reference(tiny_model, ids, 8)
    assert penalised.output_ids == reference(tiny_model, ids, 16, **penalties)
    assert penalised.output_ids != reference(tiny_model, ids, 16)
    assert biased.output_ids == [42] * 5


def test_a_step_failure_that_no_row_repeats_alone_fails_nobody(
    tiny_model, tiny_tokenizer, reference, pool_guard
):
    # a transient failure (an OOM, say): the rows retried apart succeed, so nobody fails
    # (tests/core/test_isolation.py: a failure a row repeats alone fails that row only)
    rec = Recorder(tiny_model)
    sched = InferenceScheduler(rec, make_pool(tiny_model, pool_guard, max_batch_size=2), eos_token_ids=[EOS])
    r1, r2, r3 = (submit(sched, tiny_tokenizer, prompt(n), max_tokens=6) for n in (4, 5, 6))
    sched.step()  # r1 and r2 prefill together; r3 waits for a row
    rec.fail_next = True
    sched.step()
    run_until_done(sched, [r1, r2, r3])
    for r, n in ((r1, 4), (r2, 5)):
        assert r.finish_reason is FinishReason.LENGTH and r.output_ids == reference(tiny_model, prompt(n), 6)
    assert r3.finish_reason is FinishReason.LENGTH
    assert r3.output_ids == reference(tiny_model, prompt(6), 6)
    assert_nothing_held(sched.pool)


def test_a_failing_step_through_the_engine_and_the_loop_keeps_serving(
    make_engine, tiny_model, tiny_tokenizer
):
    rec = Recorder(tiny_model)
    engine = make_engine(rec, tiny_tokenizer, page_size=4, n_tokens=256)
    expected = engine.generate("abc", max_tokens=5, **GREEDY)
    rec.fail_next = True
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.generate("abc", max_tokens=5, **GREEDY)
    assert engine.is_healthy()
    assert engine.generate("abc", max_tokens=5, **GREEDY) == expected


def test_a_raising_stream_callback_fails_only_its_request(tiny_engine, tiny_model, reference):
    engine = tiny_engine()

    def client_gone(piece):
        raise ConnectionResetError("client went away")

    bad = engine.submit(prompt(5), SamplingParams(max_tokens=5, **GREEDY), on_piece=client_gone)
    good = engine.submit(prompt(5), SamplingParams(max_tokens=5, **GREEDY))
    for r in (bad, good):
        r.wait_completion()
    assert bad.finish_reason is FinishReason.ERROR and isinstance(bad.error, ConnectionResetError)
    assert good.output_ids == reference(tiny_model, prompt(5), 5)


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_a_dying_loop_fails_every_waiter_and_reports_unhealthy(tiny_engine, monkeypatch):
    engine = tiny_engine()
    sched = engine.scheduler
    started = threading.Event()
    results = [
        engine.submit(
            prompt(5 + i), SamplingParams(max_tokens=400, **GREEDY), on_piece=lambda _: started.set()
        )
        for i in range(3)
    ]
    assert started.wait(timeout=20)  # the requests are running, holding KV
    refill = sched.policy._refill

    def broken_refill():
        raise ValueError("corrupted state")

    monkeypatch.setattr(sched.policy, "_refill", broken_refill)
    for r in results:
        assert r.wait_completion(timeout=20)
        assert isinstance(r.error, EngineNotReady) and "corrupted state" in str(r.error)
    assert not engine.is_healthy() and "ValueError: corrupted state" in sched.reason
    with pytest.raises(EngineNotReady):
        engine.generate("x", max_tokens=2)
    monkeypatch.setattr(sched.policy, "_refill", refill)


def test_shutdown_fails_waiters_and_is_idempotent(tiny_engine):
    engine = tiny_engine(max_batch_size=1)
    started = threading.Event()
    running = engine.submit(
        prompt(5), SamplingParams(max_tokens=400, **GREEDY), on_piece=lambda _: started.set()
    )
    queued = engine.submit(prompt(6), SamplingParams(max_tokens=4, **GREEDY))
    errors: list[BaseException] = []

    def blocked_caller():
        try:
            engine.generate("zz", max_tokens=4)
        except EngineNotReady as e:
            errors.append(e)

    caller = threading.Thread(target=blocked_caller)
    caller.start()
    assert started.wait(timeout=20)
    engine.shutdown()
    caller.join(timeout=20)
    for r in (running, queued):
        assert r.done and r.finish_reason is FinishReason.ERROR and isinstance(r.error, EngineNotReady)
    assert len(errors) == 1 and not engine.is_healthy()
    engine.shutdown()
    with pytest.raises(EngineNotReady):
        engine.submit(prompt(3), SamplingParams())


def test_the_idle_loop_blocks_instead_of_spinning(tiny_engine):
    engine = tiny_engine()
    engine.generate("hi", max_tokens=3)
    assert wait_for(lambda: engine.get_stats()["active_tasks"] == 0)
    before = engine.scheduler.iterations
    time.sleep(0.2)
    assert engine.scheduler.iterations - before <= 1


@pytest.mark.parametrize(("page_size", "chunk"), [(4, 5), (2, 2048)])
def test_random_mix_with_preemption_aborts_and_shared_prefixes(
    tiny_model, tiny_tokenizer, reference, pool_guard, page_size, chunk
):
    """Everything at once on a small pool; pool invariants are checked after every step."""
    rng = random.Random(page_size)
    pool = make_pool(tiny_model, pool_guard, n_tokens=40, page_size=page_size, max_batch_size=4)
    sched = InferenceScheduler(tiny_model, pool, EngineConfig(max_prefill_tokens=chunk), eos_token_ids=[EOS])
    base = prompt(24)
    reqs = []
    for _ in range(7):
        n = rng.randrange(1, 24)
        ids = base[:n] if rng.random() < 0.5 else [rng.randrange(2, 97) for _ in range(n)]
        reqs.append((ids, (m := rng.randrange(1, 14)), submit(sched, tiny_tokenizer, ids, max_tokens=m)))
        if rng.random() < 0.5:
            sched.step()
    aborted = reqs[3][2]
    for i in range(1000):
        if all(r.done for *_, r in reqs):
            break
        if i == 6:
            sched.abort(aborted.request_id)
        sched.step()
        check_pool_invariants(pool)
    for ids, m, r in reqs:
        want = reference(tiny_model, ids, m)
        assert r.output_ids == (want[: len(r.output_ids)] if r is aborted else want)
    sched.step()
    assert_nothing_held(pool)
    assert sched.counters["preemptions"] > 0
