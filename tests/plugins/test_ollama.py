"""The astrai-ollama protocol plugin, installed and served by ``astrai serve``, through the official
``ollama`` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest

from astrai.errors import RequestRejected
from astrai.protocol import chat_prompt_ids, load_protocols

pytestmark = pytest.mark.slow  # the real default model

QUESTION = "What is the capital of France?"
FRANCE = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def client(served: Any) -> ollama.Client:
    return ollama.Client(host=served.url, timeout=120)


def test_chat_non_streaming(client: ollama.Client) -> None:
    r = client.chat(model="astrai", messages=FRANCE, options=GREEDY)
    assert r.model == "astrai" and r.done and r.message.role == "assistant"
    assert "Paris" in r.message.content
    assert r.done_reason in ("stop", "length") and 0 < r.eval_count <= 12
    assert r.prompt_eval_count > 5 and r.total_duration > 0


def test_chat_streaming_matches_non_streaming(client: ollama.Client) -> None:
    whole = client.chat(model="astrai", messages=FRANCE, options=GREEDY)
    parts = list(client.chat(model="astrai", messages=FRANCE, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason


@pytest.mark.parametrize(
    ("route", "body", "piece"),
    [("/api/chat", {"messages": FRANCE}, "message"), ("/api/generate", {"prompt": QUESTION}, "response")],
    ids=["chat", "generate"],
)
def test_stream_is_the_default_and_is_ndjson(
    served: Any, route: str, body: dict[str, Any], piece: str
) -> None:
    r = httpx.post(served.url + route, json={"model": "astrai", **body, "options": GREEDY}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert len(lines) > 2 and lines[-1]["done"] is True and not any(x["done"] for x in lines[:-1])
    assert r.text.endswith("\n")
    assert all(set(x) == {"model", "created_at", piece, "done"} for x in lines[:-1])
    assert set(lines[-1]) == {
        "model",
        "created_at",
        piece,
        "done",
        "done_reason",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    }


def test_list_models(client: ollama.Client) -> None:
    model, embedder = client.list().models  # the chat model, then the --embedding-model
    assert (model.model, embedder.model) == ("astrai", "minilm-l6")
    assert embedder.details.family == "bert" and embedder.details.parameter_size == "23M"
    assert model.details.family == "llama" and model.details.parameter_size == "135M"
    # the weights' bytes in memory: at least half a byte a parameter (GGUF's 4-bit blocks kept), at most
    # four (dense float32)
    assert 0.5 * 135e6 < model.size <= 4 * 136e6 and model.modified_at is not None


def test_errors_are_ollama_shaped(client: ollama.Client, served: Any) -> None:
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model="astrai", messages=FRANCE, options={"typical_p": 3})
    assert bad.value.status_code == 400 and "typical_p must be in (0, 1]" in bad.value.error
    r = httpx.post(served.url + "/api/chat", json={"model": "astrai", "messages": []}, timeout=30)
    assert r.status_code == 422 and set(r.json()) == {"error"} and "messages" in r.json()["error"]


def test_options_reach_sampling_and_plugins(client: ollama.Client) -> None:
    """The server runs with --sampling typical_p=1e-9: sampled requests take one token per step
    whatever their seed, unless they set typical_p (an Ollama option, too)."""
    seeded = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_predict": 12}
    filtered = {
        client.chat(model="astrai", messages=FRANCE, options={**seeded, "seed": s}).message.content
        for s in range(3)
    }
    assert len(filtered) == 1
    free = {
        client.chat(
            model="astrai", messages=FRANCE, options={**seeded, "seed": s, "typical_p": 1.0}
        ).message.content
        for s in range(4)
    }
    assert len(free) > 1


def test_generate_non_streaming_is_the_chat_of_one_user_message(client: ollama.Client) -> None:
    r = client.generate(model="astrai", prompt=QUESTION, options=GREEDY)
    assert r.model == "astrai" and r.done and "Paris" in r.response
    assert r.done_reason in ("stop", "length") and 0 < r.eval_count <= 12
    assert r.total_duration > 0 and r.load_duration == 0
    assert (
        r.prompt_eval_duration is None and r.eval_duration is None
    )  # a whole response never sees its first piece
    chat = client.chat(model="astrai", messages=FRANCE, options=GREEDY)
    assert (r.response, r.prompt_eval_count, r.eval_count) == (
        chat.message.content,
        chat.prompt_eval_count,
        chat.eval_count,
    )


def test_generate_streaming_matches_non_streaming(client: ollama.Client) -> None:
    whole = client.generate(model="astrai", prompt=QUESTION, options=GREEDY)
    parts = list(client.generate(model="astrai", prompt=QUESTION, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.response for p in parts) == whole.response
    last = parts[-1]
    assert last.response == "" and (last.eval_count, last.done_reason) == (
        whole.eval_count,
        whole.done_reason,
    )
    assert last.prompt_eval_count == whole.prompt_eval_count
    assert 0 < last.prompt_eval_duration and 0 < last.eval_duration
    assert last.prompt_eval_duration + last.eval_duration <= last.total_duration


def test_generate_system_goes_before_the_prompt_in_the_template(client: ollama.Client) -> None:
    system = "You answer in one word."
    r = client.generate(model="astrai", prompt=QUESTION, system=system, options=GREEDY, keep_alive="5m")
    messages = [{"role": "system", "content": system}, *FRANCE]
    chat = client.chat(model="astrai", messages=messages, options=GREEDY)
    assert (r.response, r.prompt_eval_count) == (chat.message.content, chat.prompt_eval_count)
    plain = client.generate(model="astrai", prompt=QUESTION, options=GREEDY)
    assert r.prompt_eval_count != plain.prompt_eval_count  # it replaces the template's default system message


def test_generate_raw_encodes_the_prompt_as_written(client: ollama.Client, real_model: tuple) -> None:
    prompt = "The capital of France is"
    r = client.generate(model="astrai", prompt=prompt, raw=True, options=GREEDY)
    assert r.prompt_eval_count == len(real_model[1].encode(prompt, add_special_tokens=False))  # no template
    assert "Paris" in r.response
    parts = list(client.generate(model="astrai", prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("suffix", {"suffix": " is the answer."}),
        ("format", {"format": "json"}),
        ("template", {"template": "{{ .Prompt }}"}),
        ("context", {"context": [1, 2, 3]}),
        ("think", {"think": True}),
        ("system", {"system": "Be brief.", "raw": True}),
    ],
    ids=["suffix", "format", "template", "context", "think", "system-with-raw"],
)
def test_generate_refuses_fields_it_cannot_honour(
    client: ollama.Client, field: str, kw: dict[str, Any]
) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="astrai", prompt=QUESTION, options=GREEDY, **kw)
    assert refused.value.status_code == 400 and field in refused.value.error


def test_generate_refusals_are_ollama_shaped(served: Any) -> None:
    def post(**body: Any) -> httpx.Response:
        return httpx.post(
            served.url + "/api/generate", json={"model": "astrai", "stream": False, **body}, timeout=120
        )

    for body in ({"prompt": QUESTION, "images": ["aGVsbG8="]}, {"prompt": ""}, {}):
        r = post(**body)
        assert r.status_code == 400 and set(r.json()) == {"error"}, body
    assert "images" in post(prompt=QUESTION, images=["aGVsbG8="]).json()["error"]
    assert "prompt must not be empty" in post().json()["error"]
    r = httpx.post(served.url + "/api/generate", json={"prompt": QUESTION}, timeout=30)
    assert r.status_code == 422 and "model" in r.json()["error"]


def test_generate_request_checks_its_fields_without_http(real_model: tuple) -> None:
    """The builder refuses on its own (a server may refuse unknown fields before it): set
    unsupported fields, an empty prompt, ``system`` with ``raw``; null or empty ones pass."""
    tokenizer = real_model[1]
    request_model = load_protocols().classes["ollama_generate"].request_model

    def prompt_ids(**body: Any) -> list[int]:
        return request_model.model_validate({"model": "astrai", **body}).prompt_ids(tokenizer)

    assert prompt_ids(prompt=QUESTION, images=[], format="", context=None) == chat_prompt_ids(
        tokenizer, FRANCE
    )
    assert prompt_ids(prompt=QUESTION, raw=True) == tokenizer.encode(QUESTION, add_special_tokens=False)
    for name, value in (
        ("images", ["aGk="]),
        ("format", {"type": "object"}),
        ("think", False),
        ("logprobs", True),
    ):
        with pytest.raises(RequestRejected, match=f"^{name} is not supported"):
            prompt_ids(prompt=QUESTION, **{name: value})
    with pytest.raises(RequestRejected, match="prompt must not be empty"):
        prompt_ids()
    with pytest.raises(RequestRejected, match="system cannot be honoured with raw"):
        prompt_ids(prompt=QUESTION, system="Be brief.", raw=True)


def test_core_options_map_onto_sampling(client: ollama.Client) -> None:
    """min_p and repeat_penalty are core parameters now: they change greedy/sampled answers as asked."""
    plain = client.chat(model="astrai", messages=FRANCE, options=GREEDY).message.content
    same = client.chat(
        model="astrai", messages=FRANCE, options={**GREEDY, "min_p": 0.5, "num_ctx": 4096}
    ).message.content
    assert same == plain  # min_p never changes a greedy answer; num_ctx is a resource hint
    penalised = client.chat(
        model="astrai", messages=FRANCE, options={**GREEDY, "num_predict": 24, "repeat_penalty": 2.0}
    )
    longer = client.chat(model="astrai", messages=FRANCE, options={**GREEDY, "num_predict": 24})
    assert penalised.message.content != longer.message.content


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"options": {**GREEDY, "mirostat": 2}}, "options.mirostat"),
        ({"options": {**GREEDY, "repeat_last_n": 64}}, "options.repeat_last_n"),
        ({"format": "json"}, "format"),
        ({"think": True}, "think"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
            "tools",
        ),
        ({"messages": [{"role": "user", "content": QUESTION, "images": ["aGVsbG8="]}]}, "messages[0].images"),
    ],
    ids=["unknown-option", "repeat_last_n", "format", "think", "tools", "images"],
)
def test_chat_refuses_what_it_cannot_honour(client: ollama.Client, kw: dict[str, Any], field: str) -> None:
    args = {"model": "astrai", "messages": FRANCE, "options": GREEDY, **kw}
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(**args)
    assert refused.value.status_code == 400 and field in refused.value.error


def test_embed_gives_sentence_transformers_vectors(client: ollama.Client) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    from astrai.model.resolve import resolve_model

    texts = ["Why is the sky blue?", "Rayleigh scattering makes the sky look blue."]
    r = client.embed(model="minilm-l6", input=texts)
    oracle = SentenceTransformer(str(resolve_model("minilm-l6")[1]), device="cpu")
    want = oracle.encode(texts, convert_to_tensor=True)
    got = torch.tensor(r.embeddings)
    assert got.shape == (2, 384) and r.model == "minilm-l6"
    assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.9999
    assert r.prompt_eval_count == sum(map(len, oracle.tokenizer(texts)["input_ids"]))  # [CLS] ... [SEP] each
    one = client.embed(model="minilm-l6", input=texts[0])
    assert torch.tensor(one.embeddings).shape == (1, 384)


def test_embed_cuts_a_long_input_unless_truncate_is_false(client: ollama.Client, served: Any) -> None:
    long = "a long input for a small model " * 80
    r = client.embed(model="minilm-l6", input=long)
    assert r.prompt_eval_count == 256
    refused = httpx.post(
        served.url + "/api/embed", json={"model": "minilm-l6", "input": long, "truncate": False}, timeout=30
    )
    assert refused.status_code == 400 and refused.json() == {
        "error": "an input is longer than the model's 256 tokens"
    }
    chat = httpx.post(served.url + "/api/embed", json={"model": "astrai", "input": "x"}, timeout=30)
    assert chat.status_code == 400
    assert chat.json() == {"error": "model 'astrai' does not embed; embedding models: minilm-l6"}
