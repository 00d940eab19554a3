"""8-bit activations (``--activations int8``): ``quant_linear`` on layouts with ``int8_rows``
(``csrc/quant_q8_avx2.cpp`` on AVX2 builds, float32 rows; ``csrc/quant_q8_avx512.cpp`` on
AVX512-BF16 builds for CPUs with AVX512-VNNI, bf16 and float32 rows) against a reference of the same
arithmetic, and the engine and server options that select it (``astrai.model.activations``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.engine import EngineConfig
from astrai.model import activations as switch
from astrai.model import load_model
from astrai.model.activations import use_int8_activations
from astrai.model.quant import (
    NATIVE,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize,
    narrow_bits,
    narrow_codes,
    narrow_scales,
    pack,
    split_blocks,
)
from astrai.sampling import SamplingParams
from astrai_backend_cpu.kernels import QuantLinearKernel
from tests.backend_cpu.test_quant_model import _greedy
from tests.core.test_quant import random_blocks

pytestmark = pytest.mark.usefixtures("cpu_kernels")

BOOK = Path(__file__).parents[2] / "benchmarks" / "data" / "pride_and_prejudice_1-4.txt"


@pytest.fixture(autouse=True)
def int8_build(cpu_kernels):
    if not torch.ops.astrai_cpu.has_quant_linear_int8():
        pytest.skip("8-bit activations are built for AVX2, or AVX512-BF16 with AVX512-VNNI")


def int8_dtype(name: str) -> torch.dtype:
    """``name``'s dtype where this build's kernel takes int8 rows of it (bf16: AVX512-VNNI builds)."""
    dtype = getattr(torch, name)
    if dtype not in QuantLinearKernel().int8_dtypes:
        pytest.skip(f"this build's int8 kernel takes no {name} rows (AVX2 builds: float32 only)")
    return dtype


def int8_layout(layout):
    return dataclasses.replace(layout, int8_rows=True)


def weight(qtype: str, n: int, k: int, seed: int):
    """A random weight's codes, scales and mins (split_blocks') and its tile layout."""
    codes, scales, mins = split_blocks(random_blocks(qtype, n, k, seed), qtype)
    return (codes, scales, mins), pack(codes, scales, mins, NATIVE[qtype])


def reference(x: torch.Tensor, codes, scales, mins, group: int) -> torch.Tensor:
    """The kernel's arithmetic, exactly: each row's groups quantized (scale amax / 127, codes
    rounded half to even, in float32 as the kernel rounds), the integer sums of code products per
    group, times the weight's and the row's scales; mins times the group sums of the unquantized
    row. In float64 (the integer sums exact)."""
    m, k = x.shape
    xg = x.view(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(xg * inv).double()  # [M, g, group]
    w = torch.from_numpy(codes).double().view(-1, k // group, group)  # [n, g, group]
    dots = torch.einsum("mgk,ngk->mng", q, w)
    row_scale = (amax.squeeze(-1) / 127).double()  # [M, g]
    out = (dots * torch.from_numpy(scales).double()[None] * row_scale[:, None]).sum(-1)
    if mins is not None:
        out = out + xg.sum(-1).double() @ torch.from_numpy(mins).double().t()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", sorted(NATIVE))
# every row block of either kernel (AVX2: 1-4 rows, tiles by 4, 2 and 1; AVX-512: up to 4 rows two
# tiles at a time, up to 8 one at a time, more over a pair of tiles expanded once)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 70])
@pytest.mark.parametrize("n", [40, 100])  # 3 and 7 tiles, the last one padded
def test_int8_rows_are_the_quantized_rows_integer_products(qtype, rows, n, dtype):
    dtype = int8_dtype(dtype)
    k, group = 256, NATIVE[qtype].group
    (codes, scales, mins), (packed, layout) = weight(qtype, n, k, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0, :group] = 0  # an all-zero group: scale 0, no division by it
    ints = int8_layout(layout).ints()
    # float32 sums (bf16 rows: float_out, the sums not rounded)
    got = torch.ops.astrai_cpu.quant_linear(x, packed, ints, None, float_out=dtype != torch.float32)
    x = x.float()
    w = dequantize(packed, layout).double()
    magnitude = x.double().abs() @ w.abs().t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # float32 scaling of exact integer sums: within 1e-6 of the products' magnitudes
    want = reference(x, codes, scales, mins, group)
    assert ((got.double() - want).abs() <= magnitude * 1e-6).all()
    # what the activations' rounding costs against the exact product: well under 1%
    assert ((got.double() - x.double() @ w.t()).abs() <= magnitude * 1e-2).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q6_K"])
def test_bf16_rows_are_rounded_once_after_the_bias(qtype):
    """bf16 rows give bf16 outputs: the float32 sums plus the bias, rounded once."""
    int8_dtype("bfloat16")
    _, (packed, layout) = weight(qtype, 100, 256, seed=2)
    ints = int8_layout(layout).ints()
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(100, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = torch.ops.astrai_cpu.quant_linear(x, packed, ints, bias)
    sums = torch.ops.astrai_cpu.quant_linear(x, packed, ints, bias, float_out=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, sums.bfloat16())
    bare = torch.ops.astrai_cpu.quant_linear(x, packed, ints, None, float_out=True)
    assert torch.equal(sums, bare + bias.float())  # one float32 addition


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_batch(qtype, dtype):
    dtype = int8_dtype(dtype)
    _, (packed, layout) = weight(qtype, 100, 256, seed=1)
    ints = int8_layout(layout).ints()
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    batch = torch.ops.astrai_cpu.quant_linear(x, packed, ints, None)
    for i in (0, 5, 36):
        assert torch.equal(torch.ops.astrai_cpu.quant_linear(x[i : i + 1], packed, ints, None)[0], batch[i])
    for lo, hi in ((3, 8), (10, 13), (20, 28)):  # blocks of 5, 3 and 8 rows
        assert torch.equal(torch.ops.astrai_cpu.quant_linear(x[lo:hi], packed, ints, None), batch[lo:hi])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def int8_model(request, default_model_path, cpu_kernels):
    """The default model's GGUF blocks in float32 and (where the kernel takes bf16 int8 rows) in bf16,
    its own copy (the switch changes its layouts)."""
    return load_model(str(default_model_path), dtype=int8_dtype(request.param), weights="gguf")


def test_the_engine_switches_every_quantized_linear_and_each_keeps_its_rows_apart(int8_model, make_engine):
    """``activations="int8"``: every linear (the decode stack's and the LM head) multiplies int8
    rows, on the kernel at every width (prefill steps over ``max_rows`` included); a linear's rows
    give the same results alone as in any batch; four requests decode together (steps of 1 to 4
    rows on the whole-step kernel) and the KV invariants hold after (``make_engine``)."""
    model, tokenizer = int8_model
    engine = make_engine(model, tokenizer, max_batch_size=4, activations="int8")
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(lay.int8_rows for m in linears for lay in m.layouts)
    x = torch.randn(100, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(
        next(model.parameters()).dtype
    )
    with torch.no_grad():
        for linear in (linears[0], linears[-1]):  # the first layer's q/k/v, the LM head
            whole = linear(x)
            for rows in (1, 4, 64, 65):
                assert torch.equal(linear(x[:rows]), whole[:rows])
    prompts = ["Describe the water cycle.", "List three primes.", "def fibonacci(n):", "Name a colour."]
    assert all(len(ids) == 16 for ids in _greedy(engine, prompts, 16))


def _prompt_scores(engine, ids):
    """Each prompt token's log-probability given the ones before it, and the top token there."""
    request = engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert request.wait_completion(120)
    request.raise_for_error()
    scored = request.prompt_logprobs[1:]  # (the first token has none)
    return torch.tensor([t.logprob for t in scored]), torch.tensor([t.top[0][0] for t in scored])


def test_int8_scores_of_a_held_text_stay_near_the_float32_ones(default_model_path, int8_model, make_engine):
    """300 tokens of the held book (benchmarks/data) scored by the same blocks with int8 and with
    the model's own activations (float32 or bf16): every log-probability moved (the switch is in
    effect), by 0.2 nats at most on average (float32: 0.12 measured over 4,000 tokens), and the top
    token the same at 85% of the positions at least (92% measured)."""
    model, tokenizer = int8_model
    exact, _ = load_model(str(default_model_path), dtype=next(model.parameters()).dtype, weights="gguf")
    ids = tokenizer.encode(BOOK.read_text(), add_special_tokens=True)[:300]
    got, got_top = _prompt_scores(make_engine(model, tokenizer, max_batch_size=1, activations="int8"), ids)
    want, want_top = _prompt_scores(make_engine(exact, tokenizer, max_batch_size=1, activations="dtype"), ids)
    change = (got - want).abs()
    assert change.max() > 1e-3 and change.mean() < 0.2
    assert (got_top == want_top).float().mean() >= 0.85


def test_the_int8_switch_refuses_what_nothing_would_run(default_model_path, cpu_kernels):
    dense, _ = load_model(str(default_model_path), dtype=torch.float32)
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="GGUF-quantized weights kept quantized; this model has none"),
    ):
        use_int8_activations(dense)
    with pytest.raises(ValueError, match="activations must be auto, int8 or dtype, got 'fp8'"):
        EngineConfig(activations="fp8")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights", "dense"], "--weights dense dequantizes them"),
        (["--tensor-parallel-size", "2"], "tensor parallelism shards dense weights"),
    ],
)
def test_serve_refuses_int8_activations_that_could_not_run_at_start(flags, message):
    run = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "serve", "--activations", "int8", *flags, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert message in run.stderr


