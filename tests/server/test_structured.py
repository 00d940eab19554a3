"""Structured outputs on a real server with the default model: every constrained answer parses and validates.

OpenAI ``response_format`` (json_object, json_schema) and vLLM's ``structured_outputs`` (json, regex,
choice, grammar) on chat and completions, the Responses API's ``text.format``, Anthropic's
``output_config.format``; streamed and not, greedy and sampled; invalid schemas are 400s; the real
clients: ``openai``'s ``chat.completions.parse`` and LangChain's ``with_structured_output``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # the real default model

ASK = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer"},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 12},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["first", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["colour", "size"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
}


def _json_schema(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _chat(client: Any, stream: bool, **kw: Any) -> str:
    args = {"model": "astrai", "messages": ASK, "max_tokens": 200, **kw}
    if not stream:
        r = client.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    return text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_always_validate(openai_client: Any, name: str, temperature: float) -> None:
    """One answer whole and one streamed (sampled: seeds 0 and 1), each parsed and validated; greedy,
    the streamed deltas add up to the whole answer."""
    texts = [
        _chat(openai_client, stream, response_format=_json_schema(name), temperature=temperature, seed=seed)
        for seed, stream in enumerate((False, True))
    ]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    if not temperature:
        assert texts[1] == texts[0]


#: Held-out-style requests (issue 30): free strings and numbers at temperature 0, where the model writes
#: JSON as it learned to (pretty-printed, a bounded run of whitespace between tokens, as vLLM allows).
HELD_OUT = {
    "city": (
        "What is the largest city in the United States? Answer in JSON.",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "population": {"type": "number"}},
            "required": ["city", "population"],
        },
    ),
    "temperature": (
        "What is a comfortable room temperature in Celsius? Answer in JSON.",
        {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]},
    ),
    "book": (
        "Name a famous novel and its author, in JSON.",
        {
            "type": "object",
            "properties": {"title": {"type": "string"}, "author": {"type": "string"}},
            "required": ["title", "author"],
        },
    ),
    "weather": (
        "What is the weather like in a desert? Answer as JSON.",
        {
            "type": "object",
            "properties": {"temperature": {"type": "number"}, "conditions": {"type": "string"}},
            "required": ["temperature", "conditions"],
        },
    ),
}  # fmt: skip  (the schemas read as written)


def _ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(HELD_OUT))
def test_held_out_json_ends_with_valid_json_at_temperature_0(
    openai_client: Any, case: str, stream: bool
) -> None:
    question, schema = HELD_OUT[case]
    fmt = {"type": "json_schema", "json_schema": {"name": case, "schema": schema}}
    text = _chat(openai_client, stream, messages=_ask(question), temperature=0, response_format=fmt)  # "stop"
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_held_out_json_object_ends_with_an_object(openai_client: Any, stream: bool) -> None:
    text = _chat(
        openai_client,
        stream,
        messages=_ask("What is 2 + 2? Reply with a JSON object."),
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(text), dict) and "\n" in text  # laid out on lines, as the model writes JSON


def test_held_out_json_through_anthropic_output_config(anthropic_client: Any) -> None:
    question, schema = HELD_OUT["weather"]
    kw = {
        "model": "astrai",
        "max_tokens": 200,
        "messages": _ask(question),
        "extra_body": {
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
            "temperature": 0,
        },
    }
    msg = anthropic_client.messages.create(**kw)
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    with anthropic_client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason == "end_turn"
    assert streamed == msg.content[0].text


def test_compact_json_on_request(openai_client: Any) -> None:
    """vLLM's ``disable_any_whitespace``: no whitespace between JSON tokens but xgrammar's separators
    (``", "``, ``": "``); the answer parses."""
    question, schema = HELD_OUT["temperature"]
    text = _chat(
        openai_client,
        False,
        messages=_ask(question),
        temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    jsonschema.validate(json.loads(text), schema)
    assert text == json.dumps(json.loads(text)), text


def test_json_object_and_n_choices(openai_client: Any) -> None:
    r = openai_client.chat.completions.create(
        model="astrai",
        messages=ASK,
        max_tokens=300,
        n=3,
        temperature=1.0,
        seed=7,
        response_format={"type": "json_object"},
    )
    assert len(r.choices) == 3
    for c in r.choices:
        if c.finish_reason == "stop":  # a free-form object may be long: only a complete one must parse
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_vllm_regex_choice_and_grammar(openai_client: Any, stream: bool) -> None:
    for seed in range(3):
        text = _chat(
            openai_client,
            stream,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,6}-[0-9]{3}"}},
        )
        assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", text), text
        text = _chat(
            openai_client,
            stream,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "it depends"]}},
        )
        assert text in ("yes", "no", "it depends")
        grammar = 'root ::= "(" digit "+" digit ")"\ndigit ::= [0-9]'
        text = _chat(
            openai_client,
            stream,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        assert re.fullmatch(r"\([0-9]\+[0-9]\)", text), text


def test_constraints_apply_with_logprobs_and_stop_strings(openai_client: Any) -> None:
    r = openai_client.chat.completions.create(
        model="astrai",
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format=_json_schema("enum"),
        logprobs=True,
        top_logprobs=2,
    )
    c = r.choices[0]
    jsonschema.validate(json.loads(c.message.content), SCHEMAS["enum"])
    assert len(c.logprobs.content) == r.usage.completion_tokens  # the raw distribution's, one per token
    cut = openai_client.chat.completions.create(
        model="astrai", messages=ASK, max_tokens=3, temperature=0, response_format=_json_schema("flat")
    )
    assert cut.choices[0].finish_reason == "length"  # max_tokens before the grammar completes


def test_completions_responses_and_anthropic_constrain_too(openai_client: Any, anthropic_client: Any) -> None:
    r = openai_client.completions.create(
        model="astrai",
        prompt="A person as JSON:",
        max_tokens=200,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"json": SCHEMAS["numbers"]}},
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["numbers"])
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMAS["flat"], "strict": True}
    resp = openai_client.responses.create(
        model="astrai", input="Describe a person.", max_output_tokens=200, text={"format": fmt}, temperature=0
    )
    jsonschema.validate(json.loads(resp.output_text), SCHEMAS["flat"])
    msg = anthropic_client.messages.create(
        model="astrai",
        max_tokens=200,
        messages=ASK,
        extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMAS["array"]}},
            "temperature": 1.0,
        },
    )
    jsonschema.validate(json.loads(msg.content[0].text), SCHEMAS["array"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "grammar",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "grammar"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
        (
            {"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
    ids=[
        "bad-schema",
        "no-schema",
        "bad-type",
        "bad-regex",
        "bad-grammar",
        "two",
        "unknown-key",
        "compact-regex",
        "choice-str",
        "both",
    ],
)
def test_invalid_constraints_are_400s_in_openai_shape(
    base_url: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        base_url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and "Traceback" not in r.text


def test_openai_parse_returns_a_populated_model(openai_client: Any) -> None:
    class Pet(BaseModel):
        name: str = Field(max_length=12)
        species: Literal["cat", "dog", "bird"]
        age: int

    r = openai_client.chat.completions.parse(
        model="astrai",
        messages=[{"role": "user", "content": "Invent a pet."}],
        response_format=Pet,
        max_tokens=120,
        temperature=0,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.species in ("cat", "dog", "bird")


def test_langchain_with_structured_output_default_method(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    class City(BaseModel):
        """A city and its country."""

        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    llm = ChatOpenAI(model="astrai", base_url=base_url + "/v1", api_key="x", temperature=0, max_tokens=80)
    got = llm.with_structured_output(City).invoke("Name a big city and its country.")
    assert isinstance(got, City) and got.city and got.country


def test_a_bad_schema_does_not_stall_or_break_other_requests(openai_client: Any) -> None:
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(
            model="astrai",
            messages=ASK,
            max_tokens=8,
            extra_body={"structured_outputs": {"json": {"type": "nope"}}},
        )
    assert _chat(
        openai_client, False, temperature=0, extra_body={"structured_outputs": {"choice": ["a", "b"]}}
    ) in ("a", "b")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_forced_tool_calls_always_parse_and_validate(openai_client: Any, choice: Any) -> None:
    for seed in range(3):
        r = openai_client.chat.completions.create(
            model="astrai",
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            max_tokens=120,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=False,
        )
        c = r.choices[0]
        assert (
            c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        )
        fn = c.message.tool_calls[0].function
        if isinstance(choice, dict):
            assert fn.name == "get_time"
        jsonschema.validate(json.loads(fn.arguments), SCHEMA_OF[fn.name])


def test_anthropic_forced_tool_use_validates(anthropic_client: Any) -> None:
    tool = {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    for _ in range(2):
        msg = anthropic_client.messages.create(
            model="astrai",
            max_tokens=120,
            messages=[{"role": "user", "content": "Weather in Lima?"}],
            tools=[tool],
            tool_choice={"type": "any"},
            extra_body={"temperature": 1.0},
        )
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["function"]["parameters"])


def test_auto_stays_free_text_but_a_call_the_model_opens_is_valid(openai_client: Any, engine: Any) -> None:
    """``auto``: a plain answer stays text; a model pushed (by logit_bias) to write ``<tool_call>`` over and
    over can only complete a valid call of an offered tool once it has opened one."""
    ask = [{"role": "user", "content": "Say hello."}]
    plain = openai_client.chat.completions.create(
        model="astrai", messages=ask, max_tokens=20, temperature=0, tools=[WEATHER]
    )
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.choices[0].message.content
    bias = dict.fromkeys(engine.tokenizer.encode("<tool_call>"), 100)
    r = openai_client.chat.completions.create(
        model="astrai",
        messages=ask,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER],
        logit_bias=bias,
        stop=["</tool_call>"],
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
