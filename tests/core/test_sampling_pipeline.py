"""SamplingPipeline: greedy rows, plugin strategies selected per row, validation, and sample()."""

from __future__ import annotations

import pytest
import torch

from astrai.errors import PluginError, RequestRejected
from astrai.sampling import (
    MinPStrategy,
    SamplingBatch,
    SamplingParams,
    SamplingPipeline,
    SamplingStrategy,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    sample,
)

NEG_INF = float("-inf")


class RelPStrategy(SamplingStrategy):
    """A third-party style strategy: drop tokens below rel_p times the top probability."""

    name = "rel_p"

    def apply(self, logits, batch):
        rel_p = batch.extra_tensor("rel_p", 0.0)
        probs = torch.softmax(logits, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * rel_p.unsqueeze(1)
        return logits.masked_fill_(probs < floor, NEG_INF)


def make_batch(params, steps=None, output_ids=None):
    steps = list(range(len(params))) if steps is None else steps
    return SamplingBatch.from_params(params, steps, "cpu", output_ids)


def rel_p_reference(row: torch.Tensor, rel_p: float) -> torch.Tensor:
    probs = torch.softmax(row, dim=-1)
    return torch.where(probs >= probs.max() * rel_p, row, torch.full_like(row, NEG_INF))


def test_greedy_rows_take_argmax_of_penalised_logits_in_a_mixed_batch():
    torch.manual_seed(7)
    logits = torch.randn(4, 300)
    top = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=0.0, top_k=1),
        SamplingParams(temperature=2.0, seed=1),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, top_p=0.1),
        SamplingParams(temperature=0.0, logit_bias={17: 100.0}),
    ]
    # Row 2 generated its argmax token twice: -2*2 - 2 pushes it below the runner-up.
    outputs = [[], [], [int(top[2])] * 2, []]
    ids = SamplingPipeline.default().sample(logits, make_batch(params, output_ids=outputs))
    assert ids.dtype == torch.int64 and ids.shape == (4,)
    penalised = logits[2].clone()
    penalised[top[2]] -= 6.0
    assert ids[0] == top[0]
    assert ids[2] == penalised.argmax() and ids[2] != top[2]
    assert ids[3] == 17
    assert 0 <= int(ids[1]) < 300


def test_all_greedy_batch_and_logits_are_not_modified():
    logits = torch.randn(3, 50)
    before = logits.clone()
    ids = SamplingPipeline.default().sample(logits, make_batch([SamplingParams(temperature=0.0)] * 3))
    assert torch.equal(ids, before.argmax(dim=-1))
    SamplingPipeline.default().sample(logits, make_batch([SamplingParams(temperature=0.3, top_k=4)] * 3))
    assert torch.equal(logits, before)


def test_half_precision_logits_are_sampled_in_float32():
    torch.manual_seed(12)
    logits = torch.randn(2, 80).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=4, top_k=5)]
    ids = SamplingPipeline.default().sample(logits, make_batch(params))
    assert torch.equal(logits, before)
    assert ids[0] == logits[0].float().argmax()
    assert logits[1, ids[1]] >= logits[1].float().topk(5).values[-1]  # bf16 ties at the 5th are kept


def test_probs_match_reference_distribution():
    torch.manual_seed(8)
    logits = torch.randn(2, 64)
    params = [SamplingParams(temperature=0.5, top_k=10), SamplingParams(temperature=0.0)]
    probs = SamplingPipeline.default().probs(logits, make_batch(params))
    scaled = logits[0] / 0.5
    want = torch.softmax(scaled.masked_fill(scaled < scaled.topk(10).values[-1], NEG_INF), dim=-1)
    torch.testing.assert_close(probs[0], want)
    assert probs[1].tolist() == torch.nn.functional.one_hot(logits[1].argmax(), 64).float().tolist()


def test_extra_strategy_runs_only_on_rows_that_select_it():
    torch.manual_seed(9)
    logits = torch.randn(4, 200) * 3
    params = [
        SamplingParams(strategy="rel_p", extra={"rel_p": 0.2}),
        SamplingParams(extra={"typical_p": 0.2}),  # a parameter of no installed strategy: nothing selected
        SamplingParams(extra={"rel_p": 0.05}, temperature=0.5),  # its own-named parameter selects it
        SamplingParams(top_k=30),
    ]
    got = SamplingPipeline.default(extra=[RelPStrategy()]).apply(logits.clone(), make_batch(params))
    base = SamplingPipeline.default().apply(
        logits.clone(),
        make_batch([SamplingParams(**{"temperature": p.temperature, "top_k": p.top_k}) for p in params]),
    )
    assert torch.equal(got[0], rel_p_reference(logits[0], 0.2))
    assert torch.equal(got[2], rel_p_reference(logits[2] / 0.5, 0.05))
    assert torch.equal(got[1], logits[1])
    assert torch.equal(got[3], base[3])
    assert int(torch.isfinite(got[0]).sum()) < 200