def test_dot_peak_measures_each_instruction_this_build_has():
    """``dot_peak`` (benchmarks/floor_bench.py's floors): a rate for each kind this build has an
    instruction for (fma on every build with the kernels, bf16 with AVX512-BF16, int8 where the
    VNNI kernel is built too), -1 for the others; unknown kinds refused."""
    ops = torch.ops.astrai_cpu
    bf16 = ops.has_quant_linear_bf16()
    has = {"fma": ops.has_quant_linear(), "bf16": bf16, "int8": bf16 and ops.has_quant_linear_int8()}
    for kind, built in has.items():
        rate = ops.dot_peak(kind, 100_000)
        assert rate > 0 if built else rate == -1.0, (kind, rate)
    with pytest.raises(RuntimeError, match="dot_peak: kind is fma, bf16 or int8"):
        ops.dot_peak("fp8", 10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_takes_int8_only_where_it_keeps_the_models_quality(default_model_path, make_engine, dtype):
    """``activations="auto"`` (the default) switches a GGUF model to int8 rows where the kernel lists
    its dtype in ``int8_default_dtypes`` (bf16 on AVX512-VNNI builds: perplexity within 1% of bf16,
    lm-eval's items unchanged); a float32 model, and any model with ``"dtype"``, stays exact."""
    dtype = int8_dtype(dtype)
    expected = dtype in QuantLinearKernel().int8_default_dtypes
    assert expected == (dtype == torch.bfloat16 and torch.ops.astrai_cpu.has_quant_linear_bf16())
    for activations, switched in (("auto", expected), ("dtype", False)):
        model, tokenizer = load_model(str(default_model_path), dtype=dtype, weights="gguf")
        make_engine(model, tokenizer, max_batch_size=1, activations=activations)
        layouts = [lay for m in model.modules() if isinstance(m, QuantizedLinear) for lay in m.layouts]
        assert layouts and all(lay.int8_rows == switched for lay in layouts), activations


def narrow_build() -> None:
    if not torch.ops.astrai_cpu.has_quant_narrow_codes():
        pytest.skip(
            "5- and 6-bit codes are read by the AVX512-VNNI kernel only (AVX2 builds keep int8 codes)"
        )


def narrowed(qtype: str, n: int, k: int, seed: int):
    """A random weight's int8 layout, and the same narrowed as the switch narrows it (the file's
    5- and 6-bit codes, a K-quant's scales as its factors)."""
    _, (packed, layout) = weight(qtype, n, k, seed=seed)
    data, lay = packed, layout
    if (bits := narrow_bits(data, lay)) is not None:
        data, lay = narrow_codes(data, lay, bits)
    data, lay = narrow_scales(data, lay) or (data, lay)
    return (packed, int8_layout(layout)), (data, int8_layout(lay))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 70])  # every row block of the AVX-512 kernel
