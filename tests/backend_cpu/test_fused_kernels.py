"""The CPU plugin's fused kernels against the PyTorch formulations they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.extension import apply_rotary_emb, fused
from astrai.extension.backend.rotary import RotaryEmbedding, rotate_torch

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"]
)


def close(got, want):
    """float32: reduction order only (1e-5); half types: two units in the last place at most (a one-ulp
    difference before the weight product can become two after it), and nearly all identical."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(
            got.float(), want.float(), atol=0, rtol=2**-6 if want.dtype == torch.bfloat16 else 2**-9
        )
        assert (got != want).float().mean() < 0.01


def test_the_loaded_backend_lends_its_kernels_for_the_cpu_alone(in_force):
    from astrai.extension.backend.policy import get_registry
    from astrai_backend_cpu.backend import CpuBackend

    lent = set(in_force)
    assert {"rotary", "rms_norm", "add_rms_norm", "argmax"} <= lent
    assert ("silu_and_mul" in lent) == torch.ops.astrai_cpu.has_silu_and_mul()
    assert torch.ops.astrai_cpu.has_silu_and_mul() == torch.cpu._is_avx512_bf16_supported()
    assert ("linear" in lent) == torch.cpu._is_avx512_bf16_supported()
    assert type(get_registry().instance("cpu")) is CpuBackend
    assert CpuBackend().kernels("cuda") == {} and CpuBackend().kernels("meta") == {}


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: more than one thread's share
def test_rms_norm_and_its_residual_form(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    w = (1 + torch.randn(576, generator=gen) / 4).to(dtype)
    with torch.no_grad():
        close(fused.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), eps=1e-5) * w)
        s, n = fused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    close(n, F.rms_norm(x + r, (576,), eps=1e-5) * w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 300])
def test_float32_weights_on_narrow_rows_round_once(dtype, rows):
    """Gemma's ``1 + weight`` norm (``OffsetRMSNorm``) on bf16 rows: float32 throughout, one rounding
    at the end. Given float32 weights, the kernel gives the bits of its own float32 norm of the rows
    widened to float32, then rounded (the layers' computation, which the whole-step kernel repeats)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 640, generator=gen).to(dtype)
    w = 1 + torch.randn(640, generator=gen) / 4
    op = torch.ops.astrai_cpu.rms_norm
    with torch.no_grad():
        got, want = op(x, w, 1e-6), op(x.float(), w, 1e-6).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    if rows > 1:  # (rounding the weights first, or the normed rows, differs somewhere)
        assert not torch.equal(got, op(x, w.to(dtype), 1e-6))


def test_non_contiguous_rows_are_accepted():
    x = torch.randn(4, 1200)[:, 16:592]  # row stride 1200
    w = torch.randn(576)
    with torch.no_grad():
        close(fused.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), eps=1e-5) * w)


SILU = pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="silu_and_mul is built for CPUs with AVX512-BF16"
)


@SILU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 2 x 1030: several threads' rows
def test_silu_and_mul_is_the_pytorch_formulation(dtype, rows):
    """``F.silu(gate) * up``, each rounded to the dtype: bf16 bit for bit nearly everywhere (the
    kernel's exp is not SLEEF's: an ulp of float32 may move a rounding), float32 to an ulp or two;
    rows with a strided view, a width that ends inside a vector, and the extremes (infinities,
    NaN, gates far past exp's range)."""
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 2 * 1030 + 48, generator=gen) * 6).to(dtype)
    x = wide[:, : 2 * 1030]  # row stride 2108
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 120.0, -120.0, 0.0]).to(dtype)
    x[0, 1030:1036] = torch.tensor([2.0, 3.0, 1.0, -1.0, 5.0, float("nan")]).to(dtype)
    with torch.no_grad():
        assert fused.kernel_for("silu_and_mul", x) is not None
        got = fused.silu_and_mul(x)
    want = F.silu(x[:, :1030]) * x[:, 1030:]
    assert got.dtype == dtype and got.shape == (rows, 1030) and got.is_contiguous()
    assert torch.equal(got.isnan(), want.isnan())
    assert got[0, 0].item() == 2 * float("inf") and got[0, 3].item() == -120.0 and got[0, 4].item() == 0.0
    ok = ~want.isnan()
    if dtype == torch.float32:
        torch.testing.assert_close(got[ok], want[ok], atol=1e-6, rtol=3e-7)
    else:
        assert (got[ok] != want[ok]).float().mean() < 0.001
        torch.testing.assert_close(got[ok].float(), want[ok].float(), atol=0, rtol=2**-7)


