"""The cpu backend inside the engine: the scheduler's greedy tokens, pool left clean, backend chosen."""

from __future__ import annotations

import pytest
import torch
from astrai_core_test_fixtures import reference_greedy  # tests/core/conftest.py, loaded by ./conftest.py

from astrai.extension import attn_backend
from astrai.extension.backend.policy import available_backends
from astrai.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_cpu_is_chosen_automatically_before_torch_native():
    names = [name for name, ok, _ in available_backends() if ok]
    assert names.index("cpu") < names.index("torch_native")


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_engine_greedy_tokens_match_the_reference(tiny_engine, tiny_model, paged):
    engine = tiny_engine(attention_backend="cpu", paged=paged, max_prefill_tokens=16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 1, 33)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = [engine.submit(p, params) for p in prompts]
    assert all(r.wait_completion(60) for r in results)
    for prompt, result in zip(prompts, results, strict=True):
        result.raise_for_error()
        with attn_backend("torch_native"):  # an independent reference: not the kernel under test
            want = reference_greedy(tiny_model, prompt, 10)
        assert result.output_ids == want
