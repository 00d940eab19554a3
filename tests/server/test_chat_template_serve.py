"""``--chat-template`` and ``--generation-config`` through real ``astrai serve`` processes, on a tiny
base model (an HF folder: the default model's tokenizer without its chat template, random llama
weights, and a ``generation_config.json`` that asks for greedy search)."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

FORBIDDEN = "no forbidden words"
TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'forbidden' %}{{ raise_exception('" + FORBIDDEN + "') }}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: A chat request of each protocol whose user message is ``content``.
ROUTES = {
    "/v1/chat/completions": lambda content: {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    },
    "/v1/responses": lambda content: {"input": content, "max_output_tokens": 4},
    "/v1/messages": lambda content: {"messages": [{"role": "user", "content": content}], "max_tokens": 4},
}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, default_model_path):
    """An HF folder of a tiny random llama with the default model's tokenizer and no chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from astrai.model.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("base-model")
    tokenizer = Tokenizer.from_gguf(default_model_path)
    tokenizer.hf.chat_template = None
    tokenizer.hf.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer.hf),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)  # transformers' init: nearly uniform next tokens
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}))
    return folder


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "strict.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def servers(start_servers, base_model, template_file):
    """(the base model as it is, with ``--generation-config none``; the same with ``--chat-template``)."""
    return start_servers(
        ("--model", str(base_model), "--generation-config", "none"),
        ("--model", str(base_model), "--chat-template", str(template_file)),
    )


def _card(url: str) -> dict:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]


def _error_message(route: str, response: httpx.Response) -> str:
    """The message of a 400 in the route's protocol's shape (Anthropic's, else OpenAI's)."""
    assert response.status_code == 400, response.text
    body = response.json()
    if route == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_base_model_completes_but_its_chats_are_400s_that_say_how(servers, route):
    bare = servers[0].url
    done = httpx.post(bare + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert done.status_code == 200, done.text
    message = _error_message(route, httpx.post(bare + route, json=ROUTES[route]("Hello"), timeout=60))
    assert "no chat template" in message and "--chat-template" in message


def test_models_show_the_active_template_and_defaults(servers, template_file):
    bare, templated = (_card(s.url) for s in servers)
    assert bare["chat_template"] is None and bare["generation_defaults"] == {}
    sha = hashlib.sha256(TEMPLATE.encode()).hexdigest()
    assert templated["chat_template"] == {"source": f"file:{template_file.resolve()}", "sha256": sha}
    assert templated["generation_defaults"] == {"temperature": 0.0}  # do_sample false
    assert "generation defaults from" in servers[1].log()


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_template_that_fails_on_a_request_is_a_400_naming_its_error(servers, route):
    url = servers[1].url
    assert httpx.post(url + route, json=ROUTES[route]("Hello"), timeout=60).status_code == 200
    message = _error_message(route, httpx.post(url + route, json=ROUTES[route]("forbidden"), timeout=60))
    assert "chat template" in message and f"TemplateError: {FORBIDDEN}" in message


def _texts(url: str, route: str, **fields) -> list[str]:
    """The text of four requests to ``route`` with ``fields`` (and seeds 0 to 3 where it takes one)."""
    out = []
    for seed in range(4):
        body = {"prompt": "Once upon a time", "max_tokens": 8, "seed": seed, **fields}
        if route == "/v1/messages":
            body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
            del body["seed"]  # Anthropic's API has none
        r = httpx.post(url + route, json=body, timeout=60)
        assert r.status_code == 200, r.text
        j = r.json()
        out.append(j["content"][0]["text"] if route == "/v1/messages" else j["choices"][0]["text"])
    return out


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/messages"])
def test_generation_config_defaults_fill_what_a_request_leaves_out(servers, route):
    bare, templated = (s.url for s in servers)
    greedy = _texts(templated, route, temperature=0.0)
    assert len(set(greedy)) == 1
    assert _texts(templated, route) == greedy  # do_sample false: greedy unless asked otherwise
    assert set(_texts(templated, route, temperature=1.0)) != set(greedy)  # a value sent wins
    if route == "/v1/completions":  # --generation-config none: the API's temperature 1
        assert set(_texts(bare, route)) != set(_texts(bare, route, temperature=0.0))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{% for %}", "chat template inline: line 1: "),
        ("missing.jinja", "chat template missing.jinja: no such file"),
    ],
    ids=["syntax-error", "missing-file"],
)
def test_a_template_that_cannot_serve_stops_the_start(start_server, value, says):
    served = start_server("--chat-template", value, healthy=False)
    assert served.proc.wait(120) == 2
    assert f"astrai serve: error: {says}" in served.log()