def test_narrowed_layouts_give_the_int8_layouts_products_to_the_bit(qtype, rows, dtype):
    """The file's bits given back (5- and 6-bit codes, a K-quant's scales as the file's factors,
    two super-blocks of them): the same outputs as the int8 layouts they come from, bit for bit
    (the same integer sums, the same float32 scales), with a bias, rounded to bf16 or float32 out."""
    narrow_build()
    dtype = int8_dtype(dtype)
    (packed, layout), (data, lay) = narrowed(qtype, 100, 512, seed=rows)
    assert lay.spec.bits == {"Q4_K": 4, "Q6_K": 6}.get(qtype, 5)
    assert lay.spec.k_scales == qtype.endswith("_K")
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0, :32] = 0  # an all-zero group
    bias = torch.randn(100, generator=torch.Generator().manual_seed(1)).to(dtype)
    ops = torch.ops.astrai_cpu
    for b, float_out in ((None, False), (bias, False), (None, True)):
        want = ops.quant_linear(x, packed, layout.ints(), b, float_out=float_out)
        got = ops.quant_linear(x, data, lay.ints(), b, float_out=float_out)
        assert torch.equal(got, want)


def test_narrowed_layouts_are_refused_where_nothing_reads_them():
    """A layout of 5- or 6-bit codes or of K-quant factors outside quant_linear's int8 rows (the
    float path, dequantizing rows or the whole weight) is refused with the reason, not misread."""
    narrow_build()
    ops, x = torch.ops.astrai_cpu, torch.randn(2, 256)
    for qtype, message in (
        ("Q5_0", "5- and 6-bit codes are read by quant_linear on int8 rows only"),
        ("Q4_K", "K-quant scales .* are read by quant_linear on int8 rows only"),
    ):
        _, (data, lay) = narrowed(qtype, 32, 256, seed=0)
        plain = dataclasses.replace(lay, int8_rows=False)
        with pytest.raises(RuntimeError, match=message):
            ops.quant_linear(x, data, plain.ints(), None)
        with pytest.raises(RuntimeError, match=message):
            ops.quant_dequant(data, lay.ints(), None, torch.float32)
        with pytest.raises(RuntimeError, match=message):
            ops.quant_weight_t(data, lay.ints(), torch.float32)


