"""The default model with its GGUF weights kept quantized (``--weights gguf``) on the CPU kernels."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from astrai.model import keeps_quantized, load_model, quantized_kernels
from astrai.model.cpu_linear import PackedLinear
from astrai.model.quant import QuantizedEmbedding, QuantizedLinear
from astrai.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("cpu_kernels")

PROMPTS = [
    "Describe the water cycle.",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primes.",
]


@pytest.fixture(scope="module")
def gguf_bf16(default_model_path, cpu_kernels):
    why = quantized_kernels("cpu", torch.bfloat16)
    if why is not None:
        pytest.skip(why)
    return load_model(str(default_model_path), dtype=torch.bfloat16, weights="gguf")


def test_one_copy_of_the_files_blocks_and_no_dense_linear(gguf_bf16, default_model_path):
    model, _ = gguf_bf16
    reader = GGUFReader(default_model_path)
    quantized_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name in ("Q4_1", "Q8_0"))
    packed = sum(b.numel() for b in model.buffers() if b.dtype == torch.uint8)
    assert packed == quantized_bytes  # Q4_1 and Q8_0 keep the file's bits: the same bytes, rearranged
    assert not [
        m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear, torch.nn.Embedding))
    ]
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.segments[0][0] is model.model.embed_tokens.packed  # the tied head shares the table
    assert sum(p.numel() for p in model.parameters()) < 100_000  # the norms: every weight matrix is quantized
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and len(qkv.layouts) == 1 and qkv.out_features == 960


def _greedy(engine, prompts, n=24):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    results = [
        engine.submit(engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]), params)
        for p in prompts
    ]
    assert all(r.wait_completion(120) for r in results)
    for r in results:
        r.raise_for_error()
    return [r.output_ids for r in results]


def test_bf16_greedy_is_independent_of_the_batch(gguf_bf16, make_engine):
    """Run together or alone, a request's greedy tokens are the same, on the whole-step decode
    kernel running the quantized linears, with float32 logits. Every step stays within the
    kernel's 64 rows (prefill chunks of 32 tokens): a larger step takes the bf16-rounded weights
    of ``quant_linear_wide``, so a prompt prefilled among many tokens may continue differently."""
    from astrai.extension.backend.policy import get_registry
    from astrai_backend_cpu.stack import DecoderLayersKernel

    model, tokenizer = gguf_bf16
    # the bf16 kernel itself ("dtype"): "auto" would take int8 rows on AVX512-VNNI (and change the
    # module's shared model for the tests after this one)
    engine = make_engine(model, tokenizer, max_batch_size=8, max_prefill_tokens=32, activations="dtype")
    together = _greedy(engine, PROMPTS)
    alone = [_greedy(engine, [p])[0] for p in PROMPTS[:2]]
    assert alone == together[:2]
    stack_kernel = get_registry().kernels.get("decoder_layers", "cpu")
    assert isinstance(stack_kernel, DecoderLayersKernel) and stack_kernel._stacks[model][0] is not None


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.7.self_attn.o_proj",
        "model.layers.12.mlp.gate_up_proj",
        "model.layers.29.mlp.down_proj",
        "lm_head",
    ],
)
@pytest.mark.parametrize("rows", [1, 8])
def test_bf16_products_are_nearer_the_exact_ones_than_the_dense_bf16_path(gguf_bf16, name, rows):
    """On the model's own Q4_1 and Q8_0 weights: the kernel sums the exact dequantized products in
    float32, where the dense bf16 path first rounds every weight to bf16, so its error against the
    exact product is smaller (both round the output to bf16 once)."""
    model, _ = gguf_bf16
    packed, layout = model.get_submodule(name).segments[0]
    w = torch.ops.astrai_cpu.quant_dequant(packed, layout.ints(), None, torch.float32)
    x = torch.randn(rows, layout.k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = x.double() @ w.double().t()
    quant = torch.ops.astrai_cpu.quant_linear(x, packed, layout.ints(), None).double()
    dense = torch.nn.functional.linear(x, w.bfloat16()).double()
    assert (quant - exact).abs().mean() < 0.85 * (dense - exact).abs().mean()


def test_auto_weights_keep_the_blocks_in_bfloat16_on_the_cpu_only(gguf_bf16):
    """``--weights auto`` (astrai serve's default): quantized where the kernels run, in bf16 and
    float32; dense in float16 and off the CPU, where "gguf" is refused."""
    assert keeps_quantized("auto", "cpu", torch.bfloat16)
    assert keeps_quantized("gguf", "cpu", torch.bfloat16) and keeps_quantized("gguf", "cpu", torch.float32)
    assert keeps_quantized("auto", "cpu", torch.float32)  # the float32 kernel: the float32 model's products
    assert not keeps_quantized("dense", "cpu", torch.bfloat16)
    for device, dtype in (("cpu", torch.float16), ("meta", torch.bfloat16)):
        assert not keeps_quantized("auto", device, dtype)
        with pytest.raises(ValueError, match="--weights gguf: "):
            keeps_quantized("gguf", device, dtype)


@pytest.fixture(scope="module")
def gguf_f32(default_model_path, cpu_kernels):
    why = quantized_kernels("cpu", torch.float32)
    if why is not None:
        pytest.skip(why)
    return load_model(str(default_model_path), dtype=torch.float32, weights="gguf")


def test_float32_greedy_on_the_blocks_is_the_dense_float32_models(gguf_f32, default_model_path, make_engine):
    """The float32 kernel (AVX2's or AVX512-BF16's) sums the dequantized weights' products in
    float32, as the dense float32 model does in another order: the same greedy tokens. The four
    prompts' prefill step (over 64 rows) takes ``wide``: the weights dequantized into torch's sgemm."""
    model, tokenizer = gguf_f32
    dense, _ = load_model(str(default_model_path), dtype=torch.float32)
    kept = _greedy(make_engine(model, tokenizer, max_batch_size=4), PROMPTS, n=16)
    assert kept == _greedy(make_engine(dense, tokenizer, max_batch_size=4), PROMPTS, n=16)


def test_auto_weights_keep_the_blocks_where_the_kernel_takes_the_dtype(gguf_f32):
    """float32 everywhere the kernel builds; bf16 only where it lists bf16 (AVX512-BF16, not AVX2),
    and "gguf" in bf16 elsewhere says which dtypes it takes."""
    from astrai.extension.fused import kernel_for

    with torch.no_grad():
        dtypes = kernel_for("quant_linear", torch.empty(0)).dtypes
    assert keeps_quantized("auto", "cpu", torch.float32)
    assert keeps_quantized("auto", "cpu", torch.bfloat16) == (torch.bfloat16 in dtypes)
    if torch.bfloat16 not in dtypes:
        with pytest.raises(ValueError, match="takes float32 activations, not bfloat16"):
            keeps_quantized("gguf", "cpu", torch.bfloat16)


def test_serve_defaults_to_auto_weights():
    from astrai_server.config import ServerSettings

    assert ServerSettings().weights == "auto"


def test_the_decode_stack_takes_a_quantized_models_steps_up_to_the_quantized_kernels_rows(
    gguf_bf16, make_engine, in_force, monkeypatch
):
    """The stack's row limit is that of the kernels its linears call: on quantized weights
    ``quant_linear``'s ``max_rows``, not the dense ``linear`` kernel's (oneDNN's on an AMX CPU)."""
    from astrai.extension import fused

    model, tokenizer = gguf_bf16
    with torch.no_grad():
        real = fused.kernel_for("decoder_layers", torch.empty(0))
        linear, quant = (
            fused.kernel_for("linear", torch.empty(0)),
            fused.kernel_for("quant_linear", torch.empty(0)),
        )
    decode_rows: list[tuple[int, bool]] = []  # (rows, whether the stack ran them) per decode step

    def spy(model_, x, freqs, kv_cache):
        out = real(model_, x, freqs, kv_cache)
        if kv_cache.max_q_len == 1:
            decode_rows.append((x.shape[0], out is not None))
        return out

    before = linear.max_rows
    monkeypatch.setitem(in_force, "decoder_layers", spy)
    try:
        engine = make_engine(model, tokenizer, max_batch_size=4)
        linear.max_rows = 1  # the dense kernel's limit: not this model's
        _greedy(engine, PROMPTS, n=4)
        assert (4, True) in decode_rows and all(ran for _, ran in decode_rows)
        decode_rows.clear()
        quant.max_rows = 2  # an instance attribute over the class's 64
        _greedy(engine, PROMPTS, n=4)
        assert (4, False) in decode_rows and all(ran == (rows <= 2) for rows, ran in decode_rows)
    finally:
        linear.max_rows = before
        quant.__dict__.pop("max_rows", None)