def test_enabled_extra_strategy_runs_on_every_row():
    torch.manual_seed(10)
    logits = torch.randn(3, 100) * 3
    params = [SamplingParams(extra={"rel_p": 0.3}), SamplingParams(), SamplingParams(extra={"rel_p": 0.1})]
    got = SamplingPipeline.default(extra=[RelPStrategy()], enabled=["rel_p"]).apply(
        logits.clone(), make_batch(params)
    )
    for row, m in enumerate([0.3, 0.0, 0.1]):
        assert torch.equal(got[row], rel_p_reference(logits[row], m))


def test_extra_strategy_never_samples_filtered_tokens():
    logits = torch.tensor([[4.0, 3.9, 1.0, 0.5] + [-1.0] * 60])
    params = SamplingParams(strategy="rel_p", extra={"rel_p": 0.5}, seed=3)
    n = 500
    ids = SamplingPipeline.default(extra=[RelPStrategy()]).sample(
        logits.expand(n, -1), make_batch([params] * n)
    )
    assert set(ids.tolist()) == {0, 1}


def test_unknown_strategy_is_rejected():
    pipe = SamplingPipeline.default(extra=[RelPStrategy()])
    pipe.validate(SamplingParams(strategy="rel_p"))
    pipe.validate(SamplingParams(strategy="top_p"))
    with pytest.raises(RequestRejected, match="typical"):
        pipe.validate(SamplingParams(strategy="typical"))
    with pytest.raises(RequestRejected, match="vocab"):
        pipe.validate(SamplingParams(logit_bias={99: 1.0}), vocab_size=50)
    with pytest.raises(RequestRejected, match="typical"):
        pipe.sample(torch.zeros(1, 8), make_batch([SamplingParams(strategy="typical")]))


def test_pipeline_configuration_errors():
    with pytest.raises(PluginError, match="not found"):
        SamplingPipeline.default(enabled=["rel_p"])
    with pytest.raises(PluginError):
        SamplingPipeline.default(extra=[RelPStrategy(), RelPStrategy()])
    with pytest.raises(PluginError):
        SamplingPipeline.default(extra=[object()])


def test_from_strategies_maps_entry_points():
    pipe = SamplingPipeline.from_strategies(
        {"top_p": TopPStrategy, "rel_p": RelPStrategy, "temperature": TemperatureStrategy()},
        enabled=["rel_p"],
    )
    assert [type(s) for s in pipe.stages] == [TemperatureStrategy, TopKStrategy, TopPStrategy, MinPStrategy]
    assert list(pipe.extra) == ["rel_p"] and pipe.enabled == ("rel_p",)
    with pytest.raises(PluginError, match="rel_p"):
        SamplingPipeline.from_strategies({"rel_p": TopKStrategy})
    with pytest.raises(PluginError):
        SamplingPipeline.from_strategies({"broken": int})


def test_sample_shortcut():
    torch.manual_seed(11)
    logits = torch.randn(5, 100)
    greedy = sample(logits, temperature=0.0)
    assert torch.equal(greedy, logits.argmax(dim=-1))
    assert torch.equal(sample(logits, top_k=1), greedy)
    one = sample(logits[0], temperature=0.8, top_p=0.9, seed=5)
    assert one.dim() == 0 and one.dtype == torch.int64
    assert one == sample(logits[0], temperature=0.8, top_p=0.9, seed=5)
    assert torch.equal(sample(logits, seed=9), sample(logits, seed=9))
    draws = {int(sample(logits[0], top_k=3)) for _ in range(40)}
    assert draws <= set(logits[0].topk(3).indices.tolist()) and len(draws) > 1
    with pytest.raises(RequestRejected):
        sample(logits, top_p=0.0)


class BoundedRelP(RelPStrategy):
    """RelP declaring its parameter, so that admission checks it (the default ``validate``)."""

    extra_params = ("rel_p",)


def test_defaults_are_merged_at_admission_and_select_the_strategy():
    pipe = SamplingPipeline.default(extra=[BoundedRelP()])
    pipe = SamplingPipeline(pipe.stages, pipe.extra.values(), defaults={"rel_p": 0.5})
    assert pipe.prepare(SamplingParams()).extra == {"rel_p": 0.5}
    own = SamplingParams(extra={"rel_p": 0.0, "unclaimed": "x"})
    assert pipe.prepare(own) is own  # nothing to add: the request's own value wins
    logits = torch.tensor([[2.0, 2.0 + torch.log(torch.tensor(0.4)).item(), 0.0]])
    got = pipe.apply(logits.clone(), make_batch([pipe.prepare(SamplingParams())]))
    assert torch.isfinite(got).tolist() == [[True, False, False]]  # 0.4 < 0.5 of the top probability
    with pytest.raises(RequestRejected, match="rel_p must be a finite number"):
        pipe.prepare(SamplingParams(extra={"rel_p": "high"}))  # checked before any step runs
    with pytest.raises(PluginError, match="'typical_p' not found; misspelled or not installed"):
        SamplingPipeline(defaults={"typical_p": 0.9})
    with pytest.raises(PluginError, match="configured sampling defaults"):
        SamplingPipeline(extra=[BoundedRelP()], defaults={"rel_p": "high"})
