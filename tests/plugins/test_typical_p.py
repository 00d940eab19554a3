"""The astrai-typical-p sampling plugin, found through its entry point: vectorised rows, the engine, config,
HTTP."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers.generation.logits_process import TypicalLogitsWarper

from astrai.errors import PluginError, RequestRejected
from astrai.sampling import SamplingBatch, SamplingParams, SamplingPipeline

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ONLY_THE_MOST_TYPICAL = 1e-9  # below the most typical token's probability in any row here: it alone is kept


def _oracle(row: torch.Tensor, typical_p: float) -> torch.Tensor:
    """transformers' TypicalLogitsWarper on one row (it refuses typical_p 1: off, the row as it is)."""
    if typical_p == 1.0:
        return row
    return TypicalLogitsWarper(typical_p)(None, row.unsqueeze(0).clone())[0]


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked and flat rows alike, about a fifth of each row already filtered (-inf)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 8
    filtered = torch.rand(rows, vocab, generator=g) < 0.2
    filtered[:, 0] = False  # every row keeps a finite logit, as the contract promises
    return logits.masked_fill_(filtered, float("-inf"))


def test_the_most_likely_token_goes_when_others_are_more_typical() -> None:
    pipe = SamplingPipeline.discover()
    assert type(pipe.extra["typical_p"]).__module__ == "astrai_typical_p"
    # H = 1.33 nats; -log 0.2 = 1.61 lies closer to it than -log 0.4 = 0.92
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]]).log()
    for typical_p, kept in ((0.5, [False, True, True, True, False]), (0.7, [True, True, True, True, False])):
        out = pipe.apply(
            logits.clone(), SamplingBatch.from_params([SamplingParams(extra={"typical_p": typical_p})], [0])
        )
        assert torch.isfinite(out[0]).tolist() == kept, typical_p  # ties with the last kept token stay
        assert torch.equal(out[0][out[0].isfinite()], logits[0][out[0].isfinite()])  # kept logits untouched


