"""A mixture-of-experts model behind the real server: the tiny random Qwen3-MoE of the family tests
(``families``), written as llama.cpp writes it with its experts in Q8_0 (kept quantized: the grouped
expert kernel where astrai-backend-cpu lends it), served by ``astrai serve`` with n-gram speculation.

What a client sees is transformers' model of the file's weights (``gguf_families.reference``): a
chat answer's greedy tokens (each one's ``bytes``: random bytes are seldom whole characters) and
their log-probabilities, and speculation's drafts verified without changing a token;
structured output holds the model to a choice and to a JSON schema. The KV pool holds nothing once
the requests are done (``/stats``)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from families import clear_prefix, prompts

MODEL = "tiny-moe"


#: the file has no chat template: each message's text, as it is
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def moe(family_gguf, start_server):
    """(the server, transformers' model of the file it serves)."""
    path, reference = family_gguf("qwen3_moe", "Q8_0")
    flags = ["--model", str(path), "--served-model-name", MODEL, "--chat-template", TEMPLATE]
    served = start_server(*flags, "--speculative", "ngram", "--ngram-max", "3")
    return served, reference


def _post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _token_bytes(path) -> list[bytes]:
    """Every token's bytes, from the file's byte-level BPE vocabulary."""
    from gguf import GGUFReader
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    return [bytes(byte_of[c] for c in t) if not t.startswith("<") else t.encode() for t in tokens]


@pytest.mark.parametrize("text", ["the heat is on; the heat is on; the heat", "a tiny mixture of experts"])
def test_greedy_tokens_and_their_logprobs_are_transformers(moe, family_gguf, text) -> None:
    """A chat answer's tokens (their ``bytes``) and log-probs are transformers' greedy ones. Asked
    again without log-probs (which speculation serves: the first prompt repeats itself, so that the
    n-gram proposer drafts from the first decode step on), the answer is the same text."""
    served, hf = moe
    vocab = _token_bytes(family_gguf("qwen3_moe", "Q8_0")[0])
    before = served.stats()
    messages = [{"role": "user", "content": text}]
    prompt = _post(served.url, "/tokenize", {"messages": messages})["tokens"]
    want, clear = clear_prefix(hf, prompt, 24)
    assert clear >= 8, f"transformers' greedy path is a near tie after {clear} tokens"
    body = {"messages": messages, "max_tokens": clear, "temperature": 0, "ignore_eos": True}
    answer = _post(served.url, "/v1/chat/completions", body | {"logprobs": True, "top_logprobs": 2})
    content = answer["choices"][0]["logprobs"]["content"]
    assert [bytes(entry["bytes"]) for entry in content] == [vocab[t] for t in want[:clear]]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + want[: clear - 1]])).logits[0, len(prompt) - 1 :]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(want[:clear]).unsqueeze(1)).squeeze(1)
    got = torch.tensor([entry["logprob"] for entry in content])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    again = _post(served.url, "/v1/chat/completions", body)
    assert again["choices"][0]["message"] == answer["choices"][0]["message"]
    assert again["usage"]["completion_tokens"] == clear
    stats = served.wait_idle()
    if "heat" in text:
        assert stats["spec_drafts"] > before["spec_drafts"]
    assert stats["kv_tokens_in_use"] == 0  # (the prefix cache keeps its pages, not counted in use)


def test_structured_output_holds_the_model_to_a_choice_and_a_schema(moe) -> None:
    served, _ = moe
    prompt = prompts(1, seed=8)[0]  # token ids
    choices = ["alpha", "beta gamma"]
    for seed in range(3):  # sampled: whatever the model draws, the grammar allows only the choices
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": seed}
        choice = _post(served.url, "/v1/completions", body | {"structured_outputs": {"choice": choices}})[
            "choices"
        ][0]
        assert choice["text"] in choices and choice["finish_reason"] == "stop"
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer", "maximum": 9}},
        "required": ["colour", "n"],
        "additionalProperties": False,
    }
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0}
    constraint = {"json": schema, "disable_any_whitespace": True}
    choice = _post(served.url, "/v1/completions", body | {"structured_outputs": constraint})["choices"][0]
    value = json.loads(choice["text"])
    assert set(value) == {"colour", "n"} and value["colour"] in ("red", "green")
    assert isinstance(value["n"], int) and value["n"] <= 9
    assert choice["finish_reason"] == "stop"
    stats = served.wait_idle()
    assert stats["kv_tokens_in_use"] == 0
