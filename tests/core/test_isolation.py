"""One request cannot take its batch down (issue 16): bounds at submit, and a failing step retried apart.

A model that raises whenever one request's token is in the forward, and a sampling plugin that
raises on one row's parameter, stand for a failure tied to one row: that row ends with the
error, every other row of the step finishes with exactly the tokens it has alone, and the pool
holds nothing afterwards (``pool_guard``). Values that would overflow a tensor are bounded when
the request is submitted.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import EOS, GREEDY, prompt, run_until_done
from helpers import submit as _submit

from astrai.config import EngineConfig
from astrai.errors import RequestRejected
from astrai.kvcache import KVConfig, PagePool
from astrai.request import FinishReason
from astrai.runner import run_apart
from astrai.sampling import SamplingParams, SamplingPipeline, SamplingStrategy
from astrai.scheduler import InferenceScheduler

POISON = 299  # a token id no healthy prompt holds: the forward that carries it raises
pytestmark = pytest.mark.usefixtures("one_torch_thread")
_ids = itertools.count()


def submit(sched, tokenizer, prompt_ids, **params):
    return _submit(sched, tokenizer, prompt_ids, **{"max_tokens": 8, **params})


class Poisoned(torch.nn.Module):
    """The tiny model, but a forward whose input holds ``POISON`` raises; counts forwards."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.forwards = 0

    def forward(self, input_ids, positions, kv_cache, logits_indices):
        self.forwards += 1
        if bool((input_ids == POISON).any()):
            raise RuntimeError("poisoned row in the batch")
        return self.inner(input_ids, positions, kv_cache, logits_indices)


class Explode(SamplingStrategy):
    """A plugin stage that raises when some row of its batch sets ``explode`` above 0."""

    name = "explode"
    extra_params = ("explode",)

    def apply(self, logits, batch):
        if bool((batch.extra_tensor("explode") > 0).any()):
            raise ValueError("explode: a row asked for it")
        return logits


def make_scheduler(model, pool_guard, pipeline=None, **kv):
    cfg = model.config
    kv = {"max_batch_size": 8, "max_seq_len": 128, "page_size": 4, "n_tokens": 512, **kv}
    pool = PagePool(
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, KVConfig(**kv)
    )
    pool_guard(pool)
    return InferenceScheduler(
        model, pool, EngineConfig(max_prefill_tokens=512), eos_token_ids=[EOS], pipeline=pipeline
    )


@pytest.mark.parametrize("arrives", ["with the others", "while they decode"])
def test_a_row_whose_forward_fails_fails_alone_and_the_others_finish_as_alone(
    tiny_model, tiny_tokenizer, reference, pool_guard, arrives
):
    model = Poisoned(tiny_model)
    sched = make_scheduler(model, pool_guard)
    healthy = [submit(sched, tiny_tokenizer, prompt(n, start=n), max_tokens=10) for n in (3, 5, 6, 9, 11)]
    if arrives == "while they decode":
        sched.step()  # the healthy prompts prefill; the poisoned one meets their decode rows
        sched.step()
    before = model.forwards
    bad = submit(sched, tiny_tokenizer, [*prompt(4), POISON, *prompt(3)], max_tokens=10)
    sched.step()  # one step of 6 rows raises: its rows run in halves until the poisoned one is alone
    assert 2 <= model.forwards - before <= 1 + 2 * math.ceil(math.log2(6))
    run_until_done(sched, [*healthy, bad])
    assert bad.finish_reason is FinishReason.ERROR and str(bad.error) == "poisoned row in the batch"
    assert bad.output_ids == []
    for r, n in zip(healthy, (3, 5, 6, 9, 11), strict=True):
        assert r.finish_reason is FinishReason.LENGTH and r.error is None
        assert r.output_ids == reference(tiny_model, prompt(n, start=n), 10)
    assert sched.pool.stats()["kv_tokens_in_use"] == 0


def test_a_sampling_stage_raising_on_one_rows_parameter_fails_that_row_without_rerunning_the_model(
    tiny_model, tiny_tokenizer, reference, pool_guard
):
    pipeline = SamplingPipeline.default(extra=[Explode()])
    seeded = {"temperature": 0.9, "top_k": 20, "seed": 7, "max_tokens": 8}
    alone = make_scheduler(tiny_model, pool_guard, pipeline)
    expected = submit(alone, tiny_tokenizer, prompt(6), **seeded)
    run_until_done(alone, [expected])

    model = Poisoned(tiny_model)
    sched = make_scheduler(model, pool_guard, pipeline)
    greedy = [submit(sched, tiny_tokenizer, prompt(n), max_tokens=8) for n in (4, 7)]
    sampled = submit(sched, tiny_tokenizer, prompt(6), **seeded)
    bad = submit(sched, tiny_tokenizer, prompt(5), temperature=1.0, seed=3, extra={"explode": 1.0})
    steps = 0
    while not all(r.done for r in (*greedy, sampled, bad)):
        before = model.forwards
        sched.step()
        assert model.forwards - before <= 1  # sampling is retried on the logits already computed
        steps += 1
        assert steps < 100
    assert bad.finish_reason is FinishReason.ERROR and str(bad.error) == "explode: a row asked for it"
    for r, n in zip(greedy, (4, 7), strict=True):
        assert r.finish_reason is FinishReason.LENGTH and r.output_ids == reference(tiny_model, prompt(n), 8)
    assert sampled.finish_reason is FinishReason.LENGTH and sampled.output_ids == expected.output_ids