@SILU
def test_silu_and_mul_refuses_what_it_does_not_take():
    op = torch.ops.astrai_cpu.silu_and_mul
    for bad in (torch.zeros(3, 5), torch.zeros(4, 6).half(), torch.zeros(6), torch.zeros(8, 4).t()):
        with pytest.raises(RuntimeError, match="silu_and_mul: x must be"):
            op(bad)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_a_slice_of_the_fused_qkv(head_dim):
    # the model's call: [1, T, q+k heads, D] viewed out of the [T, (q+2k) * D] QKV output
    t, heads, kv = 37, 9, 3
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(t, (heads + 2 * kv) * head_dim, generator=gen).bfloat16()
    x = qkv[:, : (heads + kv) * head_dim].view(1, t, heads + kv, head_dim)
    freqs = RotaryEmbedding(head_dim, 4096)(torch.randint(0, 4096, (1, t), generator=gen))
    with torch.no_grad():
        assert fused.kernel_for("rotary", x) is not None
        got = apply_rotary_emb(x, freqs)
    close(got, rotate_torch(x, freqs))


def test_rotary_broadcast_freqs_take_the_torch_path():
    x = torch.randn(2, 5, 3, 64).bfloat16()
    freqs = RotaryEmbedding(64, 16)(torch.arange(5)[None])  # [1, 5, 32, 2], broadcast over the batch
    with torch.no_grad():
        assert torch.equal(apply_rotary_emb(x, freqs), rotate_torch(x, freqs))


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="linear_packed is built for CPUs with AVX512-BF16"
)
@pytest.mark.parametrize("k", [576, 1536, 100, 33])  # 33: an odd K (x padded to pairs)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 40])  # blocks of 8 rows: whole and partial
def test_linear_is_f_linear_and_batch_invariant(k, bias, rows):
    gen = torch.Generator().manual_seed(k + rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(1001, k, generator=gen) / k**0.5).bfloat16()  # 1001 rows: a partial last tile of 16
    b = torch.randn(1001, generator=gen).bfloat16() if bias else None
    with torch.no_grad():
        kernel = fused.kernel_for("linear", x)
        assert kernel is not None
        packed = kernel.pack(w)
        got = kernel(x, packed, b)
        close(got, F.linear(x, w, b))
        for i in range(rows):  # each row alone: the same bits as inside the batch
            assert torch.equal(kernel(x[i : i + 1], packed, b)[0], got[i])


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="linear_packed is built for CPUs with AVX512-BF16"
)
@pytest.mark.parametrize("rows", [1, 11, 70])  # 70: past the AMX limit, still the kernel
def test_linear_float_out_is_the_unrounded_sum_for_an_lm_head(rows):
    """``float_out``: the float32 sums the bf16 result rounds; PackedLinear takes it for the LM head
    (prepack_linears), on the kernel for any number of rows."""
    from astrai.model.cpu_linear import PackedLinear, prepack_linears

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = (torch.randn(1001, 96, generator=gen) / 96**0.5).bfloat16()
    b = torch.randn(1001, generator=gen).bfloat16()
    with torch.no_grad():
        kernel = fused.kernel_for("linear", x)
        packed = kernel.pack(w)
        got = kernel(x, packed, b, float_out=True)
        assert got.dtype == torch.float32
        assert torch.equal(got.bfloat16(), kernel(x, packed, b))  # one rounding of the very same sums
        exact = x.double() @ w.double().t() + b.double()
        assert (got.double() - exact).abs().max() < (got.bfloat16().double() - exact).abs().max()

        model = torch.nn.Module()
        model.body, model.lm_head = torch.nn.Linear(96, 96, bias=False), torch.nn.Linear(96, 1001)
        model.lm_head.weight.data, model.lm_head.bias.data = w, b
        model.body.to(torch.bfloat16)
        assert prepack_linears(model) == 2
        assert (
            isinstance(model.lm_head, PackedLinear) and model.lm_head.float_out and not model.body.float_out
        )
        assert torch.equal(model.lm_head(x), got)


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="linear_packed is built for CPUs with AVX512-BF16"
)
def test_linear_takes_any_number_of_rows_where_there_is_no_amx(in_force):
    kernel = in_force["linear"]
    assert kernel.max_rows == (64 if torch.cpu._is_amx_tile_supported() else None)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 64, generator=gen).bfloat16()  # 37 blocks of 8 rows and a partial one
    w = torch.randn(40, 64, generator=gen).bfloat16()
    got = torch.ops.astrai_cpu.linear_packed(x, torch.ops.astrai_cpu.linear_pack(w), 40, None)
    close(got, F.linear(x, w))
    with pytest.raises(RuntimeError, match="bf16 rows"):
        torch.ops.astrai_cpu.linear_packed(x.float(), torch.ops.astrai_cpu.linear_pack(w), 40, None)


