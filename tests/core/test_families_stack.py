"""The families' decode steps on astrai-backend-cpu's whole-stack kernel (``decoder_layers``) in float32.

Each family's tiny checkpoint, written as a Q4_0 GGUF and served with its weights kept in blocks
(``quant_linear``, on AVX2 or AVX512-BF16), runs through the engine twice: once with the stack
lent, once with the layers run one by one from Python. Every decode step of the first run is the
stack's, and both runs give the same tokens and the same log-probs to the bit: the stack computes
what the layers compute (Qwen3's per-head q/k norms; Gemma 3's sandwich norms, GeGLU, local layers
on their own RoPE table, in the pool's layer groups; Mistral's and Ministral's windows; the
mixtures of experts of Qwen3-MoE and Mixtral, and Qwen2-MoE's shared expert).
"""

from __future__ import annotations

import threading

import pytest
from families import load_astrai, prompts
from stack_spy import counted, cpu_kernels, without_stack

from astrai.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the families whose layers ``astrai.model.stack`` describes (Gemma 2 soft-caps, Phi-3 turns half
#: of each head: their layers run from Python)
STACKED = ["qwen3", "gemma3", "mistral", "ministral", "llama3", "qwen3_moe", "mixtral", "qwen2_moe"]


def _greedy(engine, batch):
    """Greedy tokens and log-probs of ``batch``, all queued while the scheduler waits, so that both
    runs step the same batches (prefill chunks of more rows than ``quant_linear`` takes round
    otherwise)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    held, go = threading.Event(), threading.Event()
    engine.scheduler.call_soon(lambda: (held.set(), go.wait(30)))
    assert held.wait(30)
    results = [engine.submit(p, params) for p in batch]
    go.set()
    out = []
    for r in results:
        assert r.wait_completion(120)
        r.raise_for_error()
        out.append((r.output_ids, [(e.logprob, e.top) for e in r.logprobs]))
    return out


#: the engines of these tests: no prefix cache, so that the second run prefills as the first did
ENGINE = {"max_batch_size": 3, "max_prefill_tokens": 64, "prefix_caching": False}


CASES = [(family, "auto") for family in STACKED] + [
    ("llama3", "int8"),
    ("gemma3", "int8"),
    ("qwen3_moe", "int8"),
]


@pytest.mark.parametrize(("family", "kv"), CASES, ids=[f"{f}-{kv}" for f, kv in CASES])
def test_decode_steps_on_the_stack_are_the_layers_to_the_bit(
    family_gguf, make_engine, tiny_tokenizer, family, kv
):
    """``kv``: the pool's dtype (int8: the stack quantizes the step's K/V and reads them back as the
    layers do)."""
    path, _ = family_gguf(family, "Q4_0")
    model = load_astrai(path, quantized=True)
    kernels = cpu_kernels()
    assert model.decoder_stack() is not None
    # pages of 4 and prompts of 20-40 tokens: Gemma 3's and Ministral's windowed groups drop pages
    _stack_is_the_layers(
        make_engine(model, tiny_tokenizer, page_size=4, kv_cache_dtype=kv, **ENGINE), kernels, seed=4
    )


def _stack_is_the_layers(engine, kernels: dict, seed: int) -> None:
    """Three prompts' greedy tokens and log-probs on ``engine`` (``ENGINE``'s), its decode steps on
    the stack, then with the layers run from Python: the same to the bit."""
    batch = prompts(3, seed=seed)
    ran: list[bool] = []
    with counted(kernels, ran):
        stacked = _greedy(engine, batch)
    assert ran.count(True) >= 15, "the decode steps did not run on the stack"
    with without_stack(kernels):
        layered = _greedy(engine, batch)
    assert stacked == layered


def _bf16_kernels(activations: str) -> dict:
    """The CPU kernels, or a skip where they do not take bf16 rows (int8 ones of bf16: VNNI)."""
    import torch

    kernels = cpu_kernels()
    quant = kernels.get("quant_linear")
    if quant is None or torch.bfloat16 not in quant.dtypes:
        pytest.skip("bf16 rows on the quantized kernels need AVX512-BF16")
    if activations == "int8" and torch.bfloat16 not in quant.int8_dtypes:
        pytest.skip("int8 rows of bf16 need AVX512-VNNI")
    return kernels


@pytest.mark.parametrize("activations", ["dtype", "int8"])
def test_a_bf16_mixture_runs_its_packed_router_on_the_stack(
    family_gguf, make_engine, tiny_tokenizer, activations
):
    """In bf16 the model's linears are packed for the CPU kernels (``prepack_linears``), a mixture's
    router too, which the stack computes on the same packed weight as the layer: the mixture's
    decode steps run on the stack and give the layers' tokens and log-probs to the bit, with bf16
    activations and with int8 ones where the kernel takes them."""
    import torch

    from astrai.model.cpu_linear import PackedLinear, prepack_linears

    kernels = _bf16_kernels(activations)
    path, _ = family_gguf("qwen3_moe", "Q4_0")
    model = load_astrai(path, quantized=True, dtype=torch.bfloat16)
    assert prepack_linears(model) > 0
    assert type(model.model.layers[0].mlp.gate) is PackedLinear
    assert model.decoder_stack() is not None
    _stack_is_the_layers(
        make_engine(model, tiny_tokenizer, activations=activations, **ENGINE), kernels, seed=5
    )


@pytest.mark.parametrize("activations", ["dtype", "int8"])
def test_a_bf16_gemma3_runs_on_the_stack_with_float32_norm_weights(
    family_gguf, make_engine, tiny_tokenizer, activations
):
    """Gemma's ``1 + weight`` norms on bf16 rows compute in float32 and round once: the stack takes
    them as float32 weights (``float_norms``) and its decode steps give the layers' tokens and
    log-probs to the bit (the sandwich norms, the q/k norms, GeGLU and the local layers in bf16)."""
    import torch

    from astrai.model.cpu_linear import prepack_linears

    kernels = _bf16_kernels(activations)
    path, _ = family_gguf("gemma3", "Q4_0")
    model = load_astrai(path, quantized=True, dtype=torch.bfloat16)
    prepack_linears(model)
    spec = model.decoder_stack()
    assert spec is not None and spec.float_norms and spec.dtype == torch.bfloat16
    assert {n.dtype for n in spec.norms} == {torch.float32}
    _stack_is_the_layers(
        make_engine(model, tiny_tokenizer, page_size=4, activations=activations, **ENGINE), kernels, seed=6
    )


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_families_the_stack_does_not_replicate_run_their_layers(family_gguf, family):
    path, _ = family_gguf(family, "Q4_0")
    assert load_astrai(path, quantized=True).decoder_stack() is None
