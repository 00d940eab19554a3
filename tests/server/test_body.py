"""The bounds on a request body (``astrai_server.body``) and on the settings that guard the server,
without a model: the depth scan against a recursive count over generated JSON (escapes, brackets
inside strings), the decoder's refusals with their exact messages, the text weight that refuses a
prompt too long for the context, and the refused API keys."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.errors import RequestRejected
from astrai_server.body import MAX_DEPTH, MAX_VALUES, decode_json, structure
from astrai_server.config import ServerSettings, load_settings
from astrai_server.errors import ConfigError, HTTPProblem
from astrai_server.fit import TextBound, refuse_oversized, text_bound, text_weight

_TEXT = st.text(alphabet=st.sampled_from('ab"\\[]{}\n\u00e9\U0001f600'), max_size=6)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=30,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _values(value: Any) -> int:
    """Commas plus arrays and objects: what ``structure`` counts."""
    items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else None
    if items is None:
        return 0
    return 1 + max(len(items) - 1, 0) + sum(map(_values, items))


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_the_structure_scan_counts_brackets_and_commas_outside_strings_only(
    value: Any, ascii_only: bool
) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert structure(raw) == (_depth(value), _values(value))


def test_the_structure_scan_spans_its_chunks() -> None:
    # a string that crosses a chunk boundary, and a run of backslashes that would straddle the next one
    raw = b'["' + b"[" * (1 << 20) + b'", "' + b"\\\\" * (1 << 19) + b'\\"", ' + b"[" * 70 + b"]" * 70 + b"]"
    assert structure(raw) == (71, 73)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": "\xff"}', "request body is not valid JSON: not UTF-8 at byte 7 (0xff: invalid start byte)"),
        (
            b'{"a": "\xed\xa0\x80"}',
            "request body is not valid JSON: not UTF-8 at byte 7 (0xed: invalid continuation byte)",
        ),
        (
            b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
            "request body nests arrays and objects more than 64 levels deep",
        ),
        (
            b'{"a":' * 5000 + b"1" + b"}" * 5000,
            "request body nests arrays and objects more than 64 levels deep",
        ),
        (b"[" + b"0," * MAX_VALUES + b"0]", "request body holds more than 1048576 JSON values"),
        (b'{"stop": [' + b'"",' * MAX_VALUES + b'""]}', "request body holds more than 1048576 JSON values"),
        (b'{"messages": [', "request body is not valid JSON: Expecting value: line 1 column 15 (char 14)"),
        (b'{"model": "\\ud800"}', "model: a lone surrogate (\\ud800) is not text"),
        (
            b'{"m": [{"content": "ok \\udc00 \\\\ud800"}]}',
            "m.0.content: a lone surrogate (\\udc00) is not text",
        ),
        (b'{"m": {"\\udbff": 1}}', "invalid key m.\\udbff: a lone surrogate (\\udbff) is not text"),
    ],
)
def test_refused_bodies(raw: bytes, message: str) -> None:
    with pytest.raises(HTTPProblem) as caught:
        decode_json(raw)
    assert (caught.value.status, caught.value.message) == (400, message)


def test_accepted_bodies() -> None:
    assert decode_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) == json.loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    assert len(decode_json(b"[" + b"0," * (MAX_VALUES - 2) + b"0]")) == MAX_VALUES - 1  # commas + 1 array
    assert decode_json(b'["' + b"[,]" * MAX_VALUES + b'"]') == ["[,]" * MAX_VALUES]  # inside a string: text
    assert decode_json(b'\xef\xbb\xbf{"a": "\\ud83d\\ude00 \\\\ud800 \xc3\xa9"}') == {
        "a": "\U0001f600 \\ud800 \u00e9"
    }
    big = {
        "a": [1, 2.5, {"b": "c" * (2 << 20)}],
        "d": None,
    }  # past LARGE_BODY: the yielding hooks decode it the same
    assert decode_json(json.dumps(big).encode()) == big


def test_text_weight_sums_one_prompt_and_takes_the_longest_alternative() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "  abc  "}, {"role": "assistant", "content": "de"}],
    }
    assert text_weight(chat) == 1 + 4 + 7 + 9 + 2
    assert text_weight({"prompt": ["abcd", "ef"], "stop": ["x", "yz"]}) == 4 + 2  # alternatives: the longest
    assert (
        text_weight({"prompt": [[1, 2, 3], [4]], "temperature": 0.5}) == 3
    )  # prompts of token ids: the longest
    assert text_weight({"prompt": [5, 6, 7, 8], "logit_bias": {"50": 1, "51": -1}}) == 4  # one token per id


def _engine(per_token: int, limit: int) -> Any:
    tokenizer = SimpleNamespace(vocab_size=3, token_bytes=lambda i: b"x" * (per_token if i == 2 else 1))
    return SimpleNamespace(tokenizer=tokenizer, context_limit=limit)


def test_a_text_that_cannot_fit_is_refused_and_one_that_may_is_not() -> None:
    bound = text_bound(_engine(per_token=4, limit=10))  # no prompt of 40 characters or more fits
    assert bound == TextBound(limit=10, per_token=4) and bound.chars == 40
    refuse_oversized({"messages": [{"content": "x" * 39}]}, bound, size=1000)
    with pytest.raises(RequestRejected) as caught:
        refuse_oversized({"messages": [{"content": "x" * 30}, {"content": "y" * 10}]}, bound, size=1000)
    assert str(caught.value) == (
        "the prompt is at least 10 tokens (a text of 40 characters, at most 4 characters per token), "
        "but the context limit is 10 tokens (prompt plus at least one generated token)"
    )
    refuse_oversized({"prompt": ["x" * 39, "y" * 39]}, bound, size=1000)  # two prompts, each may fit
    assert (
        text_bound(SimpleNamespace(tokenizer=object(), context_limit=10)) is None
    )  # a tokenizer that cannot say


@pytest.mark.parametrize(
    ("text", "at_least"),
    [
        ("x" * (3 << 20), 2 << 20),  # ASCII: one character per byte, over the steps wholly inside it
        ("\\u00e9" * (3 << 20), 0),  # escapes: 6 bytes for one character, not counted
        ("é" * (3 << 20), 1 << 20),  # two bytes per character
    ],
    ids=["ascii", "escapes", "utf-8"],
)
def test_one_long_string_is_refused_before_it_is_parsed(text: str, at_least: int) -> None:
    raw = (
        '{"messages": [{"role": "user", "content": "' + text + '"}]'
    ).encode()  # not even JSON: never parsed
    bound = TextBound(limit=1000, per_token=1)
    if not at_least:  # what the steps prove is under the bound: parsed (and then found not to be JSON)
        with pytest.raises(HTTPProblem, match="request body is not valid JSON"):
            decode_json(raw, bound)
        return
    with pytest.raises(RequestRejected) as caught:
        decode_json(raw, bound)
    chars = int(str(caught.value).split("a string of at least ")[1].split()[0])
    assert at_least <= chars <= len(text)


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("", "the API key is empty or only whitespace; leave it unset to serve without a key"),
        (" \t ", "the API key is empty or only whitespace; leave it unset to serve without a key"),
        (" key", "the API key begins or ends with whitespace, which HTTP headers drop"),
        ("key\n", "the API key begins or ends with whitespace, which HTTP headers drop"),
        ("k\x00ey", "the API key holds a control character, which HTTP headers cannot carry"),
    ],
)
def test_keys_no_client_can_send_are_refused(key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({"api_key": key})
    assert str(caught.value) == f"--api-key: Value error, {reason} (got {key!r})"
    assert ServerSettings(api_key="clé à").api_key == ["clé à"]  # a string is one key


def test_the_body_limit_takes_a_size() -> None:
    assert ServerSettings().max_request_bytes == 32 * 2**20
    assert load_settings({"max_request_bytes": "1MiB"}).max_request_bytes == 2**20
    with pytest.raises(ConfigError, match="--max-request-bytes"):
        load_settings({"max_request_bytes": 0})


def test_the_limit_is_the_settings(fakes: Any) -> None:
    """Through the app (a fake engine): a body one byte over ``max_request_bytes`` is the 413, one at it is
    served."""
    import httpx

    from astrai.hooks import PluginManager
    from astrai_server.app import create_app
    from astrai_server.protocols.anthropic import AnthropicResponseBuilder
    from astrai_server.protocols.openai import OpenAIResponseBuilder

    builders = [OpenAIResponseBuilder(), AnthropicResponseBuilder()]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    app = create_app(
        ServerSettings(max_request_bytes=len(body)), fakes.FakeEngine(), builders, plugins=PluginManager()
    )
    with fakes.serve_app(app) as url:
        headers = {"content-type": "application/json"}
        assert (
            httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=10).status_code
            == 200
        )
        r = httpx.post(url + "/v1/chat/completions", content=body + b" ", headers=headers, timeout=10)
        assert (r.status_code, r.json()["error"]["message"]) == (
            413,
            f"request body is {len(body) + 1} bytes, "
            f"more than the limit of {len(body)} bytes (--max-request-bytes)",
        )
        r = httpx.post(
            url + "/v1/messages", content=iter([body, b" "]), headers=headers, timeout=10
        )  # chunked
        assert r.status_code == 413 and r.json() == {
            "type": "error",
            "error": {
                "type": "request_too_large",
                "message": (
                    f"request body is larger than the limit of {len(body)} bytes (--max-request-bytes)"
                ),
            },
        }


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_json_number_literals_are_refused(literal: str) -> None:
    """Python's json takes NaN and Infinity; a reply echoing one (a Responses tool's schema) could not be
    written."""
    with pytest.raises(HTTPProblem, match=f"request body is not valid JSON: {literal} is not a JSON number"):
        decode_json(('{"tools": [{"parameters": {"x": ' + literal + "}}]}").encode())