# --- argmax: greedy tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000, 16384, 16385, 49152, 262144 + 3])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_argmax_is_max_indices_on_random_rows(width, rows):
    gen = torch.Generator().manual_seed(width + rows)
    logits = torch.randn(rows, width, generator=gen) * 8
    got = torch.ops.astrai_cpu.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.max(dim=-1).indices)


def test_argmax_takes_the_first_of_equal_maxima_and_the_first_nan():
    """Ties inside a vector, across lanes and across the kernel's 16,384-logit pieces; NaN, infinities
    and rows of -inf: the very indices torch.max gives."""
    logits = torch.randn(9, 40_000)
    logits[0, [5, 21, 37]] = 50.0  # one lane, then others
    logits[1, [30_000, 20_000, 17_000]] = 50.0  # in later pieces, the first not the earliest written
    logits[2, [39_999, 3]] = 50.0
    logits[3, [100, 30_000]] = float("nan")  # a NaN wins, the first one
    logits[3, 5] = float("inf")
    logits[4, 7] = float("inf")
    logits[4, 30_000] = float("nan")
    logits[5] = float("-inf")
    logits[6, [8, 9]] = float("inf")
    logits[7, 39_998] = float("nan")  # in the tail of the last piece
    logits[8, 16_384 * 2 + 5] = 60.0
    want = logits.max(dim=-1).indices
    assert want.tolist()[:6] == [5, 17_000, 3, 100, 30_000, 0]
    assert torch.equal(torch.ops.astrai_cpu.argmax(logits), want)
    wide = torch.randn(9, 50_000)  # rows of a wider tensor: a row stride past the width
    wide[:, :40_000] = logits
    assert torch.equal(torch.ops.astrai_cpu.argmax(wide[:, :40_000]), want)


