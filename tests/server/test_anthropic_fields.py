"""Every field the ``anthropic`` SDK can send to Messages is handled on purpose: implemented, accepted and
ignored (``IGNORED``) or refused with a 400 naming it (``REFUSED``), checked against the installed SDK's
parameter types; and ``/v1/messages/count_tokens``. A scripted fake engine: no model, so these are fast."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import (
    CacheControlEphemeralParam,
    ContentBlock,
    ContentBlockParam,
    MessageCountTokensParams,
    MetadataParam,
    OutputConfigParam,
    TextBlockParam,
    ThinkingBlockParam,
    ThinkingConfigParam,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUnionParam,
    ToolUseBlockParam,
    UserMessageParam,
    tool_result_block_param,
)
from anthropic.types import TextBlock as SDKTextBlock
from anthropic.types import ThinkingBlock as SDKThinkingBlock
from anthropic.types import ToolUseBlock as SDKToolUseBlock
from anthropic.types.beta.message_create_params import MessageCreateParamsBase as BetaCreateParams
from anthropic.types.message_create_params import MessageCreateParamsStreaming
from fastapi.testclient import TestClient
from pydantic import ValidationError

from astrai.hooks import PluginManager
from astrai_server import ServerSettings, create_app
from astrai_server.protocols.anthropic import (
    IGNORED,
    REFUSED,
    UNSUPPORTED_BLOCKS,
    AnthropicMessage,
    AnthropicResponseBuilder,
    CacheControl,
    MessagesInput,
    MessagesRequest,
    Metadata,
    OutputConfig,
    TextBlock,
    Thinking,
    ThinkingBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)

MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "get_weather", "description": "Weather of a city", "input_schema": {"type": "object"}}


def _keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def _members(alias: Any) -> tuple[Any, ...]:
    args = typing.get_args(alias)
    return _members(args[0]) if typing.get_origin(alias) is typing.Annotated else args


def _tags(member: Any) -> tuple[str, ...]:
    """The ``type`` values of an SDK block or tool (a TypedDict or a response model)."""
    hint = (
        member.model_fields["type"].annotation
        if hasattr(member, "model_fields")
        else typing.get_type_hints(member)["type"]
    )
    return typing.get_args(hint)  # Literal["image"] -> ("image",)


# ---------------------------------------------------------------- the lists against the installed SDK
def test_every_top_level_field_of_the_sdk_is_declared_or_refused() -> None:
    sent = _keys(MessageCreateParamsStreaming)
    undeclared = sent - set(MessagesRequest.model_fields)
    assert undeclared and undeclared <= set(REFUSED), "a field of messages.create that nothing handles"
    assert _keys(MessageCountTokensParams) == set(MessagesInput.model_fields)
    top = {k for k in (*REFUSED, *IGNORED) if "[" not in k}
    assert top <= sent | _keys(BetaCreateParams), "the lists name a field the SDK does not have"
    assert not set(REFUSED) & set(IGNORED)


NESTED = [
    (UserMessageParam, AnthropicMessage),
    (TextBlockParam, TextBlock),
    (ToolUseBlockParam, ToolUseBlock),
    (ToolResultBlockParam, ToolResultBlock),
    (ThinkingBlockParam, ThinkingBlock),
    (ToolParam, ToolDef),
    (CacheControlEphemeralParam, CacheControl),
    (MetadataParam, Metadata),
    (OutputConfigParam, OutputConfig),
    *((m, ToolChoice) for m in _members(ToolChoiceParam)),
    *((m, Thinking) for m in _members(ThinkingConfigParam)),
]


@pytest.mark.parametrize(("param", "model"), NESTED, ids=[p.__name__ for p, _ in NESTED])
def test_each_nested_object_the_sdk_sends_is_declared_key_by_key(param: Any, model: Any) -> None:
    assert _keys(param) <= set(model.model_fields)


def test_response_blocks_sent_back_as_history_are_declared_key_by_key() -> None:
    """``messages=[..., {"role": "assistant", "content": reply.content}]`` sends the response models."""
    assert set(SDKTextBlock.model_fields) <= set(TextBlock.model_fields)
    assert set(SDKToolUseBlock.model_fields) <= set(ToolUseBlock.model_fields)
    assert set(SDKThinkingBlock.model_fields) <= set(ThinkingBlock.model_fields)


def test_every_block_type_the_sdk_can_send_is_implemented_or_refused() -> None:
    kinds = {
        t
        for alias in (ContentBlockParam, ContentBlock, tool_result_block_param.Content)
        for m in _members(alias)
        for t in _tags(m)
    }
    assert kinds - {"text", "tool_use", "tool_result", "thinking"} == set(UNSUPPORTED_BLOCKS)


SERVER_TOOLS = sorted({t for m in _members(ToolUnionParam) if m is not ToolParam for t in _tags(m)})


def test_every_server_tool_of_the_sdk_is_refused_naming_its_type() -> None:
    assert len(SERVER_TOOLS) > 10
    for kind in SERVER_TOOLS:
        with pytest.raises(ValidationError) as info:
            MessagesRequest.model_validate(
                {"messages": HI, "tools": [{"type": kind, "name": "x", "max_uses": 1}]}
            )
        unknown = [e for e in info.value.errors() if e["type"] == "extra_forbidden"]
        assert unknown[0]["loc"] == ("tools", 0, "type"), (
            kind
        )  # the app answers the first: 400 naming tools.0.type


# ---------------------------------------------------------------- over HTTP
@pytest.fixture
def served(fakes: Any) -> Iterator[tuple[str, Any]]:
    engine = fakes.FakeEngine(ctx=4096)
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        yield url, engine


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)


def _content(*blocks: dict, role: str = "user") -> list[dict]:
    return [{"role": role, "content": list(blocks)}]


CALLED = [
    *HI,
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
]
CITATION = {
    "type": "char_location",
    "cited_text": "x",
    "document_index": 0,
    "start_char_index": 0,
    "end_char_index": 1,
}
REFUSALS = {
    "thinking-omitted": ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
    "thinking-forced-call": (
        {
            "thinking": {"type": "adaptive"},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
        },
        "thinking",
    ),
    "output_config-format-type": (
        {"output_config": {"format": {"type": "regex", "schema": {}}}},
        "output_config.format.type",
    ),
    "output_config-effort": ({"output_config": {"effort": "low"}}, "output_config.effort"),
    "container": ({"container": "cntr_1"}, "container"),
    "mcp_servers": (
        {"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "m"}]},
        "mcp_servers",
    ),
    "context_management": ({"context_management": {"edits": []}}, "context_management"),
    "diagnostics": ({"diagnostics": {"previous_message_id": "msg_1"}}, "diagnostics"),
    "image": (
        {"messages": _content({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}})},
        "messages.0.content.0.image",
    ),
    "document": (
        {
            "messages": _content(
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}}
            )
        },
        "messages.0.content.0.document",
    ),
    "search_result": (
        {"messages": _content({"type": "search_result", "source": "s", "title": "t", "content": []})},
        "messages.0.content.0.search_result",
    ),
    "thinking-block": (
        {
            "messages": [
                *HI,
                *_content({"type": "thinking", "thinking": "hm", "signature": "s"}, role="assistant"),
                *HI,
            ]
        },
        "messages.1.content.0.signature",
    ),
    "thinking-block-of-user": (
        {"messages": _content({"type": "thinking", "thinking": "hm", "signature": "s"})},
        "messages.0.content.0.type",
    ),
    "redacted_thinking-block": (
        {"messages": [*HI, *_content({"type": "redacted_thinking", "data": "x"}, role="assistant"), *HI]},
        "messages.1.content.0.redacted_thinking",
    ),
    "tool_result-image": (
        {
            "messages": [
                *CALLED,
                *_content(
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]}
                ),
            ]
        },
        "messages.2.content.0.tool_result.content.0.image",
    ),
    "system-role": ({"messages": [{"role": "system", "content": "Be brief."}, *HI]}, "messages.0.role"),
    "citations": (
        {"messages": _content({"type": "text", "text": "x", "citations": [CITATION]})},
        "messages.0.content.0.text.citations",
    ),
    "system-citations": (
        {"system": [{"type": "text", "text": "s", "citations": [CITATION]}]},
        "system.0.citations",
    ),
    "server-tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
        "tools.0.type",
    ),
    "strict": ({"tools": [{**TOOL, "strict": True}]}, "tools.0.strict"),
    "defer_loading": ({"tools": [{**TOOL, "defer_loading": True}]}, "tools.0.defer_loading"),
    "allowed_callers": (
        {"tools": [{**TOOL, "allowed_callers": ["code_execution_20250825"]}]},
        "tools.0.allowed_callers",
    ),
    "input_examples": ({"tools": [{**TOOL, "input_examples": [{"city": "Rome"}]}]}, "tools.0.input_examples"),
    "caller": (
        {
            "messages": [
                *HI,
                *_content(
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "f",
                        "input": {},
                        "caller": {"type": "code_execution_20250825", "tool_id": "x"},
                    },
                    role="assistant",
                ),
            ]
        },
        "messages.1.content.0.tool_use.caller",
    ),
    "toolset_name": (
        {
            "messages": [
                *CALLED,
                *_content(
                    {"type": "tool_result", "tool_use_id": "t1", "content": "ok", "toolset_name": "mcp"}
                ),
            ]
        },
        "messages.2.content.0.tool_result.toolset_name",
    ),
    "nested-unknown": (
        {"messages": _content({"type": "text", "text": "x", "foo": 1})},
        "messages.0.content.0.text.foo",
    ),
    "metadata-key": ({"metadata": {"user_id": "u", "tags": ["a"]}}, "metadata.tags"),
    "unknown": ({"foo": 1}, "foo"),
    "openai-seed": ({"seed": 1}, "seed"),
}


class Untouchable:
    """An engine that is ready and must not be used: a refused request never reaches it."""

    pipeline = None

    def is_healthy(self) -> bool:
        return True

    def __getattr__(
        self, name: str
    ) -> Any:  # AttributeError: the app's optional probes (getattr with a default) see nothing
        raise AttributeError(f"a refused request used engine.{name}")


@pytest.fixture(scope="module")
def refusing() -> Iterator[TestClient]:
    """One in-process app for the whole matrix (a server per case would dominate its time)."""
    app = create_app(ServerSettings(), Untouchable(), [AnthropicResponseBuilder()], plugins=PluginManager())
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client


def test_a_signature_verifies_under_the_key_that_made_it(fake_engine: Any) -> None:
    """With ``signing_key`` set, a server after a restart takes the thinking blocks of the one before;
    without it (a random key per process) it refuses them."""
    from astrai_server.protocols.anthropic import THINKING
    from astrai_server.signing import sign

    block = {"type": "thinking", "thinking": "hm", "signature": sign(b"k" * 16, THINKING, "hm")}
    body = {"messages": [*HI, *_content(block, role="assistant"), *HI]}
    for key, status in (("k" * 16, 200), (None, 400)):
        builders = [AnthropicResponseBuilder()]
        app = create_app(ServerSettings(signing_key=key), fake_engine, builders, plugins=PluginManager())
        with TestClient(app) as client:
            assert client.post(COUNT, json=body).status_code == status


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
@pytest.mark.parametrize(("fields", "name"), REFUSALS.values(), ids=REFUSALS)
def test_refused_fields_are_a_400_naming_them(
    refusing: TestClient, path: str, fields: dict, name: str
) -> None:
    body = {"model": "astrai", "messages": HI, **({"max_tokens": 4} if path == MESSAGES else {}), **fields}
    top = next(iter(fields))
    if path == COUNT and top in MessagesRequest.model_fields and top not in MessagesInput.model_fields:
        name = f"'{top}'"  # a field of generation only: unknown to count_tokens
    r = refusing.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert name in r.json()["error"]["message"]


MALFORMED_THINKING = {
    "no-budget": ({"type": "enabled"}, "thinking: budget_tokens is required with type enabled"),
    "budget-when-disabled": ({"type": "disabled", "budget_tokens": 9}, "thinking: budget_tokens is required"),
    "display-when-disabled": ({"type": "disabled", "display": "summarized"}, "thinking: display is taken"),
    "budget-zero": ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens: "),
    "type": ({"type": "on"}, "thinking.type: "),
}


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
@pytest.mark.parametrize(("thinking", "message"), MALFORMED_THINKING.values(), ids=MALFORMED_THINKING)
def test_a_malformed_thinking_is_a_422_naming_it(
    refusing: TestClient, path: str, thinking: dict, message: str
) -> None:
    body = {"messages": HI, **({"max_tokens": 4} if path == MESSAGES else {}), "thinking": thinking}
    r = refusing.post(path, json=body)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(message), r.text


def test_count_tokens_refuses_what_only_generation_takes(served: tuple[str, Any]) -> None:
    r = httpx.post(served[0] + COUNT, json={"messages": HI, "max_tokens": 4}, timeout=10)
    assert r.status_code == 400 and "'max_tokens'" in r.json()["error"]["message"]


def test_the_sdk_raises_bad_request_naming_the_field(served: tuple[str, Any]) -> None:
    client, kw = _client(served[0]), {"model": "astrai", "max_tokens": 4, "messages": HI}
    with pytest.raises(
        anthropic.BadRequestError, match=r"thinking\.budget_tokens: .* less than max_tokens"
    ) as info:
        client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 2048})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.type"):
        client.messages.create(**kw, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.BadRequestError, match="'container'"):
        client.messages.create(**kw, container="cntr_1")
    with pytest.raises(anthropic.BadRequestError, match=r"output_config\.effort"):
        client.messages.count_tokens(model="astrai", messages=HI, output_config={"effort": "low"})


HISTORY = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
]
DECORATED = [
    {
        "role": "user",
        "content": [
            {
                "type": "text",
                "text": "What is the weather in Rome?",
                "citations": None,
                "cache_control": {"type": "ephemeral", "ttl": "5m"},
            }
        ],
    },
    {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": "t1",
                "name": "get_weather",
                "input": {"city": "Rome"},
                "caller": {"type": "direct"},
                "toolset_name": None,
                "cache_control": {"type": "ephemeral"},
            }
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "sunny"}],
                "is_error": True,
                "cache_control": {"type": "ephemeral"},
            }
        ],
    },
]
METADATA = {
    "metadata": {"user_id": "u-1"},
    "service_tier": "standard_only",
    "inference_geo": "us",
    "speed": "fast",
    "user_profile_id": "p-1",
    "workspace_id": "w-1",
    "cache_control": {"type": "ephemeral", "ttl": "1h"},
    "thinking": {"type": "disabled"},
    "output_config": {},
    "container": None,
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
}
DECORATED_TOOL = {
    **TOOL,
    "type": "custom",
    "cache_control": {"type": "ephemeral"},
    "strict": False,
    "defer_loading": False,
    "allowed_callers": ["direct"],
    "eager_input_streaming": True,
    "input_examples": [],
}


def test_ignored_fields_change_neither_the_prompt_nor_the_sampling(served: tuple[str, Any]) -> None:
    client = _client(served[0])
    plain = {"model": "astrai", "max_tokens": 8, "system": "Be brief.", "tools": [TOOL]}
    a = client.messages.create(**plain, messages=HISTORY)
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}, "citations": []}]
    b = client.messages.create(
        **{**plain, "system": system, "tools": [DECORATED_TOOL]}, messages=DECORATED, **METADATA
    )
    (prompt_a, params_a), (prompt_b, params_b) = served[1].submitted
    assert prompt_a == prompt_b and params_a == params_b
    assert a.model_dump(exclude={"id"}) == b.model_dump(exclude={"id"})
    assert client.messages.count_tokens(
        model="astrai", messages=DECORATED, system=system, tools=[DECORATED_TOOL]
    ).input_tokens == len(prompt_a)


def test_vllm_extensions_reach_the_sampling_parameters(served: tuple[str, Any]) -> None:
    extra = {
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "stop_token_ids": [7, 9],
        "ignore_eos": True,
    }
    _client(served[0]).messages.create(model="astrai", max_tokens=8, messages=HI, extra_body=extra)
    params = served[1].submitted[0][1]
    assert {k: getattr(params, k) for k in extra} == extra
    r = httpx.post(served[0] + MESSAGES, json={"messages": HI, "stop_token_ids": [-1]}, timeout=10)
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]


TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_disable_parallel_tool_use_keeps_only_the_first_call(fakes: Any, stream: bool) -> None:
    engine = fakes.FakeEngine([fakes.Script([TWO_CALLS]), fakes.Script([TWO_CALLS])], ctx=4096)
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        client, kw = _client(url), {"model": "astrai", "max_tokens": 64, "messages": HI, "tools": [TOOL]}
        replies = []
        for disable in (False, True):
            choice = {"type": "auto", "disable_parallel_tool_use": disable}
            if stream:
                with client.messages.stream(**kw, tool_choice=choice) as s:
                    replies.append(s.get_final_message())
            else:
                replies.append(client.messages.create(**kw, tool_choice=choice))
    both, first = ([b.input["city"] for b in m.content if b.type == "tool_use"] for m in replies)
    assert (both, first) == (["Rome", "Oslo"], ["Rome"])
    assert replies[1].stop_reason == "tool_use" and replies[1].usage == replies[0].usage


def test_count_tokens_is_the_input_tokens_of_the_same_messages(served: tuple[str, Any]) -> None:
    client = _client(served[0])
    prefilled = [*HI, {"role": "assistant", "content": "Hello there, "}]
    cases = [
        {"messages": HI},
        {"messages": HI, "system": "Be brief.", "tools": [TOOL]},
        {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "any"}},  # the forced call's opening counts
        {
            "messages": HI,
            "tools": [TOOL, {**TOOL, "name": "other"}],
            "tool_choice": {"type": "tool", "name": "other"},
        },
        {"messages": prefilled, "system": [{"type": "text", "text": "Be brief."}]},
    ]
    for case in cases:
        counted = client.messages.count_tokens(model="astrai", **case).input_tokens
        assert counted == client.messages.create(model="astrai", max_tokens=4, **case).usage.input_tokens, (
            case
        )
    opened = [len(p) for p, _ in served[1].submitted]
    assert opened[2] > opened[0] + 10  # tools described, a call opened


def test_count_tokens_opens_the_call_of_the_servers_tool_call_parser(fakes: Any) -> None:
    """A forced call's opening is the ``--tool-call-parser``'s (llama3_json's: none), not the one
    chosen from the template (hermes' ``<tool_call>``), in the count as in the generation."""
    parser = "llama3_json"
    engine = fakes.FakeEngine(ctx=4096)
    case = {"messages": HI, "tools": [TOOL], "tool_choice": {"type": "tool", "name": TOOL["name"]}}
    counts = {}
    for name in (None, parser):
        with fakes.serve_app(create_app(ServerSettings(tool_call_parser=name), engine)) as url:
            client = _client(url)
            counted = client.messages.count_tokens(model="astrai", **case).input_tokens
            httpx.post(url + MESSAGES, json={"model": "astrai", "max_tokens": 4, **case}, timeout=10)
        counts[name] = counted
        assert counted == len(engine.submitted[-1][0]), name
    assert counts[parser] != counts[None]


def test_count_tokens_counts_a_prompt_too_long_to_serve(fakes: Any) -> None:
    engine = fakes.FakeEngine(ctx=8)
    with fakes.serve_app(create_app(ServerSettings(), engine)) as url:
        long = [{"role": "user", "content": "word " * 20}]
        assert httpx.post(url + MESSAGES, json={"messages": long}, timeout=10).status_code == 400
        r = httpx.post(url + COUNT, json={"model": "astrai", "messages": long}, timeout=10)
    assert r.status_code == 200 and r.json() == {
        "input_tokens": len(engine.tokenizer.encode("user: " + "word " * 20 + "\nassistant:"))
    }
    assert engine.submitted == []
