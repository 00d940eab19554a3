"""Property test: request bodies generated around each protocol's request model never get a 5xx.

Each body starts from a valid request of its route and has some fields replaced by values drawn
near the field's type (lists of odd messages, content parts and tools, tool choices, formats,
stop lists, numbers from -3 to 2**64 and 10**30) or by nested junk (null, booleans, huge integers,
NaN-like strings, unicode, lists and objects), streamed or not. Every answer must be a success
or a 4xx in the route's own error shape, a stream must end without an in-stream server error, and
afterwards the engine must hold nothing (no active or waiting request, ``kv_tokens_in_use`` back
to its idle value). Generation stays short: the length fields only take values from -1 to 4
(or huge ones, which are refused), never null, which would mean the route's long default.

Runs on the in-process real server (``base_url`` on the session ``engine``), which is cheaper than a
subprocess; tests/hostile/test_malformed.py reproduces the shapes that were 500s against
``astrai serve``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # the real default model

CHAT, COMPLETIONS, RESPONSES, MESSAGES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)
EXAMPLES = 60  # per route: 240 in all

# ---------------------------------------------------------------- values
text = st.text(max_size=12)  # hypothesis leaves out lone surrogates; the parse step's tests cover them
odd_strings = st.sampled_from(
    ["", "NaN", "Infinity", "-1e309", "1e999", "null", "\x00", "<|im_end|>", "é😀", "[" * 40, "f"]
)
huge = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1, -(10**30)])
numbers = st.integers(-3, 40) | huge | st.floats(allow_nan=False, allow_infinity=False, width=32)
scalars = st.none() | st.booleans() | numbers | text | odd_strings
junk = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3), max_leaves=6
)
#: max_tokens and the like: short or refused, never null (the route's default would generate for long)
lengths = st.integers(-1, 4) | huge | st.sampled_from(["2", 2.5, True, [], {}])


def either(*options: Any) -> st.SearchStrategy:
    """A near-valid value (one of ``options``) or junk."""
    return st.one_of(*options, junk)


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional=optional or {})


USER = [{"role": "user", "content": "Say hi."}]
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
names = st.sampled_from(["f", "g", "", "x" * 65])
schema = either(
    st.just({"type": "object"}),
    obj(
        {"type": either(st.sampled_from(["object", "string", "integer", "array", "nope"]))},
        {
            "properties": either(st.dictionaries(st.sampled_from(["a", "b"]), st.just({"type": "string"}))),
            "required": either(st.just(["a"])),
            "pattern": either(st.sampled_from(["a+", "(", "[0-9]{2}"])),
            "minLength": numbers,
            "maxItems": numbers,
            "enum": st.lists(scalars, max_size=3),
        },
    ),
)
stop = either(text, st.lists(either(text), max_size=3))
stream = st.booleans() | junk

# ---------------------------------------------------------------- OpenAI chat completions
chat_part = obj(
    {"type": either(st.sampled_from(["text", "image_url", "input_audio", "file", "refusal"]))},
    {"text": either(text), "image_url": junk, "prompt_cache_breakpoint": junk},
)
chat_call = obj(
    {
        "function": either(
            obj(
                {"name": either(names)},
                {"arguments": either(st.sampled_from(["{}", '{"a": 1}', "[" * 3000, "{"]))},
            )
        )
    },
    {"id": either(text), "type": either(st.just("function"))},
)
chat_message = obj(
    {"role": either(st.sampled_from(["user", "assistant", "system", "developer", "tool", "bot"]))},
    {
        "content": either(text, st.lists(chat_part, max_size=3)),
        "name": either(text),
        "tool_calls": either(st.lists(chat_call, max_size=2)),
        "tool_call_id": either(text),
        "refusal": either(text),
    },
)
chat_tool = obj(
    {
        "type": either(st.sampled_from(["function", "custom"])),
        "function": either(
            obj({"name": either(names)}, {"parameters": schema, "description": either(text), "strict": junk})
        ),
    }
)
#: a named choice: the function object right, or anything else (a string, a list, ...), typed or not
chat_named_choice = obj(
    {
        "function": st.one_of(
            obj({"name": either(names)}, {"strict": junk}), scalars, st.lists(text, max_size=2)
        )
    },
    {"type": either(st.sampled_from(["function", "allowed_tools", "custom"]))},
)
chat_tool_choice = either(
    st.sampled_from(["none", "auto", "required", "any"]), chat_named_choice, st.lists(text, max_size=2)
)
response_format = either(
    obj(
        {"type": either(st.sampled_from(["text", "json_object", "json_schema", "regex"]))},
        {"json_schema": either(obj({"name": either(text)}, {"schema": schema, "strict": junk}))},
    ),
)
structured_outputs = either(
    st.dictionaries(
        st.sampled_from(
            ["json", "regex", "choice", "grammar", "structural_tag", "json_object", "whitespace_pattern"]
        ),
        either(schema, st.sampled_from(["a|b", "(", 'root ::= "x"']), st.lists(text, max_size=3)),
        max_size=2,
    ),
)
openai_sampling = {
    "temperature": either(numbers),
    "top_p": either(numbers),
    "top_k": either(numbers),
    "min_p": either(numbers),
    "seed": either(numbers),
    "n": either(st.integers(-1, 3)),
    "presence_penalty": either(numbers),
    "frequency_penalty": either(numbers),
    "repetition_penalty": either(numbers),
    "logit_bias": either(
        st.dictionaries(st.sampled_from(["1", "-1", "x", str(2**63), "50000"]), numbers, max_size=2)
    ),
    "stop": stop,
    "stop_token_ids": either(st.lists(numbers, max_size=3)),
    "ignore_eos": junk,
    "response_format": response_format,
    "structured_outputs": structured_outputs,
    "stream": stream,
    "stream_options": either(obj({}, {"include_usage": junk})),
    "user": junk,
    "model": either(text),
    "min_tokens": lengths,
}
chat_fields = {
    **openai_sampling,
    "messages": either(st.lists(chat_message, max_size=3)),
    "tools": either(st.lists(chat_tool, max_size=2)),
    "tool_choice": chat_tool_choice,
    "logprobs": junk,
    "top_logprobs": either(numbers),
    "parallel_tool_calls": junk,
    "max_tokens": lengths,
    "max_completion_tokens": lengths,
    "metadata": junk,
    "modalities": junk,
    "store": junk,
    "audio": junk,
    "unknown_field": junk,
    "+tools": obj(
        {"tools": st.just([CHAT_TOOL]), "tool_choice": chat_named_choice}
    ),  # "tools" alone varies the tools
    "+replay": chat_call.map(
        lambda call: {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        }
    ),
}

# ---------------------------------------------------------------- OpenAI completions
completion_fields = {
    **openai_sampling,
    "max_tokens": lengths,
    "prompt": either(
        text,
        st.lists(text, max_size=3),
        st.lists(numbers, max_size=4),
        st.lists(st.lists(numbers, max_size=3), max_size=2),
    ),
    "echo": junk,
    "logprobs": either(numbers),
    "best_of": either(numbers),
    "suffix": junk,
    "+echo": obj(
        {
            "echo": st.booleans(),
            "logprobs": either(st.integers(0, 5)),
            "max_tokens": st.integers(0, 2),
            "prompt": either(st.lists(st.integers(0, 100), min_size=1, max_size=3), text),
        }
    ),
}

# ---------------------------------------------------------------- OpenAI responses
input_part = obj(
    {"type": either(st.sampled_from(["input_text", "output_text", "input_image", "input_file"]))},
    {"text": either(text)},
)
input_item = obj(
    {},
    {
        "type": either(st.sampled_from(["message", "function_call", "function_call_output", "reasoning"])),
        "role": either(st.sampled_from(["user", "assistant", "system", "developer", "tool"])),
        "content": either(text, st.lists(input_part, max_size=2)),
        "call_id": either(text),
        "name": either(names),
        "arguments": either(st.sampled_from(["{}", "[" * 3000, "{"])),
        "output": either(text, st.lists(input_part, max_size=2)),
    },
)
responses_tool = obj(
    {"type": either(st.sampled_from(["function", "web_search", "mcp"]))},
    {"name": either(names), "parameters": schema, "strict": junk, "description": junk},
)
responses_fields = {
    "input": either(text, st.lists(input_item, max_size=3)),
    "instructions": either(text),
    "max_output_tokens": lengths,
    "temperature": either(numbers),
    "top_p": either(numbers),
    "top_logprobs": either(numbers),
    "include": either(
        st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]), max_size=2)
    ),
    "tools": either(st.lists(responses_tool, max_size=2)),
    "tool_choice": either(
        st.sampled_from(["none", "auto", "required"]),
        obj({"type": either(st.just("function"))}, {"name": either(names)}),
    ),
    "text": either(
        obj(
            {},
            {
                "format": either(
                    obj(
                        {"type": either(st.sampled_from(["text", "json_object", "json_schema"]))},
                        {"schema": schema, "name": junk},
                    )
                ),
                "verbosity": junk,
            },
        )
    ),
    "stream": stream,
    "store": junk,
    "reasoning": junk,
    "truncation": junk,
    "metadata": junk,
    "previous_response_id": junk,
    "parallel_tool_calls": junk,
    "stream_options": junk,
    "unknown_field": junk,
    "+tools": obj(
        {
            "tools": st.lists(responses_tool, min_size=1, max_size=2) | st.just([RESPONSES_TOOL]),
            "tool_choice": either(
                st.sampled_from(["none", "auto", "required"]),
                obj({"type": either(st.just("function"))}, {"name": either(names), "function": junk}),
            ),
        }
    ),
    "+replay": input_item.map(
        lambda item: {
            "input": [
                {"role": "user", "content": "Say hi."},
                {"type": "function_call", "call_id": "c1", "name": "f", **item},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ]
        }
    ),
}

# ---------------------------------------------------------------- Anthropic messages
block = obj(
    {"type": either(st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document"]))},
    {
        "text": either(text),
        "id": either(text),
        "name": either(names),
        "input": either(st.dictionaries(text, junk, max_size=2)),
        "tool_use_id": either(text),
        "content": either(
            text, st.lists(obj({"type": either(st.just("text"))}, {"text": either(text)}), max_size=2)
        ),
        "cache_control": junk,
        "citations": junk,
    },
)
anthropic_message = obj(
    {"role": either(st.sampled_from(["user", "assistant", "system"]))},
    {"content": either(text, st.lists(block, max_size=3))},
)
messages_fields = {
    "messages": either(st.lists(anthropic_message, max_size=3)),
    "system": either(text, st.lists(block, max_size=2)),
    "max_tokens": lengths,
    "min_tokens": lengths,
    "temperature": either(numbers),
    "top_p": either(numbers),
    "top_k": either(numbers),
    "stop_sequences": stop,
    "stop_token_ids": either(st.lists(numbers, max_size=3)),
    "tools": either(
        st.lists(
            obj({"name": either(names)}, {"input_schema": schema, "type": junk, "strict": junk}), max_size=2
        )
    ),
    "tool_choice": either(
        obj(
            {"type": either(st.sampled_from(["auto", "any", "tool", "none", "function"]))},
            {"name": either(names), "disable_parallel_tool_use": junk},
        ),
        st.sampled_from(["auto", "any"]),
    ),
    "output_config": either(
        obj(
            {},
            {
                "format": either(obj({"type": either(st.just("json_schema"))}, {"schema": schema})),
                "effort": junk,
            },
        )
    ),
    "thinking": junk,
    "metadata": junk,
    "stream": stream,
    "container": junk,
    "unknown_field": junk,
    "+tools": obj(
        {
            "tools": st.just([ANTHROPIC_TOOL]),
            "tool_choice": either(
                obj(
                    {"type": either(st.sampled_from(["auto", "any", "tool", "function"]))},
                    {"name": either(names), "function": junk},
                )
            ),
        }
    ),
}

ROUTES = {
    CHAT: ({"messages": USER, "max_tokens": 2}, chat_fields),
    COMPLETIONS: ({"prompt": "Hello", "max_tokens": 2}, completion_fields),
    RESPONSES: ({"input": "Say hi.", "max_output_tokens": 2}, responses_fields),
    MESSAGES: ({"messages": USER, "max_tokens": 2}, messages_fields),
}


def bodies(route: str) -> st.SearchStrategy:
    """The route's valid body with up to four of its fields replaced (each by its field's strategy), or
    with one ``+`` entry only: fields that matter together (tools and a tool choice, a replayed call)."""
    base, fields = ROUTES[route]

    def merged(changes: dict[str, Any]) -> dict[str, Any]:
        body = dict(base)
        for key, value in changes.items():
            if key.startswith("+"):
                body.update(value)
            else:
                body[key] = value
        return body

    keys = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True)
    replaced = keys.flatmap(lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))
    joint = st.sampled_from(sorted(k for k in fields if k.startswith("+"))).flatmap(
        lambda k: fields[k].map(lambda v: {k: v})
    )
    return (replaced | joint).map(merged)


def _error_shape(route: str, body: Any) -> str:
    """The error message, asserting the route's error shape (OpenAI's for three routes, Anthropic's for
    one)."""
    if route == MESSAGES:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", (
        body
    )
    return error["message"]


def _stream_failed(text: str) -> bool:
    """Whether a stream reported a server error in-stream (after its 200 status line)."""
    return any(kind in text for kind in ('"server_error"', '"api_error"', '"internal server error'))


def _wait_idle(engine: Any, idle_kv: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = engine.get_stats()
        if not stats["active_tasks"] and not stats["waiting_queue"] and stats["kv_tokens_in_use"] == idle_kv:
            return
        assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def idle_kv(engine: Any, base_url: str) -> int:
    """``kv_tokens_in_use`` of the idle engine (the session's earlier tests may have left it busy a
    moment)."""
    deadline = time.monotonic() + 30
    while engine.get_stats()["active_tasks"] or engine.get_stats()["waiting_queue"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return engine.get_stats()["kv_tokens_in_use"]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_generated_bodies_never_get_a_5xx_and_leave_nothing_held(
    base_url: str, engine: Any, idle_kv: int, route: str, data: st.DataObject
) -> None:
    body = data.draw(bodies(route), label="body")
    raw = json.dumps(body)  # NaN and Infinity never drawn: their literals are no JSON
    r = httpx.post(base_url + route, content=raw, headers={"content-type": "application/json"}, timeout=120)
    event(f"status {r.status_code}")  # --hypothesis-show-statistics: how many were served, how many refused
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert _error_shape(route, r.json())
        assert "Traceback" not in r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert not _stream_failed(r.text), r.text
    else:
        assert isinstance(r.json(), dict)
    _wait_idle(engine, idle_kv)