def test_through_the_engine_the_culprit_gets_the_error_and_the_loop_keeps_serving(
    make_engine, tiny_model, tiny_tokenizer, reference
):
    engine = make_engine(Poisoned(tiny_model), tiny_tokenizer, max_batch_size=8, page_size=4, n_tokens=1024)
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts = [prompt(n, start=n) for n in (4, 6, 8, 10)]
    results = [engine.submit(p, params) for p in prompts[:2]]
    bad = engine.submit([*prompt(3), POISON], params)
    results += [engine.submit(p, params) for p in prompts[2:]]
    for r in (*results, bad):
        assert r.wait_completion(30)
    with pytest.raises(RuntimeError, match="poisoned row"):
        bad.raise_for_error()
    for r, p in zip(results, prompts, strict=True):
        assert r.error is None and r.output_ids == reference(tiny_model, p, 12)
    assert engine.is_healthy()


def test_a_failure_a_row_repeats_alone_fails_only_the_rows_that_repeat_it():
    attempts = []

    def attempt(part):
        attempts.append(part)
        if {3, 6} & set(part):
            raise RuntimeError(f"rows {part}")
        return {i: i * 10 for i in part}

    done, failed = run_apart(list(range(8)), attempt, RuntimeError("the whole step"))
    assert done == {i: i * 10 for i in (0, 1, 2, 4, 5, 7)}
    assert sorted(failed) == [3, 6] and str(failed[3]) == "rows [3]"
    assert len(attempts) <= 12  # bisection, not one attempt per subset
    # a failure that no part repeats fails nobody; one that every single row repeats fails them all
    assert run_apart([0, 1, 2], lambda part: dict.fromkeys(part, 0), RuntimeError("transient")) == (
        {0: 0, 1: 0, 2: 0},
        {},
    )

    def broken(part):
        raise RuntimeError("always")

    assert sorted(run_apart([0, 1, 2], broken, RuntimeError("always"))[1]) == [0, 1, 2]


# -- bounds at submit ------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [300, 2**63, 10**30], ids=["vocab", "2**63", "10**30"])
def test_a_top_k_at_or_beyond_the_vocabulary_is_off_and_shares_a_batch_harmlessly(
    tiny_model, tiny_tokenizer, reference, pool_guard, top_k
):
    sched = make_scheduler(Poisoned(tiny_model), pool_guard)
    seeded = {"temperature": 0.8, "seed": 11, "max_tokens": 8}
    healthy = [submit(sched, tiny_tokenizer, prompt(n), max_tokens=8) for n in (4, 7)]
    huge = submit(sched, tiny_tokenizer, prompt(6), top_k=top_k, **seeded)
    off = submit(sched, tiny_tokenizer, prompt(6), top_k=0, **seeded)
    run_until_done(sched, [*healthy, huge, off])
    assert huge.error is None and huge.output_ids == off.output_ids
    for r, n in zip(healthy, (4, 7), strict=True):
        assert r.output_ids == reference(tiny_model, prompt(n), 8)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [300]}, "stop_token_ids"),
        ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
        ({"logit_bias": {"10000000000000000000000000000000": 1.0}}, "logit_bias"),
        ({"extra": {"explode": 10**400}}, "explode"),
        ({"extra": {"explode": 1e39}}, "explode"),
        ({"temperature": 10**400}, "temperature"),
        ({"logprobs": 2**63}, "logprobs"),
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, dict) else v,
)
def test_values_that_would_overflow_a_tensor_are_refused_at_submit(
    tiny_model, tiny_tokenizer, pool_guard, params, param
):
    sched = make_scheduler(tiny_model, pool_guard, SamplingPipeline.default(extra=[Explode()]))
    with pytest.raises(RequestRejected) as err:
        submit(sched, tiny_tokenizer, prompt(4), **params)
    assert err.value.param == param


def test_huge_numbers_in_messages_and_tiny_temperatures_are_bounded():
    # an int too long for repr() (more than 4,300 digits) still gets a message, not a ValueError
    with pytest.raises(RequestRejected, match="an integer of 16610 bits") as err:
        SamplingParams(max_tokens=-(10**5000))
    assert err.value.param == "max_tokens"
    assert SamplingParams(temperature=1e-300).temperature == 0.01  # vLLM's floor: no inf/nan logits


def test_a_plugin_parameter_set_without_selecting_its_strategy_is_still_validated():
    class Scaled(SamplingStrategy):
        name = "scaled"
        extra_params = ("scaled", "scaled_by")

        def apply(self, logits, batch):
            return logits

    pipeline = SamplingPipeline.default(extra=[Scaled()])
    # the row does not select "scaled", but the stage reads its scaled_by when another row does
    with pytest.raises(RequestRejected) as err:
        pipeline.prepare(SamplingParams(extra={"scaled_by": "x"}), 300)
    assert err.value.param == "scaled_by"
    assert pipeline.prepare(SamplingParams(extra={"scaled_by": 2.0}), 300).extra == {"scaled_by": 2.0}