def test_argmax_refuses_what_it_does_not_take_and_the_model_falls_back():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.astrai_cpu.argmax(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.astrai_cpu.argmax(torch.randn(8))
    half = torch.randn(4, 1000).bfloat16()  # greedy_tokens: the torch formulation for other dtypes
    assert torch.equal(fused.greedy_tokens(half), half.max(dim=-1).indices)
    logits = torch.randn(4, 1000)
    assert torch.equal(fused.greedy_tokens(logits), logits.max(dim=-1).indices)
    assert torch.equal(fused.greedy_tokens(logits.t().contiguous().t()), logits.max(dim=-1).indices)


# --- categorical: sampled tokens ----------------------------------------------------------------


def _race_reference(logits, temperature, seeds, steps):
    """astrai.sampling.noise.categorical on softmax(logits / temperature), and whether each row's draw
    is clear: the two best ratios of both of its races more than a float32 rounding apart."""
    from astrai.sampling.noise import BLOCK, categorical, exponential_noise

    y = logits if temperature is None else logits / temperature.masked_fill(temperature == 0, 1).unsqueeze(1)
    probs = torch.softmax(y, dim=-1)
    want = categorical(probs, seeds, steps)
    rows, vocab = probs.shape
    padded = F.pad(probs, (0, -vocab % BLOCK)).view(rows, -1, BLOCK)
    mass = padded.sum(-1) / exponential_noise(seeds, steps, torch.arange(padded.shape[1]), stream=1)
    block = want // BLOCK
    tokens = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK)
    inner = padded[torch.arange(rows), block] / exponential_noise(seeds, steps, tokens, stream=0)

    def margin(r):
        top = r.topk(min(2, r.shape[1]), dim=-1).values
        return (top[:, 0] - top[:, -1]) / top[:, 0] if r.shape[1] > 1 else torch.ones(rows)

    return want, (margin(mass) > 1e-5) & (margin(inner) > 1e-5)


@pytest.mark.parametrize("width", [1, 7, 255, 256, 257, 16384 + 300, 49152, 262144])
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_categorical_draws_the_python_races_token(width, rows):
    """The kernel's token is ``categorical(softmax(logits / t))``'s wherever that race is not a near tie
    (every row of these), with filtered (-inf) tokens, a shared and a per-row temperature."""
    gen = torch.Generator().manual_seed(width * 100 + rows)
    logits = torch.randn(rows, width, generator=gen) * 3
    logits[::2, 1::3] = float("-inf")  # a filter's leftovers on every other row
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    steps = torch.randint(0, 2**31, (rows,), generator=gen)
    op = torch.ops.astrai_cpu.categorical
    for temperature in (None, torch.full((rows,), 0.7), torch.rand(rows, generator=gen) * 2 + 0.05):
        want, clear = _race_reference(logits, temperature, seeds, steps)
        got = op(logits, temperature, seeds, steps)
        assert got.dtype == torch.int64 and bool(clear.all())
        assert torch.equal(got, want)
        assert bool((logits.gather(1, got.unsqueeze(1)) > float("-inf")).all())  # never a filtered token


def test_categorical_rows_are_their_own_and_the_edges_are_the_pythons():
    """A row's token does not depend on its batch; rows the softmax turns to NaN give token 0, as the
    Python race does; a temperature of 0 (a greedy row, taken elsewhere) counts as 1; strided rows."""
    from astrai.sampling.noise import categorical

    op = torch.ops.astrai_cpu.categorical
    logits = torch.randn(8, 3000) * 4
    logits[1, 17] = float("nan")
    logits[2, 2999] = float("inf")
    logits[3] = float("-inf")
    logits[4] = float("-inf")
    logits[4, 2345] = -7.0  # the one token left
    seeds, steps = torch.arange(8) * 7919, torch.arange(8) + 3
    got = op(logits, None, seeds, steps)
    want = categorical(torch.softmax(logits, dim=-1), seeds, steps)
    assert got.tolist()[1:5] == [0, 0, 0, 2345] and torch.equal(got, want)
    for row in range(8):
        assert op(logits[row : row + 1], None, seeds[row : row + 1], steps[row : row + 1]).item() == got[row]
    temps = torch.tensor([0.0, 1.0] * 4)
    assert torch.equal(op(logits, temps, seeds, steps), got)
    wide = torch.full((8, 4000), 5.0)
    wide[:, :3000] = logits
    assert torch.equal(op(wide[:, :3000], None, seeds, steps), got)


