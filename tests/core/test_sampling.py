"""SamplingParams validation, SamplingBatch, penalties and the built-in filters against references."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from astrai.errors import RequestRejected
from astrai.sampling import (
    BaseSamplingStrategy,
    SamplingBatch,
    SamplingParams,
    SamplingPipeline,
    SamplingStrategy,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    apply_penalties,
)

NEG_INF = float("-inf")


def make_batch(params, steps=None, output_ids=None):
    steps = list(range(len(params))) if steps is None else steps
    return SamplingBatch.from_params(params, steps, "cpu", output_ids)


# -- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -1},
        {"max_tokens": 1.5},
        {"temperature": -0.1},
        {"temperature": 2.01},
        {"temperature": float("nan")},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": -1},
        {"top_k": True},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.5},
        {"logit_bias": {5: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {"x": 1.0}},
        {"logit_bias": [1, 2]},
        {"stop": [""]},
        {"stop": ["ok", 3]},
        {"seed": 1.5},
        {"strategy": ""},
        {"extra": {1: 2}},
    ],
    ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_params_reject_out_of_range(kwargs):
    field = next(iter(kwargs))
    with pytest.raises(RequestRejected, match=field):
        SamplingParams(**kwargs)


def test_params_normalise_inputs():
    p = SamplingParams(stop="END", logit_bias={"50256": -100, 7: 2}, temperature=1)
    assert p.stop == ["END"]
    assert p.logit_bias == {50256: -100.0, 7: 2.0}
    assert isinstance(p.temperature, float)
    nulls = SamplingParams(stop=None, extra=None, logit_bias=None, temperature=None, top_k=None, top_p=None)
    assert (nulls.stop, nulls.extra, nulls.logit_bias) == ([], {}, {})
    assert (nulls.temperature, nulls.top_k, nulls.top_p) == (1.0, 0, 1.0)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    edges = SamplingParams(temperature=2.0, top_p=1.0, frequency_penalty=-2, presence_penalty=2)
    assert (edges.temperature, edges.frequency_penalty) == (2.0, -2.0)


# -- SamplingBatch ----------------------------------------------------------------------------


def test_batch_tensors_and_summaries():
    params = [
        SamplingParams(temperature=0.0, top_k=5, seed=3),
        SamplingParams(temperature=0.5, top_k=40, top_p=0.9, seed=-1),
        SamplingParams(top_p=0.5, logit_bias={3: 1.5}, extra={"min_p": 0.2}, strategy="min_p"),
    ]
    b = make_batch(params, steps=[7, 8, 9])
    assert b.size == 3 and b.device == torch.device("cpu")
    assert b.temperature.tolist() == [0.0, 0.5, 1.0] and b.temperature.dtype == torch.float32
    assert b.top_k.tolist() == [5, 40, 0] and b.top_k.dtype == torch.int64
    assert b.top_p.tolist() == pytest.approx([1.0, 0.9, 0.5])
    assert b.steps.tolist() == [7, 8, 9]
    assert b.seeds[:2].tolist() == [3, -1]
    assert b.greedy.tolist() == [True, False, False]
    # Summaries ignore the greedy row: its top_k=5 filters nothing that matters.
    assert (b.any_greedy, b.all_greedy, b.needs_temperature) == (True, False, True)
    assert (b.max_top_k, b.needs_top_p, b.top_p_k_bound) == (40, True, 0)
    assert (b.needs_penalties, b.has_logit_bias) == (False, True)
    assert list(zip(b.bias_rows.tolist(), b.bias_tokens.tolist(), b.bias_values.tolist(), strict=True)) == [
        (2, 3, 1.5)
    ]
    assert b.strategies == (None, None, "min_p")
    assert b.extra_tensor("min_p", 0.05).tolist() == pytest.approx([0.05, 0.05, 0.2])
    assert b.extra_tensor("min_p", 0.05) is b.extra_tensor("min_p", 0.05)  # built once


def test_batch_seeds_wrap_to_64_bits_and_unseeded_rows_follow_torch_seed():
    huge = make_batch([SamplingParams(seed=2**64 + 5), SamplingParams(seed=2**63)])
    assert huge.seeds.tolist() == [5, -(2**63)]
    params = [SamplingParams(), SamplingParams(seed=1), SamplingParams()]
    torch.manual_seed(123)
    a = make_batch(params).seeds
    b = make_batch(params).seeds
    torch.manual_seed(123)
    c = make_batch(params).seeds
    assert a[1] == b[1] == 1
    assert a[0] != b[0] and a[2] != b[2] and a[0] != a[2]
    assert torch.equal(a, c)


def test_batch_extra_tensor_rejects_non_numbers():
    b = make_batch([SamplingParams(extra={"min_p": "high"})])
    with pytest.raises(RequestRejected, match="min_p"):
        b.extra_tensor("min_p")


def test_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        SamplingBatch.from_params([SamplingParams()], [0, 1], "cpu")


# -- penalties --------------------------------------------------------------------------------


def test_penalties_match_openai_definition():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(3, vocab)
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, logit_bias={4: 5.0, 49: -100}),
        SamplingParams(),  # untouched even though it has output ids
        SamplingParams(frequency_penalty=-0.5, presence_penalty=1.25, logit_bias={"1": 2, 60: 9.0}),
    ]
    outputs = [[1, 1, 4, 7, 1], [2, 2, 3], [0, 9, 9, 9, 49]]
    got = apply_penalties(logits.clone(), make_batch(params, output_ids=outputs))

    want = logits.clone()
    for row, (p, ids) in enumerate(zip(params, outputs, strict=True)):
        for tok, count in Counter(ids).items():
            want[row, tok] -= p.frequency_penalty * count + p.presence_penalty
        for tok, bias in p.logit_bias.items():
            if tok < vocab:  # id 60 is not in this vocabulary: ignored
                want[row, tok] += bias
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])


def test_penalties_accept_padded_tensor_output_ids():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams(presence_penalty=2.0)]
    ids = torch.tensor([[5, 5, -1], [0, 0, 3]])
    got = apply_penalties(logits, make_batch(params, output_ids=ids))
    assert got.tolist() == [[0, 0, 0, 0, 0, -2.0], [-2.0, 0, 0, -2.0, 0, 0]]


# -- built-in filters -------------------------------------------------------------------------


def test_strategy_names_and_alias():
    assert BaseSamplingStrategy is SamplingStrategy
    assert [TemperatureStrategy.name, TopKStrategy.name, TopPStrategy.name] == [
        "temperature",
        "top_k",
        "top_p",
    ]
    assert issubclass(SamplingPipeline, SamplingStrategy)


def test_temperature_divides_sampled_rows_only():
    logits = torch.tensor([[1.0, -2.0, 4.0]] * 3)
    b = make_batch([SamplingParams(temperature=0.0), SamplingParams(temperature=0.5), SamplingParams()])
    got = TemperatureStrategy().apply(logits.clone(), b)
    assert got.tolist() == [[1.0, -2.0, 4.0], [2.0, -4.0, 8.0], [1.0, -2.0, 4.0]]


def test_top_k_keeps_each_rows_k_largest():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    ks = [1, 7, 0, 299, 1000]  # 0 and >= V keep everything
    b = make_batch([SamplingParams(top_k=k) for k in ks])
    got = TopKStrategy().apply(logits.clone(), b)
    for row, k in enumerate(ks):
        values = sorted(logits[row].tolist(), reverse=True)
        kth = values[k - 1] if 0 < k < len(values) else -math.inf
        want = [v if v >= kth else NEG_INF for v in logits[row].tolist()]
        assert got[row].tolist() == want


def _reference_nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    probs = torch.softmax(row.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize("vocab,scale", [(400, 3.0), (3000, 0.3)], ids=["peaked", "wide-fallback-sort"])
def test_top_p_keeps_smallest_set_reaching_top_p(vocab, scale):
    torch.manual_seed(2)
    logits = torch.randn(4, vocab) * scale
    tops = [0.5, 0.9, 1.0, 0.01]
    b = make_batch([SamplingParams(top_p=p) for p in tops])
    got = TopPStrategy().apply(logits.clone(), b)
    for row, p in enumerate(tops):
        kept = set(torch.isfinite(got[row]).nonzero().flatten().tolist())
        assert kept == (set(range(vocab)) if p == 1.0 else _reference_nucleus(logits[row], p))
        assert torch.equal(got[row][list(kept)], logits[row][list(kept)])
    if scale < 1:  # the wide rows really exceed the candidate window
        assert len(_reference_nucleus(logits[1], 0.9)) > 256


def test_a_wide_nucleus_takes_the_cut_off_a_full_sort_gives(monkeypatch):
    """Rows whose nucleus passes the first 256 candidates, of widths from a few hundred tokens to the
    whole vocabulary (a flat row, a row of -inf gaps): each keeps exactly the tokens that sorting
    the full row keeps (``_cutoff`` over every logit), whichever group of candidates it falls in."""
    from astrai.sampling import top_p
    from astrai.sampling.top_p import _candidates, _cutoff

    monkeypatch.setattr(top_p, "kernel_for", lambda op, x: None)  # PyTorch's way (the kernel's: backend_cpu)
    gen = torch.Generator().manual_seed(11)
    scales = [6.0, 3.0, 3.0, 1.0, 0.3, 0.0, 2.0, 4.0]
    logits = torch.randn(8, 20_000, generator=gen) * torch.tensor(scales).unsqueeze(1)
    logits[6, ::3] = NEG_INF
    tops = [0.999, 0.9, 0.99, 0.95, 0.7, 0.5, 0.95, 0.99]
    b = make_batch([SamplingParams(top_p=p) for p in tops])
    got = TopPStrategy().apply(logits.clone(), b)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    cut = _cutoff(logits.sort(dim=-1, descending=True).values, lse, b.top_p)[0]
    assert torch.equal(got, logits.masked_fill(logits < cut, NEG_INF))
    widths = torch.isfinite(got).sum(dim=-1)
    assert widths.min() > 256 and widths[5] == 20_000  # every row past the first candidates; flat: all
    needed = _candidates(logits, lse, b.top_p)
    assert (needed >= widths).all() and (needed[:5] < 20_000).all()  # enough, and no full sort for most


def test_top_k_then_top_p_in_pipeline_order():
    torch.manual_seed(3)
    logits = torch.randn(3, 500) * 2
    params = [
        SamplingParams(top_k=20, top_p=0.6, temperature=0.8),
        SamplingParams(top_k=5, top_p=0.3),
        SamplingParams(top_k=50),
    ]
    got = SamplingPipeline.default().apply(logits.clone(), make_batch(params))
    for row, p in enumerate(params):
        scaled = logits[row] / p.temperature
        kth = scaled.topk(p.top_k).values[-1]
        filtered = scaled.masked_fill(scaled < kth, NEG_INF)
        kept = set(range(500)) if p.top_p == 1.0 else _reference_nucleus(filtered, p.top_p)
        kept &= set(torch.isfinite(filtered).nonzero().flatten().tolist())
        assert set(torch.isfinite(got[row]).nonzero().flatten().tolist()) == kept
        torch.testing.assert_close(got[row][list(kept)], scaled[list(kept)])


def test_plain_greedy_is_greedy_with_nothing_that_changes_the_logits():
    """The scheduler takes the argmax without the pipeline only for these rows."""
    assert SamplingParams(temperature=0).plain_greedy
    assert not SamplingParams(temperature=0.5).plain_greedy
    for change in (
        {"presence_penalty": 0.5},
        {"frequency_penalty": -1},
        {"logit_bias": {3: 5}},
        {"strategy": "min_p"},
    ):
        assert (
            SamplingParams(temperature=0, **change).greedy
            and not SamplingParams(temperature=0, **change).plain_greedy
        )
