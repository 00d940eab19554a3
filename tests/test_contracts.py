"""The contracts of core import without torch: a request's parameters, a grammar spec, a step's data,
a backend choice, the engine's configuration (a protocol plugin or a client of them loads no torch)."""

from __future__ import annotations

import subprocess
import sys

CONTRACTS = {
    "astrai.sampling.params": "SamplingParams",
    "astrai.grammar.base": "GrammarSpec",
    "astrai.step": "StepPlan",
    "astrai.extension.backend.selection": "BackendChoice",
    "astrai.config": "EngineConfig",
    "astrai.logprobs": "TokenLogprob",
}


def test_contracts_import_without_torch() -> None:
    code = "\n".join(
        [
            "import sys",
            *(f"from {module} import {name}" for module, name in CONTRACTS.items()),
            "from astrai.step import StepResult, RowInput",
            "StepPlan(); StepResult(); SamplingParams(max_tokens=3); EngineConfig()",
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