def test_categorical_draws_from_the_softmax():
    """Frequencies over 20,000 steps of one seed: softmax([log .5, log .3, log .2, -inf]) at temperature 1,
    and the same logits halved at temperature 0.5."""
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log().expand(20_000, 4).contiguous()
    seeds, steps = torch.full((20_000,), 12345), torch.arange(20_000)
    for x, t in ((logits, None), (logits / 2, torch.full((20_000,), 0.5))):
        counts = torch.bincount(torch.ops.astrai_cpu.categorical(x, t, seeds, steps), minlength=4)
        assert counts[3] == 0
        assert torch.allclose(counts[:3] / 20_000, torch.tensor([0.5, 0.3, 0.2]), atol=0.015), counts


def test_categorical_refuses_what_it_does_not_take():
    op = torch.ops.astrai_cpu.categorical
    s = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 8).bfloat16(), None, s, s)
    with pytest.raises(RuntimeError, match="seeds"):
        op(torch.randn(2, 8), None, s[:1], s)
    with pytest.raises(RuntimeError, match="temperature"):
        op(torch.randn(2, 8), torch.ones(2, dtype=torch.float64), s, s)


def test_the_pipeline_draws_on_the_kernel_what_it_draws_without_it(in_force, monkeypatch):
    """``SamplingPipeline.sample`` with the ``categorical`` kernel lent and without: the same tokens for
    temperature-only rows (drawn in place: the logits are not modified), a batch mixing greedy rows,
    and rows filtered by top-k / top-p / min-p and penalised first."""
    from astrai.sampling import SamplingParams
    from astrai.sampling import pipeline as pipeline_module
    from astrai.sampling.batch import SamplingBatch
    from astrai.sampling.pipeline import SamplingPipeline

    assert "categorical" in in_force
    pipeline = SamplingPipeline.default()
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 5000, generator=gen) * 3
    batches = {
        "temperature": [
            SamplingParams(temperature=t, seed=i) for i, t in enumerate([1.0, 0.6, 1.3, 1.0, 0.2, 2.0])
        ],
        "greedy_mix": [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(6)],
        "filtered": [
            SamplingParams(temperature=0.9, top_k=40, seed=1),
            SamplingParams(temperature=1.0, top_p=0.8, seed=2),
            SamplingParams(temperature=0.7, min_p=0.05, seed=3),
            SamplingParams(temperature=1.0, frequency_penalty=1.5, seed=4),
            SamplingParams(temperature=1.0, logit_bias={7: 30.0}, seed=5),
            SamplingParams(temperature=0.0),
        ],
    }
    for name, params in batches.items():
        batch = SamplingBatch.from_params(params, [3] * 6, "cpu", [[7, 8, 9]] * 6)
        before = logits.clone()
        with_kernel = pipeline.sample(logits, batch)
        assert torch.equal(logits, before), name
        with monkeypatch.context() as m:
            m.setattr(pipeline_module, "kernel_for", lambda op, x: None)
            without = pipeline.sample(logits, batch)
        assert torch.equal(with_kernel, without), name
    assert with_kernel[4] == 7 and with_kernel[5] == logits[5].argmax()


# --- top_p: the nucleus without a sort -----------------------------------------------------------


def _nucleus_bounds(row: torch.Tensor, top_p: float) -> tuple[float, float]:
    """The mass strictly ahead of each token of ``row`` in descending order, in float64: ``(lowest kept,
    highest dropped)`` logits that a cut-off within 1e-6 of ``top_p`` may give (ties count as one)."""
    values = row.double().sort(descending=True).values
    probs = torch.softmax(values, dim=-1)
    ahead = torch.cumsum(probs, 0) - probs
    first = torch.ones_like(values, dtype=torch.bool)  # the first position of each run of equal values
    first[1:] = values[1:] != values[:-1]
    surely_kept = values[(ahead < top_p - 1e-6) & first]
    surely_dropped = values[(ahead > top_p + 1e-6) & first & torch.isfinite(values)]
    return float(surely_kept.min()), float(surely_dropped.max()) if surely_dropped.numel() else float("-inf")


