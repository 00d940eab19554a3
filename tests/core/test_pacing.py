"""``StepPacer`` (``--prefill-step-ratio``): a step's prefill budget beside decoding requests, from
measured step times (``BatchPolicy`` planning under it: ``test_batching``)."""

from __future__ import annotations

import pytest

from astrai.config import EngineConfig
from astrai.pacing import StepPacer


def test_the_budget_is_the_tokens_that_fit_in_the_steps_allowed_beyond_a_decode_step():
    pacer = StepPacer(2048, ratio=3.0)
    assert pacer.budget(decoding=True) == 2048  # nothing measured yet
    pacer.observe(decode_rows=32, prefill_tokens=0, seconds=0.100)  # a decode step: 100 ms
    assert pacer.budget(decoding=True) == 2048  # no prefill cost measured yet
    pacer.observe(decode_rows=32, prefill_tokens=1000, seconds=1.100)  # 1 ms a prompt token beyond it
    assert pacer.decode_s == pytest.approx(0.1) and pacer.token_s == pytest.approx(0.001)
    assert pacer.budget(decoding=True) == 200  # (3 - 1) x 100 ms at 1 ms a token
    assert pacer.budget(decoding=False) == 2048  # nobody waits on a step without decode rows


def test_the_costs_are_moving_averages_and_the_budget_stays_within_its_bounds():
    pacer = StepPacer(512, ratio=2.0, min_tokens=64)
    pacer.observe(4, 0, 0.010)
    pacer.observe(4, 0, 0.020)  # 0.010 + 0.3 x (0.020 - 0.010)
    assert pacer.decode_s == pytest.approx(0.013)
    pacer.observe(0, 100, 0.5)  # a prefill-only step: 5 ms a token
    assert pacer.budget(decoding=True) == 64  # 13 ms fits 2.6 tokens: at least min_tokens
    pacer.observe(4, 100, 0.013 + 0.001 * 100)  # beside decode rows: 1 ms a token beyond the 13
    assert pacer.token_s == pytest.approx(0.005 + 0.3 * (0.001 - 0.005))
    fast = StepPacer(512, ratio=2.0)
    fast.observe(4, 0, 0.010)
    fast.observe(4, 10, 0.0101)
    assert fast.budget(decoding=True) == 512  # at most max_prefill_tokens
    off = StepPacer(512, ratio=None)
    off.observe(4, 0, 0.010)
    off.observe(4, 100, 1.0)
    assert off.budget(decoding=True) == 512 and off.decode_s is None


def test_a_ratio_of_one_or_less_is_refused():
    with pytest.raises(ValueError, match="prefill_step_ratio must be > 1, got 1.0"):
        EngineConfig(prefill_step_ratio=1.0)
    with pytest.raises(ValueError, match="prefill_step_ratio must be > 1, got 0.5"):
        StepPacer(64, ratio=0.5)
