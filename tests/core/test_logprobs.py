"""Log-probs of generated and prompt tokens: the model's own distribution, whatever the batching."""

from __future__ import annotations

import pytest
import torch

from astrai.logprobs import TokenLogprob, token_logprobs
from astrai.request import FinishReason
from astrai.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4  # float32 on both sides; only the attention's summation order differs (chunks, batch rows)


def full_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` log-softmax of the logits at every position, one forward on a fresh pool."""
    from astrai.kvcache import KVConfig, PagePool

    cfg = model.config
    pool = PagePool(
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        KVConfig(max_batch_size=1, max_seq_len=len(ids)),
        dtype=torch.float32,
    )
    row = pool.task_alloc()
    pool.extend(row, len(ids))
    kv = pool.bind_tasks([row], [len(ids)], [len(ids)])
    with torch.no_grad():
        logits = model(torch.tensor(ids), torch.arange(len(ids)), kv, torch.arange(len(ids)))
    pool.task_free(row)
    return torch.log_softmax(logits.float(), dim=-1)


def assert_entries(entries: list[TokenLogprob], tokens: list[int], reference: torch.Tensor, k: int) -> None:
    """Entry i scores ``tokens[i]`` under ``reference[i]`` and lists that row's ``k`` best, descending."""
    assert [e.token_id for e in entries] == tokens
    for entry, row in zip(entries, reference, strict=True):
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=ATOL)
        assert len(entry.top) == k
        best = row.topk(k)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=ATOL)


def test_token_logprobs_is_one_log_softmax_and_topk_per_row():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.tensor([4, 0, 49])
    got = token_logprobs(logits, ids, [2, 0, 5])
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert [len(e.top) for e in got] == [2, 0, 5]
    for i, entry in enumerate(got):
        assert entry.token_id == ids[i] and entry.logprob == pytest.approx(ref[i, ids[i]].item(), abs=1e-6)
        assert [t for t, _ in entry.top] == ref[i].topk(len(entry.top)).indices.tolist()
    assert token_logprobs(logits, ids, [0, 0, 0])[0].top == ()


def _run(engine, prompt, **params):
    result = engine.submit(prompt, SamplingParams(**params))
    result.wait_completion()
    result.raise_for_error()
    return result


def test_generated_and_prompt_logprobs_equal_one_full_forward(tiny_engine, tiny_model, tiny_tokenizer):
    engine = tiny_engine()
    prompt = tiny_tokenizer.encode("the rain in spain", add_special_tokens=True)
    got = _run(engine, prompt, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    ref = full_log_softmax(tiny_model, prompt + got.output_ids)
    n = len(prompt)
    assert_entries(got.logprobs, got.output_ids, ref[n - 1 : n - 1 + len(got.output_ids)], 3)
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == n
    assert_entries(got.prompt_logprobs[1:], prompt[1:], ref[: n - 1], 2)
    # greedy: every generated token is its position's most likely one
    assert all(e.top[0][0] == e.token_id for e in got.logprobs)


def test_sampled_rows_get_logprobs_of_the_raw_distribution(tiny_engine, tiny_model, tiny_tokenizer):
    engine = tiny_engine()
    prompt = tiny_tokenizer.encode("once upon", add_special_tokens=True)
    got = _run(
        engine,
        prompt,
        temperature=0.7,
        top_k=5,
        seed=3,
        max_tokens=5,
        ignore_eos=True,
        logprobs=0,
        frequency_penalty=1.0,
    )
    ref = full_log_softmax(tiny_model, prompt + got.output_ids)
    assert_entries(got.logprobs, got.output_ids, ref[len(prompt) - 1 : -1], 0)


def test_prompt_logprobs_survive_chunked_prefill_and_the_prefix_cache(
    tiny_engine, tiny_model, tiny_tokenizer
):
    engine = tiny_engine(max_prefill_tokens=5)
    prompt = tiny_tokenizer.encode(
        "a long prompt that takes several chunks to prefill", add_special_tokens=True
    )
    ref = full_log_softmax(tiny_model, prompt)
    warm = _run(engine, prompt, temperature=0.0, max_tokens=2)  # its pages enter the prefix cache
    assert not warm.prompt_logprobs and not warm.logprobs
    for _ in range(2):
        got = _run(engine, prompt, temperature=0.0, max_tokens=2, prompt_logprobs=1)
        assert_entries(got.prompt_logprobs[1:], prompt[1:], ref[:-1], 1)
    assert engine.get_stats()["prefix_hit_tokens"] == 0  # scoring requests compute every position
    _run(engine, prompt, temperature=0.0, max_tokens=2)
    assert engine.get_stats()["prefix_hit_tokens"] > 0  # while the cache serves the ones that do not score


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_engine, tiny_model, tiny_tokenizer):
    engine = tiny_engine()
    prompt = tiny_tokenizer.encode("score me", add_special_tokens=True)
    got = _run(engine, prompt, max_tokens=0, prompt_logprobs=0, logprobs=0)
    assert got.finish_reason is FinishReason.LENGTH
    assert got.output_ids == [] and got.text == "" and got.logprobs == []
    assert_entries(got.prompt_logprobs[1:], prompt[1:], full_log_softmax(tiny_model, prompt)[:-1], 0)


def test_rows_that_do_not_ask_pay_nothing_and_pieces_point_at_their_tokens(tiny_engine, tiny_tokenizer):
    engine = tiny_engine()
    prompt = tiny_tokenizer.encode("hello there", add_special_tokens=True)
    asks = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1))
    plain = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for r in (asks, plain):
        r.wait_completion()
        r.raise_for_error()
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    assert asks.output_ids == plain.output_ids and asks.text == plain.text
    ends = asks.piece_ends
    assert ends == sorted(ends) and ends[-1] <= len(asks.logprobs) == len(asks.output_ids)
    # each piece's tokens decode to the text delivered up to it
    pieces = list(asks.pieces())
    for k, end in enumerate(ends):
        assert tiny_tokenizer.decode(asks.output_ids[:end]).startswith("".join(pieces[: k + 1]))
