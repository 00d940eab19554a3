"""``astrai_cpu::encoder_attention``: a BERT layer's attention over packed sequences (each attends to
all of its own tokens, none of another's), read in place from the fused QKV rows; against float64
and SDPA, on the build (``avx512``) and on its emulation (``emulated``, as ``test_prefill_kernel``);
then MiniLM served in bf16 on it.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(params=["avx512", "emulated"])
def op(request):
    if request.param == "avx512":
        if not torch.cpu._is_avx512_bf16_supported():
            pytest.skip("the encoder kernel is built for AVX512-BF16; this CPU has none (SDPA runs instead)")
        return torch.ops.astrai_cpu.encoder_attention
    return request.getfixturevalue("avx512_emulated").encoder_attention


def packed(lengths: list[int], heads: int, d: int, seed: int, pad: int = 0) -> torch.Tensor:
    """bf16 QKV rows of the sequences one after another, each a strided view (``pad`` extra columns
    per row, as a slice of a wider projection would be)."""
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(sum(lengths), 3 * heads * d + pad, generator=gen) * 2).bfloat16()
    return wide[:, : 3 * heads * d]


def reference(qkv: torch.Tensor, lengths: list[int], heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Each sequence's unmasked attention over its own rows, in ``dtype``."""
    out, at = [], 0
    for n in lengths:
        q, k, v = qkv[at : at + n].to(dtype).view(n, 3, heads, -1).permute(1, 2, 0, 3)
        out.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, -1))
        at += n
    return torch.cat(out)


@pytest.mark.parametrize(("heads", "d"), [(12, 32), (4, 64), (2, 128)])
@pytest.mark.parametrize("lengths", [[1], [7], [8, 9], [33, 1, 64], [200, 16, 31, 5]])
def test_each_sequence_attends_to_its_own_tokens_as_float64_does(op, lengths, heads, d) -> None:
    qkv = packed(lengths, heads, d, seed=sum(lengths) + d, pad=3)
    got = op(qkv, torch.tensor(lengths), heads, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (sum(lengths), heads * d)
    want = reference(qkv, lengths, heads, torch.float64)
    err = (got.double() - want).abs().max().item()
    sdpa_err = (reference(qkv, lengths, heads, torch.bfloat16).double() - want).abs().max().item()
    # both round the probabilities and the output to bf16; the sums' order differs
    assert err <= 1.5 * sdpa_err + 2e-3, (err, sdpa_err)


def test_a_sequence_gets_the_same_bits_alone_and_among_others(op) -> None:
    """Its work items read its own rows only: the batch around it changes nothing."""
    lengths = [5, 70, 33, 1]
    qkv = packed(lengths, 12, 32, seed=1)
    together = op(qkv, torch.tensor(lengths), 12, 32**-0.5)
    at = 0
    for n in lengths:
        alone = op(qkv[at : at + n], torch.tensor([n]), 12, 32**-0.5)
        assert torch.equal(alone, together[at : at + n])
        at += n


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.zeros(4, 96), torch.tensor([4]), 1), "bf16"),
        ((torch.zeros(4, 96).bfloat16(), torch.tensor([3]), 1), "sum to qkv's rows"),
        ((torch.zeros(4, 96).bfloat16(), torch.tensor([4, 0]), 1), "at least 1"),
        ((torch.zeros(4, 96).bfloat16(), torch.tensor([4]), 5), "3 * heads * head_dim"),
        ((torch.zeros(4, 48).bfloat16(), torch.tensor([4]), 1), "head dim 32, 64 or 128"),
        ((torch.zeros(4, 96).bfloat16(), torch.tensor([4], dtype=torch.int32), 1), "int64"),
    ],
)
def test_what_it_refuses(op, args, message) -> None:
    with pytest.raises(RuntimeError, match=re.escape(message)):
        op(*args, 1.0)


@pytest.fixture(scope="module")
def minilm_bf16():
    from astrai.embedding import load_embedder

    engine = load_embedder("minilm-l6", torch.bfloat16)
    yield engine
    engine.shutdown()


TEXTS = [
    "A man is eating food.",
    "hi",
    "The quick brown fox jumps over the lazy dog, then keeps running through the forest until night "
    "falls and the owls start calling from the old oak trees on the hill.",
    "¿Dónde está la biblioteca? 図書館はどこですか",
]


def test_minilm_in_bf16_runs_its_attention_on_the_kernel(minilm_bf16, monkeypatch) -> None:
    """On the kernel (its linears packed too) a text's vector is the same alone as among others,
    within a cosine of 0.9995 of sentence-transformers' float32 and of the SDPA path's."""
    from sentence_transformers import SentenceTransformer

    from astrai.model import bert_attention
    from astrai.model.resolve import resolve_model

    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the encoder kernel is built for AVX512-BF16; this CPU has none")
    calls = []
    kernel_for = bert_attention.kernel_for
    monkeypatch.setattr(bert_attention, "kernel_for", lambda op, x: calls.append(op) or kernel_for(op, x))
    ids = minilm_bf16.encode(TEXTS)
    together = minilm_bf16.embed(ids)
    assert calls == ["encoder_attention"]
    # within 64 rows (46 tokens): the packed linear kernel's on every CPU (with AMX, more rows go
    # to oneDNN's tiles, whose sums are another order)
    few = minilm_bf16.embed(ids[:3])
    assert sum(map(len, ids[:3])) <= 64
    for i, one in enumerate(ids[:3]):
        assert torch.equal(minilm_bf16.embed([one])[0], few[i])
    want = SentenceTransformer(str(resolve_model("minilm-l6")[1]), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    assert F.cosine_similarity(together, want).min() >= 0.9995
    monkeypatch.setattr(bert_attention, "kernel_for", lambda op, x: None)  # SDPA over padded groups
    by_sdpa = minilm_bf16.embed(ids)
    assert not torch.equal(by_sdpa, together)
    assert F.cosine_similarity(together, by_sdpa).min() >= 0.9995
