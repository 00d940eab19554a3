"""LoRA adapters on 8-bit activations (``--activations int8``), against peft on the same arithmetic.

With int8 activations the base model's quantized linears no longer compute what transformers'
float32 import of the GGUF computes, so plain peft is no exact oracle, and an adapter whose
updates are large (the suite's ``a1``: B scaled by 6) moves the scores further from it than the base
moves. To tell that amplification from a fault, peft also runs on a transformers model whose base
linears compute the int8 kernel's arithmetic (``Int8Linear``: each row's groups quantized with scale
``amax / 127``, exact integer products with the weight's codes, the weight's and the row's scales,
mins times the unquantized group sums) on the codes and scales astrai packed from the same file,
the adapters' own updates float32 on the unquantized rows, as astrai's ``lora`` kernel adds them.
That arithmetic is checked equal to the kernel's, linear by linear; the engine's scores must then
stray from float32 peft's no further than peft's on it do.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lora_adapters import PROMPT, SPECS, N, Oracle, _llama_permute

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(scope="module", autouse=True)
def int8_build(cpu_kernels):
    if not torch.ops.astrai_cpu.has_quant_linear_int8():
        pytest.skip("8-bit activations are built for AVX2, or AVX512-BF16 with AVX512-VNNI")


def int8_product(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins, group: int
) -> torch.Tensor:
    """``x @ W.T`` as ``quant_linear`` computes it on int8 rows (csrc/quant_q8_avx2.cpp). ``codes``
    ``[n, k]`` as float32 (the integer sums of a group are below 2**24, so exact in any order)."""
    m, k = x.shape
    xg = x.reshape(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    # float32, as the kernel rounds (``127.0 / amax`` would be ``amax.reciprocal() * 127``: another rounding)
    q = torch.round(xg * torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(())))
    dots = torch.bmm(q.transpose(0, 1), codes.view(-1, k // group, group).permute(1, 2, 0))  # [g, m, n]
    row_scale = amax.squeeze(-1).double() / 127  # [m, g]
    out = torch.einsum("gmn,ng,mg->mn", dots.double(), scales.double(), row_scale)
    if mins is not None:
        out = out + xg.sum(-1).double() @ mins.double().t()
    return out.float()


class Int8Linear:
    """A base linear's ``forward``: ``int8_product`` on rows ``rows`` of an astrai QuantizedLinear."""

    def __init__(self, linear, rows: slice, order: torch.Tensor | None = None) -> None:
        from astrai.model.quant import unpack

        ((packed, layout),) = linear.segments
        codes, scales, mins = (t[rows] if t is not None else None for t in unpack(packed, layout))
        if order is not None:  # astrai keeps q and k rows in llama.cpp's order: back to HF's
            codes, scales = codes[order], scales[order]
            mins = mins[order] if mins is not None else None
        self.codes, self.scales, self.mins, self.group = codes.float(), scales, mins, layout.spec.group

    def weight(self) -> torch.Tensor:
        w = self.codes * self.scales.repeat_interleave(self.group, 1)
        return w if self.mins is None else w + self.mins.repeat_interleave(self.group, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x.reshape(-1, x.shape[-1]), self.codes, self.scales, self.mins, self.group).view(
            *x.shape[:-1], -1
        )


@pytest.fixture(scope="module")
def ours(default_model_path):
    """astrai's model of the default GGUF, its linears switched to int8 rows."""
    from astrai.model import load_model
    from astrai.model.activations import use_int8_activations

    model, _ = load_model(str(default_model_path), dtype=torch.float32, weights="gguf", max_seq_len=256)
    use_int8_activations(model)
    return model


def _int8_oracle(lora_oracle, ours) -> Oracle:
    """peft's model (a copy) with every base linear and the LM head on ``Int8Linear``; each one's
    weight checked equal to transformers' (the rows mapped right)."""
    model = copy.deepcopy(lora_oracle.model)
    hf = model.base_model.model
    cfg = hf.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    inter = cfg.intermediate_size

    def order(n: int, heads: int) -> torch.Tensor:
        return torch.argsort(_llama_permute(torch.arange(n), heads))

    patched = [(hf.lm_head, Int8Linear(ours.lm_head, slice(None)))]
    for theirs, mine in zip(hf.model.layers, ours.model.layers, strict=True):
        att, mlp = mine.self_attn, mine.mlp
        for name, linear, rows, perm in (
            ("self_attn.q_proj", att.qkv_proj, slice(0, q), order(q, cfg.num_attention_heads)),
            ("self_attn.k_proj", att.qkv_proj, slice(q, q + kv), order(kv, cfg.num_key_value_heads)),
            ("self_attn.v_proj", att.qkv_proj, slice(q + kv, q + 2 * kv), None),
            ("self_attn.o_proj", att.o_proj, slice(None), None),
            ("mlp.gate_proj", mlp.gate_up_proj, slice(0, inter), None),
            ("mlp.up_proj", mlp.gate_up_proj, slice(inter, 2 * inter), None),
            ("mlp.down_proj", mlp.down_proj, slice(None), None),
        ):
            module = theirs.get_submodule(name)
            patched.append((getattr(module, "base_layer", module), Int8Linear(linear, rows, perm)))
    for base, int8 in patched:
        assert base.bias is None
        assert torch.equal(int8.weight(), base.weight), base
        base.forward = int8
    return Oracle(model, lora_oracle.folders)


