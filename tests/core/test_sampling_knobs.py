"""min_p, repetition_penalty, min_tokens and stop_token_ids: against Hugging Face's processors, and in the
engine."""

from __future__ import annotations

import pytest
import torch

from astrai.errors import RequestRejected
from astrai.request import FinishReason
from astrai.sampling import SamplingBatch, SamplingParams, SamplingPipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEG_INF = float("-inf")


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_min_p_keeps_what_hugging_face_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    logits = _logits(4)
    params = [
        SamplingParams(min_p=0.05),
        SamplingParams(min_p=0.3, temperature=0.7),
        SamplingParams(),
        SamplingParams(min_p=1.0),
    ]
    got = SamplingPipeline.default().apply(logits.clone(), SamplingBatch.from_params(params, [0] * 4))
    for row, p in enumerate(params):
        want = TemperatureLogitsWarper(p.temperature)(None, logits[row : row + 1].clone())
        if p.min_p:
            want = MinPLogitsWarper(p.min_p)(None, want)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want[0])), row
    assert not torch.isinf(got[2]).any()  # min_p 0: the row is whole
    assert torch.isfinite(got[3]).sum() == 1  # min_p 1: the argmax alone


def test_min_p_leaves_greedy_rows_alone():
    logits = _logits(2)
    params = [SamplingParams(temperature=0.0, min_p=0.9), SamplingParams(min_p=0.9)]
    got = SamplingPipeline.default().apply(logits.clone(), SamplingBatch.from_params(params, [0, 0]))
    assert torch.equal(got[0], logits[0])


def test_repetition_penalty_matches_hugging_face_over_prompt_and_output():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _logits(3, seed=1)
    prompts, outputs = [[1, 2, 3, 3], [5], [7, 8]], [[9, 1], [5, 5, 6], []]
    params = [
        SamplingParams(repetition_penalty=1.3, temperature=0.0),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(temperature=0.0),
    ]
    batch = SamplingBatch.from_params(params, [0] * 3, output_ids=outputs, prompt_ids=prompts)
    got = SamplingPipeline.default().apply(logits.clone(), batch)
    for row, p in enumerate(params):
        seen = torch.tensor([prompts[row] + outputs[row]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(got[row], want, rtol=0, atol=0)


def test_repetition_penalty_changes_the_greedy_token():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    plain = SamplingPipeline.default().sample(
        logits, SamplingBatch.from_params([SamplingParams(temperature=0)], [0])
    )
    params = [SamplingParams(temperature=0, repetition_penalty=1.2)]
    assert not params[0].plain_greedy
    batch = SamplingBatch.from_params(params, [0], output_ids=[[]], prompt_ids=[[0]])
    assert plain.item() == 0 and SamplingPipeline.default().sample(logits, batch).item() == 1


def test_banned_tokens_are_never_drawn():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 50.0  # greedy and sampled rows would both take token 3
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(seed=1, min_tokens=2)]
    batch = SamplingBatch.from_params(params, [0, 0], banned=[[3], [3, 4]])
    assert batch.changes_logits
    for _ in range(20):
        ids = SamplingPipeline.default().sample(logits, batch)
        assert 3 not in ids.tolist() and ids[1].item() != 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"repetition_penalty": 0.0},
        {"min_tokens": -1},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": 3},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_knobs_reject_bad_values_naming_the_field(kwargs):
    with pytest.raises(RequestRejected) as err:
        SamplingParams(**kwargs)
    assert err.value.param == next(iter(kwargs))


def _greedy(engine, tokenizer, **params):
    result = engine.submit(
        tokenizer.encode("the cat", add_special_tokens=True), SamplingParams(temperature=0.0, **params)
    )
    result.wait_completion()
    result.raise_for_error()
    return result


def test_stop_token_ids_end_the_request_without_their_text(tiny_engine, tiny_tokenizer):
    engine = tiny_engine()
    free = _greedy(engine, tiny_tokenizer, max_tokens=6, ignore_eos=True)
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    got = _greedy(engine, tiny_tokenizer, max_tokens=6, ignore_eos=True, stop_token_ids=[stop])
    assert got.finish_reason is FinishReason.STOP
    assert got.output_ids == free.output_ids[: first + 1]
    assert got.text == tiny_tokenizer.decode(free.output_ids[:first])


def test_min_tokens_masks_eos_and_stop_ids_until_reached(tiny_engine, tiny_tokenizer):
    engine = tiny_engine()
    free = _greedy(engine, tiny_tokenizer, max_tokens=4, ignore_eos=True)
    stop = free.output_ids[0]
    got = _greedy(engine, tiny_tokenizer, max_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_tokens=3)
    assert stop not in got.output_ids[:3]
    assert len(got.output_ids) >= 3
    # without min_tokens the same request ends at its first token
    assert _greedy(engine, tiny_tokenizer, max_tokens=8, stop_token_ids=[stop]).output_ids == [stop]


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_submit(tiny_engine, tiny_tokenizer):
    engine = tiny_engine()
    with pytest.raises(RequestRejected, match="stop_token_ids"):
        engine.submit([0, 5], SamplingParams(stop_token_ids=[10_000]))
