"""The app and the handler over real HTTP with a scripted fake engine: no model, so these are fast and
can script what a real model will not do on demand (mid-stream failures, dead schedulers, exact pieces)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from astrai.errors import PluginError, RequestRejected
from astrai.protocol import ChatResult, Prepared, ResponseBuilder
from astrai.sampling import SamplingParams
from astrai_server import ServerSettings, create_app
from astrai_server.protocols.anthropic import AnthropicResponseBuilder
from astrai_server.protocols.openai import OpenAIResponseBuilder
from astrai_server.registry import check_builder_class, load_protocols, select_builders

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _events(body: str) -> list[Any]:
    out = []
    for frame in body.split("\n\n")[:-1]:
        data = frame.split("data: ", 1)[1]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _post(url: str, path: str, body: dict, **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10, **kw)


def test_n_choices_with_consecutive_seeds_stream_interleaved(fakes: Any) -> None:
    engine = fakes.FakeEngine([fakes.Script(["a", "b"]), fakes.Script(["c"], finish="length")])
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "n": 2,
            "seed": 10,
            "stream": True,
            "max_tokens": 3,
        }
        events = _events(_post(url, CHAT, body).text)
    assert [p.seed for _, p in engine.submitted] == [10, 11]
    chunks = [e["choices"] for e in events[:-2]]
    assert chunks[:2] == [
        [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}] for i in (0, 1)
    ]
    text = {
        i: "".join(c[0]["delta"].get("content", "") for c in chunks if c[0]["index"] == i) for i in (0, 1)
    }
    assert text == {0: "ab", 1: "c"}
    assert chunks[-2:] == [
        [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        [{"index": 1, "delta": {}, "finish_reason": "length"}],
    ]
    assert (
        events[-2]["usage"]
        == {
            "prompt_tokens": 3,
            "completion_tokens": 3,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        and events[-1] == "[DONE]"
    )


def test_streamed_tool_call_is_never_sent_as_text(fakes: Any) -> None:
    pieces = [
        "Checking",
        " <tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Rome"}}\n</tool_call>',
    ]
    engine = fakes.FakeEngine([fakes.Script(pieces), fakes.Script(pieces)], ctx=512)
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "stream": True}
        events = _events(_post(url, CHAT, body).text)
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "get_weather"}],
            "stream": True,
        }
        anthropic = _events(_post(url, "/v1/messages", body).text)
    sent = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"])
    assert sent == "Checking "
    call = events[-4]["choices"][0]["delta"]["tool_calls"][0]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather",
        {"city": "Rome"},
    )
    assert events[-3]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]
    types = [e["type"] if isinstance(e, dict) else e for e in anthropic]
    assert types == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "[DONE]",
    ]
    assert anthropic[8]["delta"]["stop_reason"] == "tool_use"


def test_required_tool_call_is_opened_in_the_prompt_and_ends_at_the_closing_tag(fakes: Any) -> None:
    """The prompt ends with the opening, the rest is constrained to a call of an offered tool (a grammar the
    server compiles before submitting), and the closing tag stops it."""
    opening = "<tool_call>\n"
    call = fakes.Script(
        ['{"name": "get_weather", ', '"arguments": {"city": "Rome"}}'],
        finish="stop_sequence",
        stop_sequence="</tool_call>",
    )
    junk = fakes.Script(["I think", " not"], finish="stop_sequence", stop_sequence="</tool_call>")
    engine = fakes.FakeEngine([call, junk, call, junk], ctx=512)
    msg = [{"role": "user", "content": "x"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        ok = _post(url, CHAT, {"messages": msg, "tools": TOOLS, "tool_choice": named}).json()
        bad = _post(url, CHAT, {"messages": msg, "tools": TOOLS, "tool_choice": "required"}).json()
        body = {
            "messages": msg,
            "tools": [{"name": "get_weather"}],
            "tool_choice": {"type": "any"},
            "stream": True,
        }
        streamed = _events(_post(url, "/v1/messages", body).text)
        body["tool_choice"] = {"type": "tool", "name": "get_weather"}
        streamed_bad = _events(_post(url, "/v1/messages", body).text)
    plain = engine.tokenizer.encode(
        engine.tokenizer.render(msg) + "\nassistant:"
    )  # without the tools' description
    for prompt, params in engine.submitted:
        assert prompt[-len(engine.tokenizer.encode(opening)) :] == engine.tokenizer.encode(opening) and len(
            prompt
        ) > len(plain)
        assert params.stop == ["</tool_call>"]
        schema = json.loads(params.grammar.value)
        assert params.grammar.kind == "json_schema" and schema["properties"]["name"] == {
            "const": "get_weather"
        }
        assert schema["required"] == ["name", "arguments"]
    assert engine.compiled == [params.grammar for _, params in engine.submitted]
    (choice,) = ok["choices"]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
    fn = choice["message"]["tool_calls"][0]["function"]
    assert (fn["name"], json.loads(fn["arguments"])) == ("get_weather", {"city": "Rome"})
    assert ok["usage"]["completion_tokens"] == 2
    # not a call after all: the answer is text, opening included, and the closing tag is no client stop string
    assert bad["choices"][0]["finish_reason"] == "stop"
    assert bad["choices"][0]["message"] == {"role": "assistant", "content": opening + "I think not"}
    blocks = [
        e["content_block"] for e in streamed if isinstance(e, dict) and e["type"] == "content_block_start"
    ]
    assert blocks[1]["type"] == "tool_use" and blocks[1]["name"] == "get_weather"
    assert streamed[-3]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    text = "".join(
        e["delta"]["text"] for e in streamed_bad if isinstance(e, dict) and e["type"] == "content_block_delta"
    )
    assert text == opening + "I think not"
    assert streamed_bad[-3]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


@pytest.mark.parametrize("path", [CHAT, "/v1/messages"])
def test_engine_failure_is_reported_in_the_protocol_shape(fakes: Any, path: str) -> None:
    fail = RuntimeError("CUDA exploded at /secret/path.py line 3")
    engine = fakes.FakeEngine([fakes.Script(["ok"], error=fail), fakes.Script(["ok"], error=fail)])
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        r = _post(url, path, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        stream = _post(
            url, path, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
        )
    assert r.status_code == 500 and "secret" not in r.text and "Traceback" not in r.text
    last = stream.text.split("\n\n")[-2]
    if path == CHAT:
        assert r.json()["error"]["type"] == "server_error"
        assert json.loads(last.removeprefix("data: "))["error"]["type"] == "server_error"
    else:
        assert r.json()["error"]["type"] == "api_error"
        assert (
            last.startswith("event: error\ndata: ") and json.loads(last.split("data: ")[1])["type"] == "error"
        )
    assert "secret" not in stream.text


def test_health_and_routes_before_the_engine_and_after_the_scheduler_died(fakes: Any) -> None:
    app = create_app(ServerSettings(), None)
    with fakes.serve_app(app) as url:
        health = httpx.get(url + "/health")
        assert (health.status_code, health.json()) == (503, {"detail": "Engine not initialized"})
        assert httpx.get(url + "/stats").status_code == 503
        r = _post(url, "/v1/messages", {"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        app.state.engine = engine = fakes.FakeEngine()
        assert httpx.get(url + "/health").json() == {"status": "ok", "model_loaded": True}
        engine.healthy = False  # the scheduler thread died
        assert httpx.get(url + "/health").status_code == 503
        assert _post(url, CHAT, {"messages": [{"role": "user", "content": "x"}]}).status_code == 503


def test_limits_default_max_tokens_shrinks_bad_logit_bias_and_long_prompt_are_400(fakes: Any) -> None:
    engine = fakes.FakeEngine(ctx=16)
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        assert _post(url, CHAT, {"messages": [{"role": "user", "content": "a b c"}]}).status_code == 200
        assert engine.submitted[-1][1].max_tokens == 16 - 5  # "user: a b c\nassistant:" is 5 tokens
        r = _post(url, CHAT, {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"100": 1}})
        assert r.status_code == 400  # the engine's check at submit, in the protocol's error shape
        assert r.json()["error"]["message"] == "logit_bias token ids must be < vocab size 100"
        r = _post(url, "/v1/messages", {"messages": [{"role": "user", "content": "w " * 20}]})
        assert r.status_code == 400
        assert "22 tokens" in r.json()["error"]["message"] and "16 tokens" in r.json()["error"]["message"]
    assert len(engine.submitted) == 1


def test_client_disconnect_aborts_the_engine_request(fakes: Any) -> None:
    slow = [fakes.Script(["x"] * 200, delay=0.05) for _ in range(2)]
    engine = fakes.FakeEngine(slow)
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "x"}]}, timeout=0.3)
        with httpx.stream(
            "POST", url + CHAT, json={"messages": [{"role": "user", "content": "x"}], "stream": True}
        ) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 3
        while not all(res.done for res in engine.results) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [res.finish_reason for res in engine.results] == ["abort", "abort"]
    assert all(len(res.pieces) < 100 for res in engine.results)


class EchoRequest(BaseModel):
    text: str


class EchoResponseBuilder(ResponseBuilder):
    """A third protocol in one class: proof that the server mounts builders it has never heard of."""

    name = "echo"
    route = "/v1/echo"
    request_model = EchoRequest
    stream_media_type = "application/x-ndjson"

    def prepare(self, request: EchoRequest, engine: Any) -> Prepared:
        ids = engine.tokenizer.encode(request.text)
        return Prepared(request=request, prompt_ids=ids, params=SamplingParams(max_tokens=4), stream=True)

    def format_stream_start(self, prepared: Prepared) -> list[str]:
        return []

    def format_chunk(self, prepared: Prepared, index: int, text: str) -> list[str]:
        return [json.dumps({"t": text}) + "\n"]

    def format_stream_end(self, prepared: Prepared, result: ChatResult) -> list[str]:
        return [json.dumps({"done": result.choices[0].finish_reason, "prompt": result.prompt_tokens}) + "\n"]

    def format_response(self, prepared: Prepared, result: ChatResult) -> dict[str, Any]:
        raise AssertionError("always streams")

    def get_routes(self) -> dict[str, Any]:
        return {
            "/v1/echo/info": lambda engine: {
                "model": self.model_name,
                "vocab": engine.model.config.vocab_size,
            }
        }


def test_an_unknown_protocol_is_one_builder(fakes: Any) -> None:
    engine = fakes.FakeEngine([fakes.Script(["hi", "!"])])
    app = create_app(ServerSettings(api_key="k"), None, builders=[EchoResponseBuilder("echo-model")])
    with fakes.serve_app(app) as url:
        key = {"x-api-key": "k"}
        assert httpx.get(url + "/v1/echo/info", headers=key).status_code == 503
        app.state.engine = engine
        assert httpx.get(url + "/v1/echo/info").status_code == 401
        assert httpx.get(url + "/v1/echo/info", headers=key).json() == {"model": "echo-model", "vocab": 100}
        r = httpx.post(url + "/v1/echo", json={"text": "a b"}, headers=key)
        bad = httpx.post(url + "/v1/echo", json={}, headers=key)
        assert (
            httpx.post(url + CHAT, json={}, headers=key).status_code == 404
        )  # only what was given is mounted
        assert httpx.get(url + "/v1/models", headers=key).status_code == 404
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert r.text == '{"t": "hi"}\n{"t": "!"}\n{"done": "stop", "prompt": 2}\n'
    assert bad.status_code == 422 and bad.json() == {
        "error": {"type": "invalid_request_error", "message": "text: Field required", "param": "text"}
    }


def test_registry_validates_plugins_and_selects_strictly() -> None:
    loaded = load_protocols()
    assert (
        loaded.classes["openai"] is OpenAIResponseBuilder
        and loaded.classes["anthropic"] is AnthropicResponseBuilder
    )
    with pytest.raises(
        PluginError, match="not found; misspelled or not installed\\? Installed: anthropic, .*openai"
    ):
        select_builders(loaded, ["grpc"], "astrai")
    assert [b.route for b in select_builders(loaded, ["openai"], "m")] == [CHAT]
    with pytest.raises(PluginError, match="name is 'echo' but its entry point is 'other'"):
        check_builder_class("other", EchoResponseBuilder, "ep")
    with pytest.raises(PluginError, match="not a subclass"):
        check_builder_class("x", RequestRejected, "ep")
    loaded.classes["twin"] = type("Twin", (OpenAIResponseBuilder,), {"name": "twin"})
    with pytest.raises(PluginError, match="both claim route /v1/chat/completions"):
        select_builders(loaded, ["openai", "twin"], "astrai")
