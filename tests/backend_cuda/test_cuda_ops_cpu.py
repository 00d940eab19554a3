"""The op schemas of bindings.cpp, the ops wrappers and CudaBackend's wiring, on CPU.

The schemas are read from bindings.cpp and registered (for this test only) under
``torch.ops.astrai`` with the reference as their CPU kernels. The wrappers of
``astrai.extension.ops`` must call them with the right arguments, and CudaBackend
(given an H200's device facts, on CPU tensors) must drive a model to the same greedy
tokens as torch_native through prefill, decode and mixed steps.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from astrai.extension import attn_backend, ops
from astrai.extension.backend import policy
from astrai.extension.backend.policy import BackendRegistry
from astrai.extension.backend.torch_native import TorchNativeBackend
from astrai.kvcache import KVConfig, PagePool
from astrai_backend_cuda import _sources, plan, reference
from astrai_backend_cuda.backend import CudaBackend
from astrai_backend_cuda.plan import PREFILL_Q_TILE

KERNEL_OPS = {
    "attn_paged_decode": reference.attn_paged_decode,
    "attn_paged_prefill": reference.attn_paged_prefill,
    "rotary_emb": reference.rotary_emb,
}


def bindings_schemas() -> dict[str, str]:
    """``{op name: schema}`` of every ``m.def`` in bindings.cpp's TORCH_LIBRARY block."""
    text = (_sources.CSRC / _sources.BINDINGS).read_text()
    block = text[text.index("TORCH_LIBRARY(astrai, m)") :]
    block = block[: block.index("\n}\n")]
    schemas = {}
    for call in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', block):
        schema = "".join(re.findall(r'"([^"]*)"', call.group(1)))
        schemas[schema.split("(")[0]] = schema
    return schemas


def _returning_nothing(fn):
    def kernel(*args):
        fn(*args)

    return kernel


@pytest.fixture
def cpu_ops():
    """bindings.cpp's schemas under torch.ops.astrai, with the reference as CPU kernels; removed after."""
    if hasattr(torch.ops.astrai, "attn_paged_decode"):
        pytest.skip("the compiled astrai ops are registered in this process")
    schemas = bindings_schemas()
    lib = torch.library.Library("astrai", "FRAGMENT")
    for schema in schemas.values():
        lib.define(schema)
    for name, fn in KERNEL_OPS.items():
        lib.impl(name, _returning_nothing(fn), "CPU")
    yield schemas
    lib._destroy()
    for name in schemas:
        torch.ops.astrai.__dict__.pop(name, None)  # the namespace caches the op packets


def test_wrappers_and_reference_follow_the_compiled_schemas(cpu_ops):
    assert set(cpu_ops) == {*KERNEL_OPS, "paged_decode_blocks_per_sm"}
    for name, ref in KERNEL_OPS.items():
        schema = torch._C.parse_schema(cpu_ops[name])
        names = [a.name for a in schema.arguments]
        assert list(inspect.signature(getattr(ops, name)).parameters) == names, name
        assert list(inspect.signature(ref).parameters) == names, name
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert (
            mutated
            == {
                "attn_paged_decode": {
                    "k_buffer",
                    "v_buffer",
                    "o_part",
                    "ml_part",
                    "out",
                    "k_scale",
                    "v_scale",
                },
                "attn_paged_prefill": {"out"},
                "rotary_emb": {"out"},
            }[name]
        )
        assert not schema.returns, "ops return nothing: the wrappers return the written tensor"


def test_constants_shared_with_the_kernels_agree():
    header = (_sources.CSRC / "kernels.h").read_text()

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", header).group(1))

    assert constant("kPrefillTileQ") == PREFILL_Q_TILE
    assert constant("kDecodeTile") == plan.DECODE_TILE
    assert constant("kMaxDecodeGroup") == plan.MAX_GROUP
    supported = re.search(r"head_dim_supported\(int head_dim\) \{ return (.*?); \}", header).group(1)
    assert sorted(int(d) for d in re.findall(r"head_dim == (\d+)", supported)) == list(plan.HEAD_DIMS)


class CpuCudaBackend(CudaBackend):
    """CudaBackend on CPU tensors with an H200's size; the ops run the reference."""

    device_type = "cpu"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    def _device_slots(
        self, q: torch.Tensor, group: int, k8: bool = False, v8: bool = False
    ) -> tuple[int, int]:
        return 132, 3


