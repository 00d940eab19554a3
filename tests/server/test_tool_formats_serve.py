"""The tool-call formats ``mistral``, ``pythonic`` and ``qwen3_coder`` (``hermes`` is the default model's,
tested with it) through a real uvicorn server and the official SDKs, on a tiny random Qwen3 with
the default model's tokenizer. One engine serves them all: each format's chat template (one that
teaches the format, so its parser is chosen from it) is swapped in before its tests. The output is
forced: a named ``tool_choice`` makes the grammar write a call in the format, and tools whose
arguments are enums leave the random model no choice but whitespace; a ``structured_outputs`` regex
writes parallel calls, a call of an unknown tool and a malformed one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import pytest

CHAT = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\n{{ teach }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TEACH = {  # how each family's template describes its calls (what ``matches`` looks for)
    "mistral": 'Call tools as [TOOL_CALLS][{"name": ..., "arguments": ...}]',
    "pythonic": "Call tools as [func_name1(params_name1=params_value1), func_name2(params)]",
    "qwen3_coder": "<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>",
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris"]}, "days": {"type": "integer", "enum": [3]}},
    "required": ["city", "days"],
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
PARIS = {"city": "Paris", "days": 3}
TWO_CALLS = {  # the text of two calls, get_weather(Paris, 3) and add(1), in each format
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "add", "arguments": {"a": 1}}]',
    "pythonic": '[get_weather(city="Paris", days=3), add(a=1)]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
    "<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
}
BAD = {  # a call of an unknown tool, and a malformed call, in each format
    "mistral": (
        '[TOOL_CALLS][{"name": "rm", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "add", "arguments": [1]}]',  # (arguments not an object: never begun)
    ),
    "pythonic": ('[rm(path="/")]', "[add(a=1"),
    "qwen3_coder": (
        "<tool_call>\n<function=rm>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</tool_call>",
    ),
}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else "\\n" if c == "\n" else c for c in text)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model_path) -> Iterator[Any]:
    """The engine of a tiny random Qwen3 (HF folder) with the default model's tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.model.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen3-tools")
    tokenizer = Tokenizer.from_gguf(default_model_path)
    tokenizer.hf.chat_template = CHAT
    tokenizer.hf.save_pretrained(folder)
    eos = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer.hf),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    engine = InferenceEngine.from_model(
        str(folder), dtype=torch.float32, config=EngineConfig(max_seq_len=1024)
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def url(engine: Any, fakes: Any) -> Iterator[str]:
    """A real uvicorn server of every installed protocol over ``engine`` (cheap: one per test)."""
    from astrai_server import ServerSettings, create_app

    with fakes.serve_app(create_app(ServerSettings(), engine)) as base:
        yield base


@pytest.fixture(scope="module", params=list(TEACH))
def fmt(request: Any, engine: Any) -> str:
    """A format's name, its template in use by ``engine``."""
    from astrai.model.chat_template import ChatTemplate

    engine.tokenizer.use_chat_template(
        ChatTemplate(CHAT.replace("{{ teach }}", TEACH[request.param]), "inline")
    )
    return request.param


@pytest.fixture
def openai_client(url: str, fmt: str) -> Iterator[Any]:
    from openai import OpenAI

    with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _arguments(encoded: str) -> dict[str, Any]:
    """Decoded arguments, strings stripped: the grammar of ``qwen3_coder``'s XML lets the model write
    whitespace around a value, which a string keeps (the format's one newline aside)."""
    return {k: v.strip() if isinstance(v, str) else v for k, v in json.loads(encoded).items()}


def _chat(client: Any, stream: bool, **kwargs: Any) -> tuple[str | None, list[tuple[str, str, dict]], str]:
    """``(content, [(id, name, arguments)], finish_reason)``, streamed deltas reassembled by index."""
    args = dict(model="astrai", messages=MESSAGES, max_tokens=250, tools=TOOLS, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = choice.message.tool_calls or []
        named = [(c.id, c.function.name, _arguments(c.function.arguments)) for c in calls]
        return choice.message.content, named, choice.finish_reason
    content, parts, finish = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                part = parts.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                part["id"] += d.id or ""
                part["name"] += (d.function.name or "") if d.function else ""
                part["arguments"] += (d.function.arguments or "") if d.function else ""
    calls = [(p["id"], p["name"], _arguments(p["arguments"])) for _, p in sorted(parts.items())]
    return content or None, calls, finish


def test_a_named_call_streamed_and_not(openai_client: Any) -> None:
    whole = _chat(openai_client, False, tool_choice=NAMED, temperature=0)
    streamed = _chat(openai_client, True, tool_choice=NAMED, temperature=0)
    for content, calls, finish in (whole, streamed):
        assert (content, [c[1:] for c in calls], finish) == (None, [("get_weather", PARIS)], "tool_calls")
        assert calls[0][0]


def test_parallel_calls_streamed(openai_client: Any, fmt: str) -> None:
    forced = {"structured_outputs": {"regex": literal(TWO_CALLS[fmt])}}
    content, calls, finish = _chat(openai_client, True, extra_body=forced)
    assert (content, [c[1:] for c in calls], finish) == (
        None,
        [("get_weather", PARIS), ("add", {"a": 1})],
        "tool_calls",
    )
    assert len({c[0] for c in calls}) == 2  # an id per call


@pytest.mark.parametrize("bad", [0, 1], ids=["unknown-tool", "malformed"])
def test_unknown_tools_and_malformed_calls_stay_text(openai_client: Any, fmt: str, bad: int) -> None:
    text = BAD[fmt][bad]
    forced = {"structured_outputs": {"regex": literal(text)}}
    assert _chat(openai_client, False, extra_body=forced) == (text, [], "stop")


def test_anthropic_tool_use_blocks_streamed(url: str, fmt: str) -> None:
    from anthropic import Anthropic

    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        args = dict(model="astrai", max_tokens=120, messages=MESSAGES, tools=tools)
        args["tool_choice"] = {"type": "tool", "name": "get_weather"}
        with client.messages.stream(**args) as stream:
            message = stream.get_final_message()  # the SDK assembles input_json_delta into input
    assert message.stop_reason == "tool_use"
    # (the stream opens a text block before it knows the answer is a call: empty here)
    blocks = [
        (b.type, b.name, _arguments(json.dumps(b.input)))
        for b in message.content
        if b.type != "text" or b.text
    ]
    assert blocks == [("tool_use", "get_weather", PARIS)]


@pytest.mark.parametrize("fmt", ["mistral"], indirect=True)  # the builders see calls, not formats
def test_responses_function_call_events(openai_client: Any, fmt: str) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    args = dict(model="astrai", input="weather in Paris?", max_output_tokens=120, tools=tools, temperature=0)
    args["tool_choice"] = {"type": "function", "name": "get_weather"}
    deltas, done, output = "", None, None
    for event in openai_client.responses.create(**args, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        elif event.type == "response.function_call_arguments.done":
            done = event.arguments
        elif event.type == "response.completed":
            output = event.response.output
    assert _arguments(deltas) == _arguments(done) == PARIS
    assert [(o.type, o.name, _arguments(o.arguments)) for o in output] == [
        ("function_call", "get_weather", PARIS)
    ]


def test_the_agents_sdk_calls_the_function(url: str, fmt: str) -> None:
    """The OpenAI Agents SDK, strict tools (its default), runs the tool from a call in every format,
    read whole and streamed (its own accumulator of the argument deltas)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool  # strict, the SDK's default: this template's calls are enforced by grammar
    def get_weather(city: Literal["Paris"], days: Literal[3]) -> str:
        """The weather in a city for a few days."""
        seen.append((city, days))
        return "sunny"

    async def run(streamed: bool) -> Any:
        async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            agent = Agent(
                name="weather",
                instructions="Use the tool.",
                model=OpenAIChatCompletionsModel(model="astrai", openai_client=client),
                tools=[get_weather],
                tool_use_behavior="stop_on_first_tool",
                model_settings=ModelSettings(tool_choice="required", max_tokens=120),
            )
            if not streamed:
                return await Runner.run(agent, "weather in Paris?", max_turns=2)
            result = Runner.run_streamed(agent, "weather in Paris?", max_turns=2)
            async for _ in result.stream_events():
                pass
            return result

    for streamed in (False, True):
        seen.clear()
        result = asyncio.run(run(streamed))
        assert seen == [("Paris", 3)] and result.final_output == "sunny", streamed


def _raw_chat(client: Any, stream: bool, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]], str]:
    """``(content, [(name, arguments as sent)], finish_reason)``; streamed deltas joined by index."""
    args = dict(model="astrai", messages=MESSAGES, tools=TOOLS, temperature=0, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, parts, finish = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                name, pieces = parts.get(d.index, ("", []))
                parts[d.index] = (name + (d.function.name or ""), [*pieces, d.function.arguments or ""])
    return content or None, [(n, "".join(p)) for n, p in parts.values()], finish


def test_arguments_stream_as_the_model_writes_them(openai_client: Any, fmt: str) -> None:
    forced = {"structured_outputs": {"regex": literal(TWO_CALLS[fmt])}}
    args = dict(model="astrai", messages=MESSAGES, tools=TOOLS, max_tokens=250, extra_body=forced)
    pieces: dict[int, list[str]] = {}
    for chunk in openai_client.chat.completions.create(**args, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if d.function.arguments:
                pieces.setdefault(d.index, []).append(d.function.arguments)
    # JSON arguments as their tokens come, XML a parameter at a time, Python literals whole
    assert len(pieces[0]) > 1 if fmt in ("mistral", "qwen3_coder") else len(pieces[0]) == 1
    assert [_arguments("".join(p)) for _, p in sorted(pieces.items())] == [PARIS, {"a": 1}]


def test_calls_cut_by_max_tokens_stream_as_they_end(openai_client: Any, engine: Any, fmt: str) -> None:
    """At every length, the streamed answer is the whole one: a call cut inside its arguments keeps
    what of them came (finish_reason "length", as OpenAI's), except a Python call, which comes whole
    or stays text."""
    forced = {"structured_outputs": {"regex": literal(TWO_CALLS[fmt])}}
    total = len(engine.tokenizer.encode(TWO_CALLS[fmt]))
    cut = []
    for n in range(3, total + 2, 4):
        whole = _raw_chat(openai_client, False, max_tokens=n, extra_body=forced)
        assert _raw_chat(openai_client, True, max_tokens=n, extra_body=forced) == whole, n
        if whole[1] and whole[2] == "length":
            cut.append(whole)
    if fmt == "pythonic":
        assert all(_arguments(args) for _, calls, _ in cut for _, args in calls)  # whole calls only
    else:
        assert any(not _decodes(calls[-1][1]) for _, calls, _ in cut)  # some cut inside arguments


def _decodes(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
