"""POST /v1/completions on a real server with the default model (float32, greedy): the official ``openai``
SDK, litellm's ``text_completion`` and the raw SSE transcript.

References are independent of the HTTP path: the engine's own ``generate()`` and the tokenizer.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real default model

PROMPT = "The capital of France is"
OTHER = "One, two, three,"


def _greedy(engine: Any, prompt: str, max_tokens: int, **sampling: Any) -> str:
    return engine.generate(prompt, temperature=0, max_tokens=max_tokens, **sampling)


def _ids(engine: Any, prompt: str) -> list[int]:
    return engine.tokenizer.encode(prompt, add_special_tokens=True)


def test_string_prompt_default_max_tokens_and_usage(openai_client: Any, engine: Any) -> None:
    r = openai_client.completions.create(
        model="astrai", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    (c,) = r.choices
    expected = _greedy(engine, PROMPT, 16, ignore_eos=True)  # max_tokens defaults to 16, as OpenAI's
    assert (c.index, c.text, c.logprobs, c.finish_reason) == (0, expected, None, "length")
    n = len(_ids(engine, PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, 16, n + 16)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "astrai"


def test_list_of_prompts_with_n_gives_prompt_major_choices(openai_client: Any, engine: Any) -> None:
    r = openai_client.completions.create(
        model="astrai", prompt=[PROMPT, OTHER], n=2, max_tokens=4, temperature=0
    )
    a, b = _greedy(engine, PROMPT, 4), _greedy(engine, OTHER, 4)
    assert a != b
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [
        (0, a, "length"),
        (1, a, "length"),
        (2, b, "length"),
        (3, b, "length"),
    ]
    n_prompt = len(_ids(engine, PROMPT)) + len(_ids(engine, OTHER))  # each prompt counted once whatever n is
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 16)


def test_token_id_prompts_are_used_as_given(openai_client: Any, engine: Any) -> None:
    kw = {"model": "astrai", "max_tokens": 6, "temperature": 0}
    by_text = openai_client.completions.create(prompt=PROMPT, **kw)
    ids = _ids(engine, PROMPT)
    by_ids = openai_client.completions.create(prompt=ids, **kw)
    by_lists = openai_client.completions.create(prompt=[ids, _ids(engine, OTHER)], **kw)
    expected = _greedy(engine, PROMPT, 6)
    assert by_ids.choices[0].text == by_text.choices[0].text == by_lists.choices[0].text == expected
    assert by_lists.choices[1].text == _greedy(engine, OTHER, 6)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    echoed = openai_client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert echoed == PROMPT + by_text.choices[0].text  # a token-id prompt is echoed decoded


def test_streaming_equals_non_streaming(openai_client: Any) -> None:
    kw = {"model": "astrai", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    whole = openai_client.completions.create(**kw)
    chunks = list(openai_client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}

    def counts(u):  # the second hits the cache, the counts do not differ
        return (u.prompt_tokens, u.completion_tokens, u.total_tokens)

    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def _check_logprobs(lp: Any, text: str, k: int, generated: int) -> None:
    """Echo log-probs: the prompt's tokens (the first without log-probs), then ``generated`` greedy ones."""
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert (lp.token_logprobs[0], lp.top_logprobs[0]) == (None, None)
    entries = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    for i, (token, logprob, top) in enumerate(entries[1:], start=1):
        assert logprob <= 0 and list(top)[0] == token and top[token] == logprob  # the token itself first
        assert len(top) in (k, k + 1)  # the k most likely, and the token when it is not among them
        if i >= len(lp.tokens) - generated:  # greedy: the chosen token is the most likely one
            assert logprob == max(top.values()) and len(top) == k


def test_echo_with_logprobs(openai_client: Any, engine: Any) -> None:
    r = openai_client.completions.create(
        model="astrai", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=3
    )
    (c,) = r.choices
    assert c.text == PROMPT + _greedy(engine, PROMPT, 4) and c.finish_reason == "length"
    n = len(_ids(engine, PROMPT))
    assert len(c.logprobs.tokens) == n + 4
    assert c.logprobs.tokens[:n] == [engine.tokenizer.token_text(t) for t in _ids(engine, PROMPT)]
    _check_logprobs(c.logprobs, c.text, 3, generated=4)
    streamed = list(
        openai_client.completions.create(
            model="astrai", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=3, stream=True
        )
    )
    pieces = [ch.choices[0] for ch in streamed if ch.choices]
    assert pieces[0].text.startswith(PROMPT)  # the echo leads the first chunk
    assert "".join(p.text for p in pieces) == c.text
    assert [t for p in pieces for t in p.logprobs.tokens] == c.logprobs.tokens
    assert [o for p in pieces for o in p.logprobs.text_offset] == c.logprobs.text_offset
    assert [x for p in pieces for x in p.logprobs.token_logprobs] == c.logprobs.token_logprobs


