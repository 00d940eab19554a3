"""The astrai-min-p sampling plugin, found through its entry point: vectorised rows, the engine, config, HTTP."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import openai
import pytest
import torch

from astrai.errors import PluginError, RequestRejected
from astrai.sampling import SamplingBatch, SamplingParams, SamplingPipeline

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _reference(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(row, dim=-1)
    return torch.where(probs >= probs.max() * min_p, row, torch.full_like(row, float("-inf")))


def test_installed_strategy_filters_each_row_with_its_own_min_p() -> None:
    pipe = SamplingPipeline.discover()
    assert type(pipe.extra["min_p"]).__module__ == "astrai_min_p"
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    params = [
        SamplingParams(extra={"min_p": 0.3}),
        SamplingParams(),  # does not select it: untouched by min-p
        SamplingParams(extra={"min_p": 0.05}, top_k=20),  # composes after top-k
        SamplingParams(strategy="min_p"),  # selected without a value: min_p 0 keeps the row
        SamplingParams(extra={"min_p": 1.0}, temperature=0.7),
    ]
    got = pipe.apply(logits.clone(), SamplingBatch.from_params(params, range(5)))
    plain = [dataclasses.replace(p, extra={}, strategy=None) for p in params]  # the same rows without min-p
    base = SamplingPipeline.default().apply(logits.clone(), SamplingBatch.from_params(plain, range(5)))
    torch.testing.assert_close(got[0], _reference(logits[0], 0.3))
    assert torch.equal(got[1], base[1]) and torch.equal(got[3], base[3])
    torch.testing.assert_close(got[2], _reference(base[2], 0.05))
    assert int(torch.isfinite(got[2]).sum()) < 20 and int(torch.isfinite(got[0]).sum()) < 300
    assert torch.isfinite(got[4]).sum() == 1 and got[4].argmax() == logits[4].argmax()


def test_parameters_are_checked_at_admission() -> None:
    pipe = SamplingPipeline.discover()
    assert pipe.prepare(SamplingParams(extra={"min_p": 0.2})).extra == {"min_p": 0.2}
    for bad in (1.5, -0.1, "high", float("nan")):
        with pytest.raises(RequestRejected, match="min_p"):
            pipe.prepare(SamplingParams(extra={"min_p": bad}))


def test_configured_default_applies_to_requests_that_do_not_set_it() -> None:
    pipe = SamplingPipeline.discover(defaults={"min_p": 0.1})
    assert pipe.prepare(SamplingParams()).extra == {"min_p": 0.1}
    assert pipe.prepare(SamplingParams(extra={"min_p": 0.0})).extra == {"min_p": 0.0}  # the request wins
    with pytest.raises(PluginError, match="min_p must be in"):
        SamplingPipeline.discover(defaults={"min_p": 2})
    with pytest.raises(PluginError, match="'min_pp' not found; misspelled or not installed\\? Installed: .*min_p"):
        SamplingPipeline.discover(defaults={"min_pp": 0.1})


@pytest.mark.slow
def test_engine_min_p_one_is_greedy_for_any_seed(plugin_engine: Any) -> None:
    greedy = plugin_engine.chat(FRANCE, temperature=0, max_tokens=12)
    sampled = {"temperature": 1.0, "max_tokens": 12}
    assert {plugin_engine.chat(FRANCE, seed=s, min_p=1.0, **sampled) for s in range(4)} == {greedy}
    assert len({plugin_engine.chat(FRANCE, seed=s, **sampled) for s in range(4)}) > 1  # without it: random
    with pytest.raises(TypeError):
        plugin_engine.chat(FRANCE, min_pp=1.0)  # a key no plugin claims is no sampling parameter


@pytest.mark.slow
def test_http_min_p_per_request_and_by_config(served: Any) -> None:
    """``astrai serve --sampling min_p=1.0``: greedy unless a request sets its own ``min_p``."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(**kw: Any) -> str:
        r = client.chat.completions.create(model="astrai", messages=FRANCE, max_tokens=12, **kw)
        return r.choices[0].message.content

    greedy = ask(temperature=0)
    assert {ask(temperature=1.0, seed=s, extra_body={"top_k": 0}) for s in range(3)} == {greedy}
    free = {ask(temperature=1.0, seed=s, extra_body={"top_k": 0, "min_p": 0.0}) for s in range(4)}
    assert len(free) > 1
    with pytest.raises(openai.BadRequestError, match="min_p must be in"):
        ask(extra_body={"min_p": 7})
    body = {"model": "astrai", "max_tokens": 4, "messages": FRANCE, "min_p": 7}  # Anthropic's request, too
    r = httpx.post(served.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and "min_p must be in [0, 1]" in r.json()["error"]["message"]