@pytest.fixture(scope="module")
def int8_oracle(lora_oracle, ours):
    return _int8_oracle(lora_oracle, ours)


def test_int8_linear_is_the_kernels_arithmetic(ours):
    """To the float32 rounding of the last scalings, on random rows and on rows whose values fall
    exactly halfway between two codes (rounded to even, as the kernel's ``nearbyint``)."""
    x = torch.randn(6, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    amax = torch.tensor(2.3040533)  # where 127 / amax and amax.reciprocal() * 127 round apart
    halves = (torch.arange(31) + 0.5) / (torch.tensor(127.0) / amax)
    assert (halves * (torch.tensor(127.0) / amax) == torch.arange(31) + 0.5).sum() > 20  # exact ties
    x[1, :32] = torch.cat([amax[None], halves])
    for linear in (
        ours.model.layers[0].self_attn.qkv_proj,
        ours.model.layers[0].mlp.gate_up_proj,
        ours.lm_head,
    ):
        with torch.no_grad():
            got = linear(x)
        want = Int8Linear(linear, slice(None))(x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), linear


@pytest.fixture(scope="module")
def engine(default_model_path, lora_oracle):
    from astrai.engine import EngineConfig, InferenceEngine

    config = EngineConfig(
        enable_lora=True, max_loras=4, max_lora_rank=32, max_seq_len=256, activations="int8"
    )
    eng = InferenceEngine.from_model(str(default_model_path), torch.float32, config=config, weights="gguf")
    for name, folder in lora_oracle.folders.items():
        eng.loras.load(name, folder)
    yield eng
    eng.shutdown()


def _peft_scores(oracle: Oracle, name: str | None, ids: list[int]) -> torch.Tensor:
    """Each token's log-probability given the ones before it, on peft's model with adapter ``name``."""
    with torch.no_grad():
        if name is None:
            with oracle.model.disable_adapter():
                logits = oracle.model(torch.tensor([ids])).logits[0, :-1]
        else:
            oracle.model.set_adapter(name)
            logits = oracle.model(torch.tensor([ids])).logits[0, :-1]
    return logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_adapters_on_int8_rows_move_scores_as_the_int8_arithmetic_does(engine, int8_oracle, lora_oracle):
    """Each adapter and the base score the prompt and peft's float32 greedy continuation. The engine's
    log-probs stray from float32 peft's by what the int8 arithmetic itself costs (peft on
    ``Int8Linear``s strays as far), and by a small part of what the adapter changes.

    Token for token the two int8 sides cannot agree: a row's codes round from float32 values whose
    last bits depend on the order of sums, a code that flips moves the next linear's inputs by a
    step, and within a few layers the two carry independent roundings (measured: 8 codes of the first
    layer's 12,672 differ, thousands by the fifth). Measured here, mean nats from float32 peft,
    engine / int8 peft: a1 0.80 / 0.73, a2 0.61 / 0.29, a3 0.83 / 0.85, base 0.12 / 0.11; what
    the adapters change: 6.9 to 10.3."""
    from astrai.kvcache import assert_nothing_held, check_pool_invariants
    from astrai.sampling import SamplingParams

    prompt = engine.tokenizer.encode(PROMPT)
    for name in [*SPECS, None]:
        ids = prompt + lora_oracle.greedy(name, prompt, N)[0]
        request = engine.submit(ids, SamplingParams(max_tokens=1, prompt_logprobs=1), lora=name)
        assert request.wait_completion(120)
        request.raise_for_error()
        got = torch.tensor([t.logprob for t in request.prompt_logprobs[1:]])
        exact = _peft_scores(lora_oracle, name, ids)
        ours = (got - exact).abs().mean()
        theirs = (_peft_scores(int8_oracle, name, ids) - exact).abs().mean()
        assert 1e-3 < ours < 2.5 * theirs + 0.05, (name, ours, theirs)
        if name is not None:
            adapter = (exact - _peft_scores(lora_oracle, None, ids)).abs().mean()
            assert ours < 0.15 * adapter, (name, ours, adapter)
    check_pool_invariants(engine.pool)
    assert_nothing_held(engine.pool)
