"""Thinking controls through a real uvicorn server and the official ``openai`` SDK, on a tiny random
Qwen3 whose template opens the think block in the prompt (as Qwen3's thinking-only and DeepSeek-R1's
do; ``think_in_prompt: false`` leaves the model to open it) and closes it for ``enable_thinking``
false. Greedy decoding with EOS ignored makes the thinking run as long as the budget lets it; the
log-probs' tokens show where the forced end of thinking sits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif think_in_prompt is not defined or think_in_prompt %}{{ '<think>\\n' }}"
    "{%- endif %}{%- endif %}"
)
END = "\n</think>\n\n"
MESSAGES = [{"role": "user", "content": "hi"}]
WORD = " so"  # greedy picks it wherever it may (logit bias): the thinking and answer are "so so so"


@pytest.fixture(scope="module")
def urls(tmp_path_factory, default_model_path, serve) -> Iterator[tuple[str, str, Any]]:
    """Base URLs of two servers over one tiny Qwen3 engine: the template's own reasoning parser
    (``qwen3``), and ``--reasoning-parser none``; and the engine."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.model.tokenizer import Tokenizer
    from astrai_server import ServerSettings, create_app

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
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    engine = InferenceEngine.from_model(
        str(folder), dtype=torch.float32, config=EngineConfig(max_seq_len=2048)
    )
    try:
        with serve(create_app(ServerSettings(), engine)) as url:
            with serve(create_app(ServerSettings(reasoning_parser="none"), engine)) as plain:
                yield url, plain, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(urls: tuple) -> Iterator[Any]:
    from openai import OpenAI

    with OpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0) as c:
        c.bias = _bias(urls[2])
        yield c


def _bias(engine: Any) -> dict[str, float]:
    (word,) = engine.tokenizer.encode(WORD, add_special_tokens=False)
    return {str(word): 100.0}


def _chat(client: Any, max_tokens: int, **body: Any) -> Any:
    return client.chat.completions.create(
        model="astrai",
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        logit_bias=client.bias,
        extra_body={"ignore_eos": True, **body},
    )


def _tokens(r: Any) -> list[str]:
    return [t.token for t in r.choices[0].logprobs.content]


def _end_len(engine: Any) -> int:
    return len(engine.tokenizer.encode(END, add_special_tokens=False))


@pytest.mark.parametrize("spelling", ["thinking_token_budget", "thinking_budget"])
def test_a_budget_ends_the_thinking_at_exactly_the_budget(client, urls, spelling: str) -> None:
    k = _end_len(urls[2])
    r = _chat(client, 24, **{spelling: 6})
    tokens, message = _tokens(r), r.choices[0].message
    assert "".join(tokens[6 : 6 + k]) == END  # six tokens of thinking, then the end of thinking
    assert END not in "".join(tokens[:6])
    assert message.reasoning_content == "".join(tokens[:6]).strip()
    assert message.content == "".join(tokens[6 + k :]).lstrip() and message.content  # the answer goes on
    assert r.usage.completion_tokens == 24  # max_tokens bounds the total
    assert 6 <= r.usage.completion_tokens_details.reasoning_tokens <= 6 + k


def test_a_budget_of_zero_ends_the_thinking_at_once_and_spellings_agree(client, urls) -> None:
    k = _end_len(urls[2])
    zero = _chat(client, 12, thinking_token_budget=0, thinking_budget=0)
    assert "".join(_tokens(zero)[:k]) == END
    assert getattr(zero.choices[0].message, "reasoning_content", None) is None
    assert zero.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"thinking_budget": -2}, "thinking_budget"),
        ({"thinking_token_budget": 9}, "thinking_token_budget"),  # above max_tokens
        ({"thinking_token_budget": 2, "thinking_budget": 3}, "thinking_budget"),
    ],
    ids=["negative", "negative-sglang", "above-max-tokens", "two-values"],
)
def test_bad_budgets_are_400s_naming_the_field(client, body: dict, param: str) -> None:
    import openai

    calls = [
        (client.chat.completions.create, {"messages": MESSAGES}),
        (client.completions.create, {"prompt": "hi"}),
    ]
    for create, args in calls:
        with pytest.raises(openai.BadRequestError) as err:
            create(model="astrai", max_tokens=8, extra_body=body, **args)
        assert err.value.body["param"].split(".")[0] == param, err.value.body
        assert param in err.value.body["message"]


