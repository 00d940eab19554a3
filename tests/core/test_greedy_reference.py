"""The engine's greedy ids for the benchmark prompts, token for token as recorded before the engine re-cut.

``tests/data/greedy_reference.json`` was written by ``scripts/greedy_reference.py --record`` at
the commit it names (the scheduler before it became policy + runner): 33 prompts (the engine
benchmark's offline workload and its single-request prompt), every step's batch fixed by
queueing them all before the first step, float32 and bfloat16, automatic selection (the cpu
backend where it is installed) and torch_native. Any change to admission, chunking,
preemption, the step's layout or the backends' numerics shows up here as a differing id.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("greedy_reference", ROOT / "scripts" / "greedy_reference.py")
greedy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(greedy)
REFERENCE = json.loads(greedy.REFERENCE.read_text())


@pytest.mark.parametrize("case", sorted(REFERENCE["outputs"]))
def test_greedy_ids_equal_the_recorded_ones(case, default_model_path):
    dtype, backend = case.split("/")
    if backend == "auto":  # recorded where automatic selection picks astrai-backend-cpu, as CI installs it
        from astrai.extension import load_backends

        cpu = {name: (ok, why) for name, ok, why in load_backends()}.get("cpu", (False, "not installed"))
        if not cpu[0]:
            reason = f"the automatic case was recorded on the cpu backend, unavailable here: {cpu[1]}"
            pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    outputs = greedy.generate(dtype, backend, REFERENCE["prompts"])
    expected = REFERENCE["outputs"][case]
    differing = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
    assert not differing, f"{case}: prompts {differing} differ from the ids recorded at {REFERENCE['commit']}"
