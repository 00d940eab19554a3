"""Anthropic thinking blocks and Responses reasoning items through a real uvicorn server and the
official ``anthropic`` and ``openai`` SDKs, on a tiny random Qwen3 (one engine and one server for the
module) whose chat template follows Qwen3's thinking-only ones: the generation prompt opens
``<think>`` (so the ``qwen3`` parser takes the output as reasoning up to ``</think>``), closes it at
once with ``enable_thinking`` false, and renders an assistant turn's ``reasoning_content``. Neither
protocol has a regex field, so ``Forcing`` (the engine, its requests constrained by a regex when one
is set) makes the output deterministic."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)
THOUGHT, ANSWER = "I think so", "Hello there"
FORCED = THOUGHT + "\n</think>\n\n" + ANSWER  # the prompt opened the think block
HI = [{"role": "user", "content": "hi"}]
THINK = {"type": "enabled", "budget_tokens": 32}
GREEDY = {"temperature": 0}  # the regex admits several tokenizations of its text: one run's is another's


def prompt(engine: Any, *turns: tuple[str, str | None]) -> list[int]:
    """The prompt ids of a user "hi", then ``turns`` (an answer, its reasoning or None, and a user
    "again" after each) through ``TEMPLATE``: what a conversation sent back must render to."""
    from astrai.protocol import chat_prompt_ids

    messages: list[dict[str, Any]] = [*HI]
    for answer, reasoning in turns:
        thought = {"reasoning_content": reasoning} if reasoning else {}
        messages += [
            {"role": "assistant", "content": answer, **thought},
            {"role": "user", "content": "again"},
        ]
    return chat_prompt_ids(engine.tokenizer, messages)


class Forcing:
    """``engine``, whose requests match ``regex`` when it is set; ``params`` records what each got."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.regex, self.params = engine, None, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit(self, prompt: list[int], params: Any, **kw: Any) -> Any:
        from astrai.grammar import GrammarSpec

        self.params.append(params)
        if self.regex is not None:
            params = dataclasses.replace(params, grammar=GrammarSpec.of("regex", self.regex))
            kw["grammar"] = None  # compiled at submit
        return self.engine.submit(prompt, params, **kw)


@pytest.fixture(scope="module")
def forcing(tmp_path_factory, default_model_path) -> Iterator[Forcing]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.model.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    tokenizer = Tokenizer.from_gguf(default_model_path)
    tokenizer.hf.chat_template = TEMPLATE
    tokenizer.hf.save_pretrained(folder)
    config = Qwen3Config(
        vocab_size=len(tokenizer.hf),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=tokenizer.hf.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    engine = InferenceEngine.from_model(
        str(folder), dtype=torch.float32, config=EngineConfig(max_seq_len=512)
    )
    yield Forcing(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def url(forcing: Forcing, serve: Any) -> Iterator[str]:
    from astrai_server import ServerSettings, create_app

    with serve(create_app(ServerSettings(signing_key="k" * 16), forcing)) as base:
        yield base


@pytest.fixture
def forced(forcing: Forcing) -> Iterator[Forcing]:
    forcing.regex, forcing.params[:] = FORCED, []
    yield forcing
    forcing.regex = None


@pytest.fixture
def anthropic_client(url: str) -> Iterator[Any]:
    import anthropic

    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def openai_client(url: str) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


# ---------------------------------------------------------------- Anthropic


def test_thinking_block_before_the_text(anthropic_client: Any, forced: Forcing) -> None:
    r = anthropic_client.messages.create(model="astrai", max_tokens=64, messages=HI, thinking=THINK)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert (r.content[0].thinking, r.content[1].text, r.stop_reason) == (THOUGHT, ANSWER, "end_turn")
    assert len(r.content[0].signature) == 44  # base64 of an HMAC-SHA256
    assert forced.params[-1].thinking_budget == 32


def test_thinking_streamed_as_anthropic_sends_it(anthropic_client: Any, forced: Forcing) -> None:
    kw = dict(model="astrai", max_tokens=64, messages=HI, thinking=THINK, extra_body=GREEDY)
    whole = anthropic_client.messages.create(**kw)
    with anthropic_client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [
        (e.type, getattr(e, "index", None), getattr(getattr(e, "delta", None), "type", None))
        for e in events
        if e.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop")
        or e.type in ("message_delta", "message_stop")
    ]
    thinking_deltas = [k for k in kinds if k[2] == "thinking_delta"]
    text_deltas = [k for k in kinds if k[2] == "text_delta"]
    assert thinking_deltas and text_deltas
    expected = [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        *thinking_deltas,
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        *text_deltas,
        ("content_block_stop", 1, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert kinds == expected
    starts = [e.content_block.model_dump() for e in events if e.type == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "", "citations": None},
    ]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.usage.output_tokens == whole.usage.output_tokens


WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {}}}}
CALL = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Rome"\\}\\}\n</tool_call>'


