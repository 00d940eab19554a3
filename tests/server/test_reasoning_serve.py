"""Reasoning through a real uvicorn server and the official ``openai`` SDK, on a tiny random Qwen3 with
the default model's tokenizer and a chat template in Qwen3's format (so the ``qwen3`` reasoning
parser is chosen from it). A regex grammar (``structured_outputs``) forces what the model writes, so
the split is deterministic: ``reasoning_content`` beside ``content``, streamed and not, and
``chat_template_kwargs`` reaching the template (``enable_thinking: false`` closes the think block
in the prompt, which makes it longer)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
THOUGHT, ANSWER = "I think so", "Hello there"
FORCED = {"regex": "<think>\\n" + THOUGHT + "\\n</think>\\n\\n" + ANSWER}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory, default_model_path) -> Iterator[Any]:
    """The engine of a tiny random Qwen3 (HF folder) whose template teaches Qwen3's ``<think>``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from astrai.engine import EngineConfig, InferenceEngine
    from astrai.model.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = Tokenizer.from_gguf(default_model_path)
    tokenizer.hf.chat_template = TEMPLATE
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
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    engine = InferenceEngine.from_model(
        str(folder), dtype=torch.float32, config=EngineConfig(max_seq_len=512)
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def client(qwen3_engine: Any, fakes: Any) -> Iterator[Any]:
    """The ``openai`` SDK on a real uvicorn server of every installed protocol over ``qwen3_engine``."""
    from openai import OpenAI

    from astrai_server import ServerSettings, create_app

    with fakes.serve_app(create_app(ServerSettings(), qwen3_engine)) as url:
        with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
            yield c


def test_reasoning_content_beside_content(client: Any) -> None:
    r = client.chat.completions.create(
        model="astrai", messages=MESSAGES, max_tokens=64, extra_body={"structured_outputs": FORCED}
    )
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    reasoning_tokens = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < r.usage.completion_tokens


def test_reasoning_content_streamed(client: Any) -> None:
    stream = client.chat.completions.create(
        model="astrai",
        messages=MESSAGES,
        max_tokens=64,
        stream=True,
        extra_body={"structured_outputs": FORCED},
    )
    reasoning, content, order, usage = "", "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if piece := getattr(choice.delta, "reasoning_content", None):
                reasoning += piece
                order.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                order.append("content")
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert order == sorted(order, reverse=True)  # every reasoning delta before the first content delta
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_thinking_off_reaches_the_template(client: Any) -> None:
    forced = {"regex": ANSWER}
    on = client.chat.completions.create(
        model="astrai", messages=MESSAGES, max_tokens=16, extra_body={"structured_outputs": forced}
    )
    off = client.chat.completions.create(
        model="astrai",
        messages=MESSAGES,
        max_tokens=16,
        extra_body={"structured_outputs": forced, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template closed the think block
    assert off.choices[0].message.content == ANSWER
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_template_options_are_not_template_variables(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="astrai",
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
        )
    assert err.value.body["param"] == "chat_template_kwargs.chat_template"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_are_read_after_the_reasoning(client: Any, stream: bool) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
    call = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Rome"\\}\\}\\n</tool_call>'
    forced = {"regex": "<think>\\n" + THOUGHT + "\\n</think>\\n\\n" + call}
    kwargs = dict(model="astrai", messages=MESSAGES, max_tokens=80, tools=[tool])
    if not stream:
        r = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": forced})
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        reasoning, content, calls = message.reasoning_content, message.content, message.tool_calls
    else:
        reasoning, content, parts, finish = "", "", {}, None
        for chunk in client.chat.completions.create(
            **kwargs, stream=True, extra_body={"structured_outputs": forced}
        ):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:  # a call's name first, then its arguments
                    name, args = parts.get(d.index, ("", ""))
                    parts[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
                finish = choice.finish_reason or finish
        content = content or None
        calls = [SimpleNamespace(function=SimpleNamespace(name=n, arguments=a)) for n, a in parts.values()]
    assert (reasoning, content, finish) == (THOUGHT, None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]


def test_completions_keep_the_text_as_generated(client: Any) -> None:
    r = client.completions.create(
        model="astrai", prompt="hi", max_tokens=64, extra_body={"structured_outputs": FORCED}
    )
    assert r.choices[0].text == "<think>\n" + THOUGHT + "\n</think>\n\n" + ANSWER
    assert r.usage.completion_tokens_details is None