@pytest.mark.parametrize("width", [1, 2, 300, 3000, 49152, 262144])
def test_top_p_keeps_the_nucleus_of_the_float64_sums(width):
    """Each row keeps every token whose mass ahead is under top_p and none whose mass ahead reaches it
    (within 1e-6, float64 reference), ties with the last kept one too; -inf stays -inf; rows with
    top_p 1 are untouched; flat rows, a long run of equal logits, peaked and wide rows."""
    gen = torch.Generator().manual_seed(width)
    scales = torch.tensor([0.0, 0.3, 1.0, 3.0, 6.0, 20.0, 3.0, 3.0])
    logits = torch.randn(8, width, generator=gen) * scales.unsqueeze(1)
    if width > 10:
        logits[::3, ::7] = float("-inf")
        logits[2, : width // 2] = logits[2, 0]  # half the row tied
    tops = torch.tensor([0.5, 0.9, 0.95, 0.99, 0.3, 0.999, 1.0, 0.01])
    got = torch.ops.astrai_cpu.top_p(logits.clone(), tops)
    assert torch.equal(got[6], logits[6])
    for row in range(8):
        if tops[row] == 1.0:
            continue
        kept = torch.isfinite(got[row])
        assert torch.equal(got[row][kept], logits[row][kept])  # kept logits untouched
        lowest, highest_dropped = _nucleus_bounds(logits[row], float(tops[row]))
        assert bool((logits[row] >= lowest).le(kept).all()), row  # every sure token kept
        assert not bool(kept[logits[row] <= highest_dropped].any()), row  # no sure drop kept
        cut = float(got[row][kept].min())
        assert torch.equal(kept, logits[row] >= cut)  # one cut-off: ties with it kept


def test_top_p_leaves_rows_it_cannot_order_and_refuses_what_it_does_not_take():
    op = torch.ops.astrai_cpu.top_p
    logits = torch.randn(4, 500)
    logits[0, 3] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    got = op(logits.clone(), torch.full((4,), 0.5))
    assert torch.equal(got[:3].nan_to_num(), logits[:3].nan_to_num()) and torch.isfinite(got[3]).sum() < 500
    with pytest.raises(RuntimeError, match="float32"):
        op(logits.bfloat16(), torch.full((4,), 0.5))
    with pytest.raises(RuntimeError, match="top_p"):
        op(logits, torch.full((3,), 0.5))


def test_top_p_strategy_runs_on_the_kernel_where_top_k_does_not_bound_it(in_force, monkeypatch):
    """``TopPStrategy`` on the CPU plugin's kernel (rows without a top-k bound) keeps what it keeps on
    PyTorch's sort for rows whose boundary is clear; greedy rows and top_p 1 rows untouched."""
    from astrai.sampling import SamplingParams
    from astrai.sampling import top_p as top_p_module
    from astrai.sampling.batch import SamplingBatch
    from astrai.sampling.top_p import TopPStrategy

    assert "top_p" in in_force
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 40_000, generator=gen) * torch.tensor([[4.0], [1.0], [2.0], [8.0], [3.0]])
    params = [
        SamplingParams(top_p=p, temperature=t) for p, t in [(0.9, 1), (0.5, 1), (1.0, 1), (0.8, 0), (0.95, 1)]
    ]
    batch = SamplingBatch.from_params(params, [0] * 5, "cpu")
    got = TopPStrategy().apply(logits.clone(), batch)
    with monkeypatch.context() as m:
        m.setattr(top_p_module, "kernel_for", lambda op, x: None)
        want = TopPStrategy().apply(logits.clone(), batch)
    assert torch.equal(got, want)
    assert torch.equal(got[2], logits[2]) and torch.equal(got[3], logits[3])
    assert 256 < int(torch.isfinite(got[1]).sum()) < 40_000  # past PyTorch's first 256 candidates
