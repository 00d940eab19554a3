"""LoRA adapters through a real ``astrai serve --lora ...``: the official ``openai`` and ``anthropic``
SDKs name adapters in ``model`` and get peft's text; ``/v1/models`` lists them with their parent;
adapters loaded and unloaded over HTTP (vLLM's routes) behind the operator's key, with the errors
of each refusal; per-adapter metrics."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from lora_adapters import PROMPT, N, write_gguf_lora

pytestmark = pytest.mark.slow  # the real default model, peft as the oracle

USER, OPS = "user-key", "ops-key"


@pytest.fixture(scope="module")
def gguf_a1(lora_oracle, tmp_path_factory, real_model):
    config = real_model[0].config
    path = tmp_path_factory.mktemp("gguf-lora") / "a1.gguf"
    return write_gguf_lora(
        lora_oracle.folders["a1"], path, config.num_attention_heads, config.num_key_value_heads
    )


@pytest.fixture(scope="module")
def served(start_server, lora_oracle, gguf_a1):
    return start_server(
        "--lora",
        f"a1={lora_oracle.folders['a1']}",
        "--lora",
        f"a1-gguf={gguf_a1}",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "16",
        "--api-key",
        USER,
        "--admin-api-key",
        OPS,
    )


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=USER, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(lora_oracle, real_model):
    """Adapter -> peft's greedy text after PROMPT."""
    tokenizer = real_model[1]
    ids = tokenizer.encode(PROMPT)
    out = {}
    for name in ("a1", "a2", "a3", None):
        tokens, _, margin = lora_oracle.greedy(name, ids, N)
        assert margin > 1e-3
        out[name] = tokenizer.decode(tokens)
    return ids, out


def _complete(client, model: str, ids: list[int]) -> str:
    reply = client.completions.create(
        model=model, prompt=ids, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.model == model
    return reply.choices[0].text


def _admin(served, route: str, body: dict, key: str | None = OPS) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(served.url + route, json=body, headers=headers, timeout=120)


def _idle(served) -> None:
    """Wait until no request runs (the metrics and the adapters' counts are final then)."""
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(
            served.url + "/stats", headers={"Authorization": f"Bearer {OPS}"}, timeout=10
        ).json()
        if not stats["active_tasks"] and not stats["waiting_queue"]:
            return
        time.sleep(0.1)
    pytest.fail("the engine is still busy")


def test_models_lists_the_adapters_with_their_parent(client, lora_oracle, gguf_a1):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["astrai", "a1", "a1-gguf"]
    assert cards["astrai"].model_extra["parent"] is None
    assert cards["a1"].model_extra["parent"] == "astrai"
    assert cards["a1"].model_extra["root"] == str(lora_oracle.folders["a1"])
    assert cards["a1-gguf"].model_extra["root"] == str(gguf_a1)
    assert client.models.retrieve("a1").model_extra["lora_rank"] == 8


def test_the_adapter_named_in_model_is_the_one_that_answers(client, expected):
    ids, text = expected
    assert _complete(client, "a1", ids) == text["a1"]
    assert _complete(client, "a1-gguf", ids) == text["a1"]  # llama.cpp's file of the same weights
    assert _complete(client, "astrai", ids) == text[None]
    assert text["a1"] != text[None]
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a1"
    response = client.responses.create(model="a1", input="Hi", max_output_tokens=4, temperature=0)
    assert response.model == "a1"


def test_an_unknown_model_is_each_protocols_404(client, served):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert err.value.code == "model_not_found"
    assert "nope" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    claude = anthropic.Anthropic(base_url=served.url, api_key=USER, max_retries=0, timeout=120)
    with pytest.raises(anthropic.NotFoundError) as aerr:
        claude.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert aerr.value.body["error"]["type"] == "not_found_error"
    reply = claude.messages.create(model="a1", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert reply.model == "a1"


def test_load_and_unload_over_http(client, served, lora_oracle, expected):
    ids, text = expected
    a2 = {"lora_name": "a2", "lora_path": str(lora_oracle.folders["a2"])}
    assert _admin(served, "/v1/load_lora_adapter", a2, key=None).status_code == 401
    refused = _admin(served, "/v1/load_lora_adapter", a2, key=USER)  # a tenant's key: operators only
    assert refused.status_code == 403
    loaded = _admin(served, "/v1/load_lora_adapter", a2)
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'a2' added successfully.")
    assert _complete(client, "a2", ids) == text["a2"]
    again = _admin(served, "/v1/load_lora_adapter", a2)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "an adapter named 'a2' is loaded already; unload it first"
    assert _complete(client, "a1-gguf", ids) == text["a1"]  # a1 is now the least recently used
    # a fourth adapter past --max-loras 3: the least recently used idle one (a1) goes
    a3 = {"lora_name": "a3", "lora_path": str(lora_oracle.folders["a3"])}
    assert _admin(served, "/v1/load_lora_adapter", a3).status_code == 200
    assert [m.id for m in client.models.list().data] == ["astrai", "a1-gguf", "a2", "a3"]
    assert _complete(client, "a3", ids) == text["a3"]
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "a1", ids)
    assert err.value.body["message"] == "The model `a1` does not exist or you do not have access to it."
    gone = _admin(served, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'a3' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a3", ids)
    missing = _admin(served, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    # a1 back for the other tests
    a1 = {"lora_name": "a1", "lora_path": str(lora_oracle.folders["a1"])}
    assert _admin(served, "/v1/load_lora_adapter", a1).status_code == 200
    _idle(served)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"lora_name": "x", "lora_path": "/no/such/adapter"},
            "no LoRA adapter at /no/such/adapter: the path does not exist",
        ),
        (
            {"lora_name": "astrai", "lora_path": "/tmp"},
            "'astrai' is the base model's name; give the adapter another",
        ),
        (
            {"lora_name": "x", "lora_path": "/tmp"},
            "/tmp is not a LoRA adapter: it has no adapter_config.json",
        ),
        ({"lora_name": "x"}, "lora_path: Field required"),
    ],
)
def test_bad_loads_are_400s_that_say_why(served, body, message):
    reply = _admin(served, "/v1/load_lora_adapter", body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == message


def test_a_rank_over_the_limit_is_refused(served, lora_oracle):
    # a2 is rank 16 (the limit): a copy claiming rank 32 with tensors to match is refused
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = lora_oracle.folders["a2"].parent / "a2-r32"
    shutil.copytree(lora_oracle.folders["a2"], folder, dirs_exist_ok=True)
    tensors = load_file(folder / "adapter_model.safetensors")
    import torch

    wide = {k: torch.cat([v, v], dim=0 if ".lora_A" in k else 1) for k, v in tensors.items()}
    save_file(wide, folder / "adapter_model.safetensors")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    reply = _admin(served, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(folder)})
    assert reply.status_code == 400
    assert "rank 32, over --max-lora-rank 16" in reply.json()["error"]["message"]


def test_metrics_count_each_adapter(client, served, expected):
    ids, _ = expected
    _complete(client, "a1-gguf", ids)
    _idle(served)
    text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {OPS}"}, timeout=30).text
    lines = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("astrai:lora")
    }
    assert lines['astrai:lora_requests_total{model_name="a1-gguf",parent="astrai"}'] >= 2
    assert lines['astrai:lora_generation_tokens_total{model_name="a1-gguf",parent="astrai"}'] >= 2 * N
    assert lines['astrai:lora_requests_in_flight{model_name="a1-gguf",parent="astrai"}'] == 0