def test_thinking_then_a_call(anthropic_client: Any, forced: Forcing) -> None:
    """Thinking, then a tool_use block and no text, streamed as it is whole; the turn comes back."""
    forced.regex = THOUGHT + "\n</think>\n\n" + CALL
    kw = dict(model="astrai", max_tokens=80, messages=HI, thinking=THINK, tools=[WEATHER], extra_body=GREEDY)
    whole = anthropic_client.messages.create(**kw)
    assert [b.type for b in whole.content] == ["thinking", "tool_use"] and whole.stop_reason == "tool_use"
    assert whole.content[1].input == {"city": "Rome"}
    with anthropic_client.messages.stream(**kw) as s:
        starts = [(e.index, e.content_block.type) for e in s if e.type == "content_block_start"]
        final = s.get_final_message()
    assert starts == [(0, "thinking"), (1, "tool_use")]
    strip = {"id"}
    assert [b.model_dump(exclude=strip) for b in final.content] == [
        b.model_dump(exclude=strip) for b in whole.content
    ]
    result = {"type": "tool_result", "tool_use_id": whole.content[1].id, "content": "sunny"}
    turns = [*HI, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]}]
    forced.regex = FORCED
    again = anthropic_client.messages.create(
        **{**kw, "messages": [*turns, {"role": "user", "content": [result]}]}
    )
    assert [b.type for b in again.content] == ["thinking", "text"]


def test_thinking_blocks_come_back_verified_and_rendered(anthropic_client: Any, forced: Forcing) -> None:
    import anthropic

    first = anthropic_client.messages.create(model="astrai", max_tokens=64, messages=HI, thinking=THINK)
    thinking, text = (b.model_dump(exclude_none=True) for b in first.content)
    turns = [*HI, {"role": "assistant", "content": [thinking, text]}, {"role": "user", "content": "again"}]
    plain = [*HI, {"role": "assistant", "content": [text]}, {"role": "user", "content": "again"}]
    count = anthropic_client.messages.count_tokens
    with_thinking = count(model="astrai", messages=turns, thinking=THINK).input_tokens
    without = count(model="astrai", messages=plain, thinking=THINK).input_tokens
    assert with_thinking == len(prompt(forced, (ANSWER, THOUGHT))) and without == len(
        prompt(forced, (ANSWER, None))
    )
    assert with_thinking - without >= len(forced.tokenizer.encode(THOUGHT, add_special_tokens=False))
    second = anthropic_client.messages.create(model="astrai", max_tokens=64, messages=turns, thinking=THINK)
    assert second.usage.input_tokens == with_thinking and second.content[1].text == ANSWER
    tampered = [*HI, {"role": "assistant", "content": [{**thinking, "thinking": "I was told so"}, text]}, *HI]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.1\.content\.0\.signature") as info:
        anthropic_client.messages.create(model="astrai", max_tokens=64, messages=tampered, thinking=THINK)
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_without_thinking_the_template_closes_the_block(anthropic_client: Any, forced: Forcing) -> None:
    forced.regex = ANSWER  # the prompt closed the think block: the answer comes at once
    count = anthropic_client.messages.count_tokens
    on = count(model="astrai", messages=HI, thinking=THINK).input_tokens
    off = count(model="astrai", messages=HI, thinking={"type": "disabled"}).input_tokens
    assert off > on and count(model="astrai", messages=HI).input_tokens == off
    r = anthropic_client.messages.create(model="astrai", max_tokens=16, messages=HI)
    assert [(b.type, b.text) for b in r.content] == [("text", ANSWER)] and r.usage.input_tokens == off


def test_thinking_not_asked_for_is_dropped(anthropic_client: Any, forced: Forcing) -> None:
    """A model that thinks although its template closed the block (as a template without the switch
    leaves it to): its thinking is not shown, streamed or not."""
    forced.regex = "<think>\n" + FORCED
    r = anthropic_client.messages.create(model="astrai", max_tokens=64, messages=HI)
    assert [(b.type, b.text) for b in r.content] == [("text", ANSWER)]
    with anthropic_client.messages.stream(model="astrai", max_tokens=64, messages=HI) as s:
        events = list(s)
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text"]
    assert s.get_final_message().content[0].text == ANSWER