def test_an_unknown_effort_is_refused_by_the_schema(client) -> None:
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as err:  # the server's status for schema errors
        client.chat.completions.create(model="astrai", messages=MESSAGES, reasoning_effort="extreme")
    assert err.value.body["param"] == "reasoning_effort"


def test_a_budget_on_a_model_that_does_not_think_is_a_400(urls) -> None:
    import openai
    from openai import OpenAI

    with OpenAI(base_url=urls[1] + "/v1", api_key="unused", max_retries=0) as plain:
        with pytest.raises(openai.BadRequestError) as err:
            plain.chat.completions.create(
                model="astrai", messages=MESSAGES, max_tokens=8, extra_body={"thinking_token_budget": 4}
            )
        assert err.value.body["param"] == "thinking_token_budget"
        effort = plain.chat.completions.create(  # an effort is a hint: ignored where nothing thinks
            model="astrai", messages=MESSAGES, max_tokens=4, reasoning_effort="low"
        )
        assert effort.usage.completion_tokens <= 4


def test_completions_take_a_budget(client, urls) -> None:
    k = _end_len(urls[2])
    r = client.completions.create(
        model="astrai",
        prompt="<think>\n",  # the prompt opened the block: the output starts inside it
        max_tokens=12,
        temperature=0,
        logprobs=0,
        logit_bias=client.bias,
        extra_body={"thinking_budget": 3, "ignore_eos": True},
    )
    assert "".join(r.choices[0].logprobs.tokens[3 : 3 + k]) == END


def test_reasoning_effort_none_turns_thinking_off_and_low_bounds_it(client, urls) -> None:
    from astrai_server.protocols.openai import ChatCompletionRequest, OpenAIResponseBuilder

    on = _chat(client, 4)
    off = _chat(client, 4, reasoning_effort="none")
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template closed the block
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert on.choices[0].message.reasoning_content
    for max_tokens, budget in ((4096, 1024), (100, 100)):  # low: 1024 tokens, capped by max_tokens
        request = ChatCompletionRequest(messages=MESSAGES, max_tokens=max_tokens, reasoning_effort="low")
        prepared = OpenAIResponseBuilder().prepare(request, urls[2])
        assert (prepared.params.thinking_budget, prepared.thinking_param) == (budget, "reasoning_effort")


@pytest.mark.parametrize("in_prompt", [True, False], ids=["prompt-opens", "model-opens"])
def test_json_mode_constrains_the_answer_after_free_thinking(client, in_prompt: bool) -> None:
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(
        model="astrai",
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        logit_bias=client.bias,
        response_format=fmt,
        extra_body={"thinking_token_budget": 8, "chat_template_kwargs": {"think_in_prompt": in_prompt}},
    )
    message = r.choices[0].message
    if in_prompt:  # else the grammar lets the model skip the thinking, as it may unconstrained
        assert message.reasoning_content  # free thinking, ended by the budget
    jsonschema.validate(json.loads(message.content), schema)
    assert r.choices[0].finish_reason == "stop"


def test_responses_reasoning_effort_and_max_tokens(urls) -> None:
    import httpx

    def post(reasoning: dict) -> httpx.Response:
        body = {"input": "hi", "max_output_tokens": 6, "temperature": 0, "reasoning": reasoning}
        return httpx.post(urls[0] + "/v1/responses", json=body, timeout=60)

    on, off = post({"effort": "high"}), post({"effort": "minimal"})
    assert (on.status_code, off.status_code) == (200, 200), (on.text, off.text)
    assert off.json()["usage"]["input_tokens"] > on.json()["usage"]["input_tokens"]  # closed in the prompt
    assert post({"max_tokens": 2}).status_code == 200
    for reasoning in ({"max_tokens": 7}, {"max_tokens": -1}, {"effort": "extreme"}):
        bad = post(reasoning)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "reasoning." + next(iter(reasoning)), bad.text


def test_a_streamed_budget_gives_the_same_split(client) -> None:
    whole = _chat(client, 16, thinking_token_budget=4).choices[0].message
    stream = client.chat.completions.create(
        model="astrai",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        logit_bias=client.bias,
        stream=True,
        extra_body={"ignore_eos": True, "thinking_token_budget": 4},
    )
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
