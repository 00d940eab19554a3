"""Counter-based noise and draws: reproducibility, batch independence and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from astrai.sampling import SamplingBatch, SamplingParams, SamplingPipeline
from astrai.sampling.noise import BLOCK, categorical, mix32, uniform_noise

# 0.1% critical values of the chi-square distribution, by degrees of freedom.
CHI2_999 = {4: 18.47, 5: 20.52, 7: 24.32, 9: 27.88, 15: 37.70}


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers: the reference for mix32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_mix32_matches_reference_and_stays_in_32_bits():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF, 123456789]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32(v) for v in values]


def test_uniform_noise_is_open_unit_interval_and_uniform():
    seeds = torch.tensor([0, 1, -5, 2**62])
    steps = torch.tensor([0, 0, 3, 1_000_000])
    u = uniform_noise(seeds, steps, torch.arange(20_000))
    assert u.shape == (4, 20_000) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    for row in u:
        counts = torch.histc(row, bins=16, min=0.0, max=1.0)
        assert chi2(counts, torch.full((16,), 1 / 16)) < CHI2_999[15]
    # Rows (different seeds or steps) are unrelated.
    assert abs(float(torch.corrcoef(u)[0, 1:].abs().max())) < 0.05


def test_noise_is_a_pure_function_of_seed_step_token():
    tokens = torch.tensor([[5, 9, 1000]])
    one = uniform_noise(torch.tensor([42]), torch.tensor([3]), tokens)
    many = uniform_noise(torch.tensor([7, 42, 42]), torch.tensor([3, 3, 4]), torch.arange(1001))
    assert torch.equal(one[0], many[1, [5, 9, 1000]])
    assert not torch.equal(many[0], many[1]) and not torch.equal(many[1], many[2])
    streams = uniform_noise(torch.tensor([42]), torch.tensor([3]), tokens, stream=1)
    assert not torch.equal(one, streams)


@pytest.mark.parametrize("vocab", [10, 3 * BLOCK + 17], ids=["one-block", "padded-blocks"])
def test_categorical_frequencies_match_probabilities(vocab):
    torch.manual_seed(4)
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([0, 3, BLOCK - 1, BLOCK, vocab - 1]) if vocab > BLOCK else torch.arange(vocab)
    logits[hot] = torch.randn(len(hot))
    probs = torch.softmax(logits, dim=-1)
    draws = 4000
    # One row per draw: same seed, a different step each (as a request generating 4000 tokens).
    got = categorical(probs.expand(draws, vocab), torch.full((draws,), 99), torch.arange(draws))
    counts = torch.bincount(got, minlength=vocab).float()
    assert int(counts.sum() - counts[hot].sum()) == 0  # mass elsewhere is ~1e-13
    assert chi2(counts[hot], probs[hot] / probs[hot].sum()) < CHI2_999[len(hot) - 1]


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.zeros(3000, 600)
    probs[:, [2, 300, 599]] = torch.tensor([0.2, 0.5, 0.3])
    got = categorical(probs, torch.arange(3000), torch.zeros(3000, dtype=torch.int64))
    assert set(got.tolist()) == {2, 300, 599}


def _draw(pipeline, logits, params, steps):
    return pipeline.sample(logits, SamplingBatch.from_params(params, steps, "cpu")).tolist()


def test_seeded_row_is_reproducible_whatever_else_is_in_the_batch():
    torch.manual_seed(5)
    pipe = SamplingPipeline.default()
    vocab, n_steps = 700, 12
    seeded = SamplingParams(seed=2024, temperature=0.9, top_p=0.95)
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, seed=1),
        SamplingParams(temperature=1.7, top_p=0.5, frequency_penalty=1.0),
    ]
    alone, in_batch, other_seed = [], [], []
    for step in range(n_steps):
        row = torch.randn(vocab) * 2
        alone += _draw(pipe, row[None], [seeded], [step])
        logits = torch.stack(
            [torch.randn(vocab), row, torch.randn(vocab), torch.randn(vocab), torch.randn(vocab)]
        )
        params = [others[0], seeded, others[1], others[2], others[3]]
        in_batch.append(_draw(pipe, logits, params, [0, step, 5, step + 1, 7])[1])
        other_seed += _draw(pipe, row[None], [SamplingParams(seed=2025, temperature=0.9, top_p=0.95)], [step])
    assert alone == in_batch
    assert alone != other_seed


def test_empirical_frequencies_of_pipeline_match_filtered_softmax():
    torch.manual_seed(6)
    logits = torch.randn(1, 40)
    params = SamplingParams(seed=11, temperature=0.7, top_k=8, top_p=0.9)
    pipe = SamplingPipeline.default()
    draws = 4000
    batch = SamplingBatch.from_params([params] * draws, range(draws), "cpu")
    got = pipe.sample(logits.expand(draws, -1), batch)
    probs = pipe.probs(logits, SamplingBatch.from_params([params], [0], "cpu"))[0]
    kept = probs > 0
    counts = torch.bincount(got, minlength=40).float()
    assert bool((counts[~kept] == 0).all())  # filtered tokens are never drawn
    assert int(kept.sum()) == 6  # top-p cut the top-8 further
    assert chi2(counts[kept], probs[kept]) < CHI2_999[5]


def test_unseeded_rows_stay_random_and_follow_torch_manual_seed():
    logits = torch.zeros(1, 1000)
    pipe = SamplingPipeline.default()
    torch.manual_seed(0)
    first = [_draw(pipe, logits, [SamplingParams()], [0])[0] for _ in range(5)]
    torch.manual_seed(0)
    again = [_draw(pipe, logits, [SamplingParams()], [0])[0] for _ in range(5)]
    assert first == again
    assert len(set(first)) > 1