def test_installed_strategy_filters_each_row_with_its_own_typical_p() -> None:
    pipe = SamplingPipeline.discover()
    logits = _random_logits(6, 300, seed=0)
    params = [
        SamplingParams(extra={"typical_p": 0.9}),
        SamplingParams(),  # does not select it: untouched by typical-p
        SamplingParams(extra={"typical_p": 0.5}, top_k=20),  # composes after top-k
        SamplingParams(strategy="typical_p"),  # selected without a value: typical_p 1 keeps the row
        SamplingParams(extra={"typical_p": 0.2}, temperature=0.7),
        SamplingParams(extra={"typical_p": ONLY_THE_MOST_TYPICAL}),
    ]
    got = pipe.apply(logits.clone(), SamplingBatch.from_params(params, range(6)))
    plain = [
        dataclasses.replace(p, extra={}, strategy=None) for p in params
    ]  # the same rows without typical-p
    base = SamplingPipeline.default().apply(logits.clone(), SamplingBatch.from_params(plain, range(6)))
    assert torch.equal(got[1], base[1]) and torch.equal(got[3], base[3])
    for i, typical_p in ((0, 0.9), (2, 0.5), (4, 0.2), (5, ONLY_THE_MOST_TYPICAL)):
        assert torch.equal(got[i], _oracle(base[i], typical_p)), i
    assert int(got[2].isfinite().sum()) < 20 and int(got[0].isfinite().sum()) < int(base[0].isfinite().sum())
    logp = base[5].log_softmax(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum()
    assert got[5].isfinite().nonzero().flatten().tolist() == [int((-logp - entropy).abs().argmin())]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_same_kept_sets_as_transformers_on_random_rows(seed: int) -> None:
    """Many rows in one batch, each its own typical_p, some off, some logits already -inf."""
    pipe = SamplingPipeline.discover()
    rows, vocab = 48, 2000
    logits = _random_logits(rows, vocab, seed)
    g = torch.Generator().manual_seed(seed)
    values = [
        1.0 if i % 6 == 0 else round(float(torch.rand((), generator=g)) * 0.98 + 0.01, 3) for i in range(rows)
    ]
    params = [SamplingParams(extra={"typical_p": v}) for v in values]
    got = pipe.apply(logits.clone(), SamplingBatch.from_params(params, range(rows)))
    assert not got.isnan().any()
    for i, typical_p in enumerate(values):
        expected = _oracle(logits[i], typical_p)
        assert torch.equal(got[i].isfinite(), expected.isfinite()), (i, typical_p)
        assert torch.equal(got[i], expected), (i, typical_p)  # kept logits are the input's, bit for bit
    off = [i for i, v in enumerate(values) if v == 1.0]
    assert torch.equal(got[off], logits[off])  # typical_p 1: the row is left as it is, -inf included
    alone = pipe.apply(logits[3:4].clone(), SamplingBatch.from_params(params[3:4], [0]))
    assert torch.equal(alone[0], got[3])  # row-local: the other rows of the batch change nothing


def test_a_row_with_one_finite_logit_keeps_it() -> None:
    logits = torch.full((2, 50), float("-inf"))
    logits[:, 7] = 3.0
    params = [SamplingParams(extra={"typical_p": 0.3}), SamplingParams(extra={"typical_p": 0.999})]
    out = SamplingPipeline.discover().apply(logits.clone(), SamplingBatch.from_params(params, [0, 0]))
    assert torch.equal(out, logits)


def test_parameters_are_checked_at_admission() -> None:
    pipe = SamplingPipeline.discover()
    assert pipe.prepare(SamplingParams(extra={"typical_p": 0.2})).extra == {"typical_p": 0.2}
    assert pipe.prepare(SamplingParams(extra={"typical_p": 1})).extra == {"typical_p": 1}
    for bad in (0, 0.0, 1.5, -0.1, "high", float("nan"), math.inf, True):
        with pytest.raises(RequestRejected, match="typical_p"):
            pipe.prepare(SamplingParams(extra={"typical_p": bad}))


def test_configured_default_applies_to_requests_that_do_not_set_it() -> None:
    pipe = SamplingPipeline.discover(defaults={"typical_p": 0.9})
    assert pipe.prepare(SamplingParams()).extra == {"typical_p": 0.9}
    assert pipe.prepare(SamplingParams(extra={"typical_p": 1.0})).extra == {
        "typical_p": 1.0
    }  # the request wins
    for bad in (2, 0):
        with pytest.raises(PluginError, match="typical_p must be in"):
            SamplingPipeline.discover(defaults={"typical_p": bad})
    with pytest.raises(
        PluginError, match="'typical_pp' not found; misspelled or not installed\\? Installed: .*typical_p"
    ):
        SamplingPipeline.discover(defaults={"typical_pp": 0.1})


@pytest.mark.slow
def test_engine_one_typical_token_is_the_same_for_any_seed(plugin_engine: Any) -> None:
    sampled = {"temperature": 1.0, "max_tokens": 12}
    one = {plugin_engine.chat(FRANCE, seed=s, typical_p=ONLY_THE_MOST_TYPICAL, **sampled) for s in range(4)}
    assert len(one) == 1 and next(iter(one))
    assert len({plugin_engine.chat(FRANCE, seed=s, **sampled) for s in range(4)}) > 1  # without it: random
    assert (
        len({plugin_engine.chat(FRANCE, seed=s, typical_p=1.0, **sampled) for s in range(4)}) > 1
    )  # 1 is off
    with pytest.raises(RequestRejected, match="typical_p must be in"):
        plugin_engine.chat(FRANCE, typical_p=0.0)
    with pytest.raises(TypeError):
        plugin_engine.chat(FRANCE, typical_pp=1.0)  # a key no plugin claims is no sampling parameter


@pytest.mark.slow
def test_http_typical_p_per_request_and_by_config(served: Any) -> None:
    """``astrai serve --sampling typical_p=1e-9``: one token per step unless a request sets its own
    ``typical_p``."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(**kw: Any) -> str:
        r = client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=12, **kw)
        return r.choices[0].message.content

    assert len({ask(temperature=1.0, seed=s, extra_body={"top_k": 0}) for s in range(3)}) == 1
    free = {ask(temperature=1.0, seed=s, extra_body={"top_k": 0, "typical_p": 1.0}) for s in range(4)}
    assert len(free) > 1
    with pytest.raises(openai.BadRequestError, match="typical_p must be in"):
        ask(extra_body={"typical_p": 7})
    body = {
        "model": "astrai",
        "max_tokens": 4,
        "messages": FRANCE,
        "typical_p": 0,
    }  # Anthropic's request, too
    r = httpx.post(served.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "typical_p must be in (0, 1]" in r.json()["error"]["message"]
