"""Issue 16, finding 3 (the protocol builders' part): malformed input is a 4xx in the protocol's shape.

Against a real ``astrai serve``: wrong shapes of ``tool_choice`` (``{"type": "function", "function":
"f"}`` and ``["f"]`` with ``tools`` set were 500s), ``tools``, content parts, ``messages``, ``stop``
and ``response_format`` on every generation route, each sent plain and with ``stream: true``: the
status line is the 4xx itself (nothing is validated after a 200 goes out), the body is the route's
error shape with the exact reason, the server logs no failure and holds nothing afterwards. Tool-call
arguments nested 1,200 deep in a replayed call (a string, which the body's depth bound never sees)
were a RecursionError 500; they now reach the template as text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

CHAT, COMPLETIONS, RESPONSES, MESSAGES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)
USER = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
ANTHROPIC_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
BASE = {
    CHAT: {"messages": USER, "max_tokens": 2},
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 2},
    RESPONSES: {"input": "Say hi.", "max_output_tokens": 2},
    MESSAGES: {"messages": USER, "max_tokens": 2},
}
ONE_OF = 'Input should be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'

#: (route, fields over the route's valid body, status, the exact error message)
CASES = [
    # the two 500s
    (
        CHAT,
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}},
        422,
        "tool_choice.function: Input should be a valid dictionary or instance of FunctionName",
    ),
    (CHAT, {"tools": TOOLS, "tool_choice": ["f"]}, 422, f"tool_choice: {ONE_OF}"),
    # the other wrong tool_choice shapes
    (
        CHAT,
        {"tools": TOOLS, "tool_choice": {"type": "function"}},
        422,
        'tool_choice: Value error, a function tool_choice needs "function": {"name": ...}',
    ),
    (
        CHAT,
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 5}}},
        422,
        "tool_choice.function.name: Input should be a valid string",
    ),
    (
        CHAT,
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f", "strict": True}}},
        400,
        "unsupported parameter tool_choice.function.strict: astrai does not implement it",
    ),
    (
        CHAT,
        {
            "tools": TOOLS,
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
        },
        400,
        "tool_choice of type 'allowed_tools' is not supported",
    ),
    (
        CHAT,
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice names function 'g', which is not in tools",
    ),
    (CHAT, {"tools": TOOLS, "tool_choice": 5}, 422, f"tool_choice: {ONE_OF}"),
    (
        RESPONSES,
        {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "function": "f"}},
        400,
        "unsupported value for tool_choice (refused for an object other than "
        '{"type": "function", "name": ...}: '
        "only function tools are served)",
    ),
    (
        RESPONSES,
        {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": 5}},
        400,
        "unsupported value for tool_choice (refused for an object other than "
        '{"type": "function", "name": ...}: '
        "only function tools are served)",
    ),
    (
        RESPONSES,
        {"tools": RESPONSES_TOOLS, "tool_choice": ["f"]},
        422,
        'tool_choice: Input should be "none", "auto", "required" or {"type": "function", "name": ...}',
    ),
    (
        MESSAGES,
        {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "function", "function": "f"}},
        400,
        "unsupported parameter tool_choice.function: astrai does not implement it",
    ),
    (
        MESSAGES,
        {"tools": ANTHROPIC_TOOLS, "tool_choice": ["f"]},
        422,
        "tool_choice: Input should be a valid dictionary or instance of ToolChoice",
    ),
    # tools
    (
        CHAT,
        {"tools": [{"type": "function", "function": "f"}]},
        422,
        "tools.0.function: Input should be a valid dictionary or instance of FunctionDef",
    ),
    (CHAT, {"tools": "f"}, 422, "tools: Input should be a valid list"),
    (
        MESSAGES,
        {"tools": [{"name": "f", "input_schema": 5}]},
        422,
        "tools.0.input_schema: Input should be a valid dictionary",
    ),
    # content parts and messages
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        422,
        "messages.0.content: Value error, content part of type 'image_url' is not supported (text only)",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        422,
        "messages.0.content.0.text: Field required",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [None]}]},
        422,
        "messages.0.content.0: Input should be a valid dictionary or instance of TextPart",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        422,
        "messages.0.content: Input should be a string or a list of content parts",
    ),
    (
        RESPONSES,
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        422,
        "input.0.content.0.text: Field required",
    ),
    (CHAT, {"messages": []}, 422, "messages: List should have at least 1 item after validation, not 0"),
    (CHAT, {"messages": "hi"}, 422, "messages: Input should be a valid list"),
    (
        CHAT,
        {"messages": [{"role": "bot", "content": "hi"}]},
        422,
        "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
    ),
    (
        RESPONSES,
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
        422,
        "input.0.content: Value error, content part of type 'input_image' is not supported (text only)",
    ),
    (
        MESSAGES,
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "unsupported parameter messages.0.content.0.image: astrai does not implement it",
    ),
    (
        MESSAGES,
        {"messages": [{"role": "user", "content": [None]}]},
        422,
        "messages.0.content.0: Input should be a valid dictionary or object to extract fields from",
    ),
    (COMPLETIONS, {"prompt": []}, 400, "prompt must hold at least one prompt"),
    # stop and response_format
    (CHAT, {"stop": 5}, 422, "stop: Input should be a valid string (and 1 more errors)"),
    (MESSAGES, {"stop_sequences": [None]}, 422, "stop_sequences.0: Input should be a valid string"),
    (
        CHAT,
        {"response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema must be an object with a schema",
    ),
    (
        COMPLETIONS,
        {"response_format": {"type": "regex"}},
        400,
        "response_format.type must be text, json_object or json_schema, got 'regex'",
    ),
]


def _message(route: str, body: dict[str, Any]) -> str:
    """The error's message, asserting the route's error shape."""
    if route == MESSAGES:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def _failures(log: str) -> list[str]:
    """The lines of ``log`` that report a failure (an ERROR line or a traceback)."""
    return [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]


@pytest.mark.parametrize(
    ("route", "fields", "status", "message"), CASES, ids=[f"{r}:{json.dumps(f)[:60]}" for r, f, *_ in CASES]
)
def test_malformed_input_is_a_4xx_in_the_protocols_shape(
    server: Any, route: str, fields: dict, status: int, message: str
) -> None:
    logged = len(server.log())
    for stream in (False, True):
        body = {**BASE[route], **fields, "stream": stream}
        r = httpx.post(server.url + route, json=body, timeout=60)
        assert (r.status_code, r.headers["content-type"]) == (status, "application/json"), r.text
        assert _message(route, r.json()) == message
    assert server.wait_idle()["kv_tokens_in_use"] == 0
    assert not _failures(server.log()[logged:])


def _deep_call(route: str) -> dict[str, Any]:
    arguments = "[" * 1200  # deeper than Python's recursion limit, short enough for the context
    if route == CHAT:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [
            *USER,
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        return {**BASE[CHAT], "messages": messages}
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    return {**BASE[RESPONSES], "input": [{"role": "user", "content": "Say hi."}, *items]}


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_deeply_nested_call_arguments_reach_the_template_as_text(server: Any, route: str) -> None:
    body, logged = _deep_call(route), len(server.log())
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    counted = (
        httpx.post(server.url + "/tokenize", json={"messages": body["messages"]}, timeout=60)
        if route == CHAT
        else None
    )
    if counted is not None:  # the arguments are in the prompt, as the text they were sent as
        assert counted.status_code == 200 and r.json()["usage"]["prompt_tokens"] == counted.json()["count"]
    assert server.wait_idle()["kv_tokens_in_use"] == 0
    assert not _failures(server.log()[logged:])