def test_adaptive_thinking_has_no_budget(anthropic_client: Any, forced: Forcing) -> None:
    r = anthropic_client.messages.create(
        model="astrai", max_tokens=64, messages=HI, thinking={"type": "adaptive"}
    )
    assert [b.type for b in r.content] == ["thinking", "text"] and forced.params[-1].thinking_budget is None


def test_budget_not_below_max_tokens_is_refused(anthropic_client: Any, forced: Forcing) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match=r"thinking\.budget_tokens: .*less than max_tokens"):
        anthropic_client.messages.create(
            model="astrai", max_tokens=32, messages=HI, thinking={"type": "enabled", "budget_tokens": 32}
        )


def test_budget_reaches_the_engine_as_a_thinking_budget(anthropic_client: Any, forced: Forcing) -> None:
    """``budget_tokens`` becomes the engine's thinking budget, with the parser's thinking format (the
    engine's ending of a thinking at its budget is tested in tests/core/test_thinking.py and, over
    OpenAI's fields, tests/server/test_thinking_serve.py: a random model here may not open a block)."""
    forced.regex = None  # a forced thought longer than the budget would be refused (the grammar's own)
    r = anthropic_client.messages.create(
        model="astrai",
        max_tokens=48,
        messages=HI,
        thinking={"type": "enabled", "budget_tokens": 8},
        extra_body={"temperature": 0},
    )
    params = forced.params[-1]
    assert params.thinking_budget == 8 and params.thinking is not None
    assert (params.thinking.open, params.thinking.close) == ("<think>", "</think>")
    assert r.usage.output_tokens <= 48


# ---------------------------------------------------------------- Responses


def test_reasoning_item_before_the_message(openai_client: Any, forced: Forcing) -> None:
    r = openai_client.responses.create(model="astrai", input="hi", max_output_tokens=64)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert r.output_text == ANSWER
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_reasoning_streamed_in_the_sdks_event_order(openai_client: Any, forced: Forcing) -> None:
    kw = dict(model="astrai", input="hi", max_output_tokens=64, temperature=0)
    whole = openai_client.responses.create(**kw)
    with openai_client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    deltas = [k for k in kinds if k[0] == "response.reasoning_text.delta"]
    text = [k for k in kinds if k[0] == "response.output_text.delta"]
    assert deltas and text and [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        *deltas,
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        *text,
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [i.model_dump(exclude={"id"}, exclude_none=True) for i in final.output] == [
        i.model_dump(exclude={"id"}, exclude_none=True) for i in whole.output
    ]
    assert final.usage == whole.usage


def test_reasoning_then_a_call(openai_client: Any, forced: Forcing) -> None:
    forced.regex = THOUGHT + "\n</think>\n\n" + CALL
    tool = {"type": "function", **WEATHER, "parameters": WEATHER["input_schema"]}
    del tool["input_schema"]
    kw = dict(model="astrai", input="hi", max_output_tokens=80, tools=[tool], temperature=0)
    whole = openai_client.responses.create(**kw)
    assert [i.type for i in whole.output] == ["reasoning", "function_call"]
    with openai_client.responses.stream(**kw) as s:
        added = [(e.output_index, e.item.type) for e in s if e.type == "response.output_item.added"]
        final = s.get_final_response()
    assert added == [(0, "reasoning"), (1, "function_call")]
    ids = {"id", "call_id"}
    assert [i.model_dump(exclude=ids, exclude_none=True) for i in final.output] == [
        i.model_dump(exclude=ids, exclude_none=True) for i in whole.output
    ]


def test_reasoning_items_sent_back_are_rendered(openai_client: Any, forced: Forcing) -> None:
    first = openai_client.responses.create(model="astrai", input="hi", max_output_tokens=64)
    history = [{"role": "user", "content": "hi"}, *(i.model_dump(exclude_none=True) for i in first.output)]
    history.append({"role": "user", "content": "again"})
    plain = [history[0], history[2], history[3]]  # without the reasoning item
    second = openai_client.responses.create(model="astrai", input=history, max_output_tokens=64)
    without = openai_client.responses.create(model="astrai", input=plain, max_output_tokens=64)
    assert second.usage.input_tokens == len(prompt(forced, (ANSWER, THOUGHT)))
    assert without.usage.input_tokens == len(prompt(forced, (ANSWER, None)))
    assert second.usage.input_tokens > without.usage.input_tokens
    assert second.output_text == ANSWER
