"""``astrai serve gemma3-270m`` against HF transformers on the same GGUF, past Gemma 3's 512-token window.

A real ``astrai serve`` subprocess (float32) answers ``/v1/completions`` through the ``openai`` SDK;
transformers loads the same Q4_K_M file, dequantized to float32, so both sides hold the same
weights and differ only in the order of floating-point sums. Each prompt is 530-600 tokens (sent
as token ids, so both sides see the same ids), longer than the sliding window of the model's local
layers (five of every six), so the prompt's tail and every generated token attend through it.

Per prompt, transformers runs its own forward once over the prompt (keeping the logits of the
positions past the window) and then decodes greedily with its cache, and the server is asked twice:

- a greedy completion of ``NEW_TOKENS`` tokens with their log-probs: each token's text and log-prob
  are transformers' (``LP_ATOL``), up to transformers' first near tie (``NEAR_TIE``);
- the prompt followed by transformers' greedy tokens, scored (``echo``, ``max_tokens`` 0,
  ``logprobs`` 1): at each generated position the server's own most likely token is the one
  transformers chose (its ``top_logprobs`` holds that token alone: a token id check, not a text
  one), and the log-prob of every token past the window is transformers'.

That the window matters here is checked too: transformers with its window taken away scores the
same tokens differently by far more than ``LP_ATOL``.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow  # a second real model, served and loaded by transformers

MODEL = "gemma3-270m"
WINDOW = 512
NEW_TOKENS = 16
NEAR_TIE = 1e-3  # logits: below this margin transformers' own greedy choice is a near tie
LP_ATOL = 5e-4  # nats, as tests/integration/test_logprobs_oracle.py; measured here: at most 3.4e-5


def _counting() -> str:
    return ", ".join(str(i) for i in range(1, 132)) + ","


def _recall() -> str:
    """A code stated once, then more than a window of filler: only the global layers still see it."""
    filler = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(1, 37))
    return "The secret code is 7391.\n" + filler + "Remember: the secret code is"


# two prompts: the suite's time is bounded, and each costs a 600-token prefill on both sides
PROMPTS = {"counting": _counting, "recall": _recall}


def _installed() -> None:
    from astrai.errors import ModelNotFound
    from astrai.model.resolve import install_command, resolve_model

    try:
        resolve_model(MODEL)
    except ModelNotFound:
        reason = f"{MODEL} is not installed ({install_command(MODEL)})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI installs it: see the README's test command")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def served(start_server) -> Any:
    """The server (started first: its load overlaps transformers')."""
    _installed()
    return start_server(MODEL, healthy=False)


@pytest.fixture(scope="session")
def hf_gemma() -> Any:
    """transformers' import of the same GGUF, float32, eval mode, loaded once."""
    transformers = pytest.importorskip("transformers")
    from astrai.model.resolve import resolve_model

    _installed()
    from hf_gguf import reading_once

    path = resolve_model(MODEL)[1]
    with reading_once():  # the 262k-token vocabulary's metadata parsed once, not twice
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
    assert model.config.sliding_window == WINDOW
    return model.eval()


@pytest.fixture(scope="module")
def client(served, hf_gemma) -> Any:
    import openai
    from serving import wait_healthy

    wait_healthy(served, timeout=600)
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", timeout=600, max_retries=0) as c:
        yield c


def _reference(hf: Any, ids: list[int], n: int, window: bool = True) -> tuple[list[int], list[float], Any]:
    """transformers' greedy ``n`` tokens after ``ids``, each one's top-1 margin (logits), and the
    log-probs ``[len(ids) - WINDOW + n, vocab]`` that score tokens ``WINDOW`` onwards (the prompt's
    past the window, then the ``n`` greedy ones). ``window=False``: its local layers see everything."""
    keep = len(ids) - WINDOW + 1
    saved = hf.config.sliding_window
    hf.config.sliding_window = saved if window else 10**6  # the masks are built from it at each call
    try:
        with torch.no_grad():
            out = hf(torch.tensor([ids]), use_cache=True, logits_to_keep=keep)
            rows, tokens, margins = [out.logits[0, :-1]], [], []
            logits, cache = out.logits[0, -1], out.cache
            for step in range(n):
                top = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                margins.append(float(top[0] - top[1]))
                rows.append(logits[None])
                if step + 1 < n:
                    out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                    logits, cache = out.logits[0, -1], out.cache
    finally:
        hf.config.sliding_window = saved
    return tokens, margins, torch.cat(rows).float().log_softmax(-1)


def _clear(margins: list[float]) -> int:
    """How many of transformers' greedy tokens lead by more than ``NEAR_TIE``, in a row."""
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_and_logprobs_past_the_window_are_transformers(client, served, hf_gemma, name) -> None:
    text = PROMPTS[name]()
    ids = httpx.post(served.url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    assert WINDOW + 16 < len(ids) < 600, len(ids)
    want, margins, ref = _reference(hf_gemma, ids, NEW_TOKENS)
    clear = _clear(margins)
    assert clear >= NEW_TOKENS // 2, f"transformers' greedy path is a near tie after {clear} tokens"

    scored = client.completions.create(
        model="astrai", prompt=ids + want, max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    tail = ids[WINDOW:] + want  # the tokens whose position is past the window
    scored_lp = scored.logprobs.token_logprobs[WINDOW:]
    assert len(scored_lp) == len(tail) == ref.shape[0]
    theirs = ref[torch.arange(len(tail)), torch.tensor(tail)]
    assert (torch.tensor(scored_lp) - theirs).abs().max() < LP_ATOL
    for k in range(clear):  # the server's own top token at each generated position is transformers'
        at = len(ids) + k
        top = scored.logprobs.top_logprobs[at]
        assert list(top.values()) == [scored.logprobs.token_logprobs[at]], (k, top)

    greedy = client.completions.create(
        model="astrai",
        prompt=ids,
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    ).choices[0]
    got = greedy.logprobs
    assert got.tokens[:clear] == scored.logprobs.tokens[len(ids) : len(ids) + clear]
    generated = torch.tensor(got.token_logprobs[:clear])
    assert (generated - theirs[len(tail) - NEW_TOKENS :][:clear]).abs().max() < LP_ATOL
    if clear == NEW_TOKENS:
        assert greedy.text == "".join(scored.logprobs.tokens[len(ids) :])


def test_the_window_matters_to_these_prompts(hf_gemma, served) -> None:
    """Without its window transformers scores the same tokens past it differently, by far more than the
    tolerance: a server that ignored the window (or misplaced it) would fail the test above."""
    ids = httpx.post(served.url + "/tokenize", json={"prompt": _recall()}, timeout=60).json()["tokens"]
    want, _, windowed = _reference(hf_gemma, ids, 4)
    _, _, unwindowed = _reference(hf_gemma, ids + want[:-1], 1, window=False)
    tail = torch.tensor(ids[WINDOW:] + want)
    rows = torch.arange(len(tail))
    assert (windowed[rows, tail] - unwindowed[rows, tail]).abs().max() > 100 * LP_ATOL