def test_max_tokens_zero_with_echo_scores_the_prompt(openai_client: Any, engine: Any) -> None:
    kw = {"model": "astrai", "prompt": PROMPT, "echo": True, "logprobs": 1}
    r = openai_client.completions.create(max_tokens=0, **kw)
    (c,) = r.choices
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == (PROMPT, "length", 0)
    n = len(_ids(engine, PROMPT))
    _check_logprobs(c.logprobs, PROMPT, 1, generated=0)
    generating = openai_client.completions.create(max_tokens=1, temperature=0, **kw).choices[0].logprobs
    assert c.logprobs.token_logprobs[1:] == pytest.approx(generating.token_logprobs[1:n], abs=1e-4)
    stream = openai_client.completions.create(max_tokens=0, stream=True, **kw)
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    ends = [(PROMPT, None), ("", "length")]  # the echo comes at the end: nothing was generated
    assert [(ch.text, ch.finish_reason) for ch in chunks] == ends
    assert chunks[0].logprobs.tokens == c.logprobs.tokens and chunks[1].logprobs.tokens == []


def _cached(body: str, n_prompt: int) -> int:
    """The prompt tokens the prefix cache served (the shared server may have seen the prompt): whole pages
    of it, at least one token left to compute."""
    cached = int(re.search(r'"cached_tokens":(\d+)', body).group(1))
    assert cached % 16 == 0 and 0 <= cached < n_prompt
    return cached


def _normalise(body: str) -> str:
    body = re.sub(r'"id":"cmpl-[0-9a-f]{24}"', '"id":"cmpl-ID"', body)
    return re.sub(r'"created":\d+', '"created":0', body)


def test_sse_transcript_is_exact(base_url: str, engine: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    pieces = list(engine.generate(PROMPT, stream=True, max_tokens=4, temperature=0))
    n = len(_ids(engine, PROMPT))
    head = 'data: {"id":"cmpl-ID","object":"text_completion","created":0,"model":"astrai","choices":'
    expected = (
        "".join(
            f'{head}[{{"index":0,"text":{json.dumps(p, ensure_ascii=False)},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
            for p in pieces
        )
        + f'{head}[{{"index":0,"text":"","logprobs":null,"finish_reason":"length"}}]}}\n\n'
        + f'{head}[],"usage":{{"prompt_tokens":{n},"completion_tokens":4,"total_tokens":{n + 4},'
        + f'"prompt_tokens_details":{{"cached_tokens":{_cached(r.text, n)}}}}}}}\n\n'
        + "data: [DONE]\n\n"
    )
    assert _normalise(r.text) == expected
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and len(events) == len(pieces) + 3
    for event in map(json.loads, events[:-1]):
        usage = [] if event["choices"] else ["usage"]
        assert list(event) == ["id", "object", "created", "model", "choices", *usage]
        assert all(list(c) == ["index", "text", "logprobs", "finish_reason"] for c in event["choices"])


def test_errors_name_the_parameter(openai_client: Any, engine: Any) -> None:
    vocab = engine.tokenizer.vocab_size
    cases = [
        ({"prompt": [1, vocab]}, "prompt"),
        ({"prompt": [[1], [-1]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": PROMPT, "suffix": "."}, "suffix"),
        ({"prompt": PROMPT, "n": 1, "best_of": 2}, "best_of"),
        ({"prompt": PROMPT, "extra_body": {"foo": 1}}, "foo"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            openai_client.completions.create(model="astrai", max_tokens=1, **kw)
        assert info.value.status_code == 400 and info.value.body["param"] == param, kw
        assert info.value.body["type"] == "invalid_request_error"
    ok = openai_client.completions.create(
        model="astrai", prompt=PROMPT, max_tokens=1, n=2, best_of=2, suffix=None
    )
    assert len(ok.choices) == 2


def test_every_sdk_parameter_is_declared() -> None:
    """Each parameter the SDK's ``completions.create`` can send is implemented, ignored or refused on
    purpose (a field the model does not declare would be an ``unsupported parameter`` 400)."""
    from openai.types.completion_create_params import CompletionCreateParamsBase

    from astrai_server.protocols.completions import CompletionRequest

    assert {*CompletionCreateParamsBase.__annotations__, "stream"} <= set(CompletionRequest.model_fields)


def test_litellm_text_completion_matches_the_sdk(openai_client: Any, base_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm

    kw = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = litellm.text_completion(model="openai/astrai", api_base=base_url + "/v1", api_key="x", **kw)
    assert r.choices[0].text == openai_client.completions.create(model="astrai", **kw).choices[0].text