def test_a_tied_head_keeps_its_tables_codes(cpu_kernels):
    """The switch narrows a linear's own codes, not a table it shares with the embedding (a tied
    LM head): narrowing it would keep two copies."""
    narrow_build()
    _, (packed, layout) = weight("Q5_0", 48, 64, seed=0)
    _, (other, other_layout) = weight("Q5_0", 48, 64, seed=1)
    model = torch.nn.ModuleDict(
        {
            "embed": QuantizedEmbedding(packed, layout, torch.float32),
            "head": QuantizedEmbedding(packed, layout, torch.float32).as_linear(),
            "own": QuantizedLinear([(other, other_layout)]),
            "norm": torch.nn.RMSNorm(64),  # (the switch reads the model's dtype off its parameters)
        }
    )
    assert use_int8_activations(model) == 2
    assert model["head"].layouts[0].spec.bits == 8 and model["head"].packed0 is packed
    assert model["own"].layouts[0].spec.bits == 5 and model["own"].packed0.numel() < other.numel()


@pytest.fixture(scope="module")
def gemma_path():
    from astrai.model.resolve import ModelNotFound, install_command, resolve_model

    try:
        return resolve_model("gemma3-270m")[1]
    except ModelNotFound:
        if os.environ.get("CI"):
            pytest.fail("gemma3-270m is not installed; CI installs it: see the README's test command")
        pytest.skip(f"gemma3-270m is not installed ({install_command('gemma3-270m')})")


def test_gemma_reads_its_files_bits_and_decodes_the_same_tokens(gemma_path, make_engine, monkeypatch):
    """Gemma 3 270M's Q4_K_M file holds its layers as Q5_0, Q4_K and Q6_K: with int8 activations
    (the default of a bf16 model on AVX512-VNNI) the engine reads them in 5, 4 and 6 bits with the
    K-quants' scales as the file's factors, 30 MB a token less than int8 codes and float32 scales,
    and greedy decoding of a batch gives the tokens those give."""
    narrow_build()
    int8_dtype("bfloat16")
    outputs, sizes = {}, {}
    for narrow in (True, False):
        if not narrow:
            monkeypatch.setattr(switch, "_narrow", lambda *a: None)
        model, tokenizer = load_model(str(gemma_path), dtype=torch.bfloat16, weights="gguf")
        engine = make_engine(model, tokenizer, max_batch_size=3, activations="int8")
        layouts = [lay for m in model.modules() if isinstance(m, QuantizedLinear) for lay in m.layouts]
        kinds = {(lay.spec.bits, lay.spec.k_scales) for lay in layouts}
        assert kinds == (
            {(4, True), (5, False), (6, True), (8, False)} if narrow else {(4, False), (8, False)}
        )
        sizes[narrow] = sum(lay.nbytes for lay in layouts)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
        requests = [engine.submit(tokenizer.encode(p), params) for p in prompts]  # a base model: no template
        assert all(r.wait_completion(120) for r in requests)
        outputs[narrow] = [r.output_ids for r in requests]
    assert outputs[True] == outputs[False]
    assert sizes[False] - sizes[True] > 29e6