def tiny_llama(architecture="llama", **options):
    """A seeded random 2-layer Llama in bf16 with head_dim 64 and GQA (4 q / 2 kv heads); ``options``:
    more ``ModelConfig`` fields."""
    from astrai.model import ModelConfig, build_model

    config = ModelConfig(
        architecture=architecture,
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_ids=[1],
        name="tiny-d64",
        **options,
    )
    gen = torch.Generator().manual_seed(99)
    model = build_model(config, torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif architecture.startswith("gemma"):  # Gemma's norms are (1 + weight)
                p.zero_()
        model.lm_head.weight.mul_(8.0)  # wide logit gaps: greedy does not hinge on rounding
    return model.to(torch.bfloat16)


def greedy_run(model, prompts, late_prompt, steps=6, forced=None, kinds=("auto", "auto")):
    """Prefill ``prompts`` together, decode ``steps`` steps; at step 2 ``late_prompt`` joins (a mixed step).

    Each step feeds each request its greedy token, or ``forced[i][n]`` when given (so that a
    near-tie decided differently does not send two runs apart). ``kinds``: what the pool keeps
    K and V in (``astrai.kvcache.quant``). Returns ``(tokens of every request, logits of every step)``.
    """
    c = model.config
    pool = PagePool(
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        KVConfig(max_batch_size=4, max_seq_len=128, page_size=16, n_tokens=1024, kinds=kinds),
        dtype=torch.bfloat16,
    )
    seqs, tokens, logits_seen = [], [], []

    def step(new_tokens):  # new_tokens[i]: the tokens request i brings in this step
        q_lens = [len(t) for t in new_tokens]
        for i, n in enumerate(q_lens):
            seqs[i] += n
            pool.extend(rows[i], seqs[i])
        kv = pool.bind_tasks(rows, q_lens, seqs)
        ids = torch.tensor([t for toks in new_tokens for t in toks])
        positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seqs, q_lens, strict=True)])
        last = torch.tensor(q_lens).cumsum(0) - 1
        logits = model(ids, positions, kv, last)
        logits_seen.append(logits)
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            tokens[i].append(tok)

    rows = [pool.task_alloc() for _ in prompts]
    seqs += [0] * len(prompts)
    tokens += [[] for _ in prompts]
    step([list(p) for p in prompts])
    for n in range(steps):
        news = [[forced[i][len(t) - 1] if forced else t[-1]] for i, t in enumerate(tokens)]
        if n == 2:
            rows.append(pool.task_alloc())
            seqs.append(0)
            tokens.append([])
            news.append(list(late_prompt))
        step(news)
    return tokens, logits_seen


WINDOWED = {
    "llama": {},
    # every layer in a window of 16 positions: prompts of 33 and 70 tokens reach past it
    "mistral-window-16": {"architecture": "mistral", "sliding_window": 16},
    # a sliding layer (window 24) and a global one, scores soft-capped in both
    "gemma2-window-and-softcap": {
        "architecture": "gemma2",
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 30.0,
        "hidden_act": "gelu_pytorch_tanh",
    },
}


@pytest.mark.parametrize("options", list(WINDOWED.values()), ids=list(WINDOWED))
def test_cuda_backend_drives_a_model_like_torch_native(cpu_ops, monkeypatch, options):
    """Prefill, decode and mixed steps; sliding-window and soft-capped layers run on the kernels
    (their window and soft-cap reach the ops), not on a fallback."""
    monkeypatch.setattr(policy, "_registry", BackendRegistry([CpuCudaBackend, TorchNativeBackend]))
    model = tiny_llama(**options)
    layer_options = {(a.window, a.softcap) for a in (layer.self_attn for layer in model.model.layers)}
    seen = []
    for name in ("attn_paged_decode", "attn_paged_prefill"):
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, kwargs["window"], kwargs["softcap"]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (5, 70, 33)]
    late = torch.randint(2, 256, (20,), generator=gen).tolist()
    with attn_backend("torch_native"):
        expected_tokens, expected_logits = greedy_run(model, prompts, late)
    with attn_backend("cuda"):
        tokens, logits = greedy_run(model, prompts, late, forced=expected_tokens)
    for got, want in zip(logits, expected_logits, strict=True):
        tol = 0.02 * float(want.abs().max())  # bf16 activations: attention rounded differently
        torch.testing.assert_close(got, want, rtol=0, atol=tol)
        top2 = want.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tol
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert sum(len(t) for t in tokens) == 3 * 7 + 4
    for name in ("attn_paged_decode", "attn_paged_prefill"):  # every layer ran on the kernels
        assert {(w, c) for op, w, c in seen if op == name} == layer_options, name


@pytest.mark.parametrize(
    "kinds", [("int8", "int8"), ("int8", "auto"), ("auto", "int8")], ids=["kv", "k", "v"]
)
def test_cuda_backend_serves_an_int8_pool_like_torch_native(cpu_ops, monkeypatch, kinds):
    """``--kv-cache-dtype int8`` (K and V, or one of them) on the cuda backend, sliding windows
    included: both ops get the pool's scales, and the logits follow torch_native's on an int8 pool
    through prefill, decode and mixed steps."""
    monkeypatch.setattr(policy, "_registry", BackendRegistry([CpuCudaBackend, TorchNativeBackend]))
    model = tiny_llama(architecture="mistral", sliding_window=16)
    scales_seen = []
    for name in ("attn_paged_decode", "attn_paged_prefill"):
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            scales_seen.append((_name, kwargs["k_scale"] is not None, kwargs["v_scale"] is not None))
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (9, 70, 33)]
    late = torch.randint(2, 256, (20,), generator=gen).tolist()
    with attn_backend("torch_native"):
        expected_tokens, expected_logits = greedy_run(model, prompts, late, kinds=kinds)
    with attn_backend("cuda"):
        tokens, logits = greedy_run(model, prompts, late, forced=expected_tokens, kinds=kinds)
    for got, want in zip(logits, expected_logits, strict=True):
        tol = 0.02 * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=tol)
        top2 = want.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tol
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    quantized = tuple(kind == "int8" for kind in kinds)
    assert {(op, k, v) for op, k, v in scales_seen} == {
        ("attn_paged_decode", *quantized),
        ("attn_paged_prefill", *quantized),
    }
