"""``SparseMoE`` (``astrai.model.moe``) on its own: the layer of transformers' Qwen3-MoE and Mixtral
blocks, experts that no token chose never run, a row gets its own experts whatever rows come with it,
and the tensor-parallel split of its experts sums back to the whole layer. (The families' logits and
greedy tokens against transformers are ``test_families``'.)"""

from __future__ import annotations

import pytest
import torch

from astrai.distributed.sharding import shard_config, shard_weights
from astrai.model.config import ModelConfig
from astrai.model.moe import SparseMoE
from astrai.model.quant import TILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HIDDEN, INTER, EXPERTS, SHARED = 32, 24, 6, 40


def _pair(family: str):
    """(transformers' sparse block with random weights, astrai's layer holding the same)."""
    import transformers as tf

    torch.manual_seed(5)
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    elif family == "qwen2_moe":  # with a shared expert
        config = tf.Qwen2MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            shared_expert_intermediate_size=SHARED,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
        )
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
    else:
        config = tf.MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2
        )
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    block = Block(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    shared = SHARED if family == "qwen2_moe" else 0
    ours = SparseMoE(HIDDEN, INTER, EXPERTS, 2, norm_topk=family == "mixtral", shared=shared)
    with torch.no_grad():
        if shared:
            ours.shared_expert.load_state_dict(block.shared_expert.state_dict())
            ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        ours.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(ours.experts):
            gate, up = block.experts.gate_up_proj[e].chunk(2)
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
    return block, ours


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_layer_is_transformers_block(family: str) -> None:
    block, ours = _pair(family)
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        want = block(x.unsqueeze(0))
        want = (want[0] if isinstance(want, tuple) else want)[0]
        torch.testing.assert_close(ours(x), want, atol=1e-6, rtol=1e-5)
        ours.fuse()  # gate and up in one GEMM per expert
        torch.testing.assert_close(ours(x), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routing_ties_break_as_transformers_breaks_them(family: str) -> None:
    """Experts 2 and 4 share a router row, so every token's second choice is an exact tie between them
    (and 1 and 3 tie for last): the expert chosen, its weight and the layer's output are transformers'."""
    block, ours = _pair(family)
    v = torch.randn(HIDDEN)
    rows = torch.stack([a * v for a in (2.0, -1.0, 1.0, -1.0, 1.0, 0.0)])
    with torch.no_grad():
        block.gate.weight.copy_(rows)
        ours.gate.weight.copy_(rows)
    x = torch.randn(24, HIDDEN)
    x = x * (x @ v).sign().unsqueeze(1)  # v . x > 0: expert 0 first, then the tie of 2 and 4
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(x)
        weights, ids = ours.route(x)
        assert torch.equal(want_ids[:, 0], torch.zeros(24, dtype=torch.long))
        assert set(want_ids[:, 1].tolist()) <= {2, 4}
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        want = block(x.unsqueeze(0))
        want = (want[0] if isinstance(want, tuple) else want)[0]
        torch.testing.assert_close(ours(x), want, atol=1e-6, rtol=1e-5)


def test_experts_no_token_chose_never_run() -> None:
    _, ours = _pair("mixtral")
    ran: list[int] = []
    for e, expert in enumerate(ours.experts):
        expert.register_forward_hook(lambda *_, e=e: ran.append(e))
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        _, ids = ours.route(x)
        ours(x)
    assert sorted(ran) == sorted(ids[0].tolist())  # one token: its two experts, once each


def test_a_row_gets_its_own_experts_in_any_batch() -> None:
    """Grouped by expert, a row's output is what it gets alone (to torch's GEMM rounding, which
    differs with the rows an expert runs: the dense float path is not batch invariant)."""
    _, ours = _pair("qwen3_moe")
    x = torch.randn(16, HIDDEN)
    with torch.no_grad():
        whole = ours(x)
        alone = torch.cat([ours(x[i : i + 1]) for i in range(16)])
    torch.testing.assert_close(whole, alone, atol=1e-6, rtol=1e-6)


def test_a_two_way_split_of_the_experts_sums_to_the_layer() -> None:
    """Each rank holds every expert's half (``shard_weights``: gate/up rows, down columns, the router
    whole); the ranks' outputs summed (the all-reduce) are the layer's."""
    _, ours = _pair("qwen3_moe")
    config = ModelConfig(
        "qwen3_moe",
        64,
        HIDDEN,
        48,
        1,
        4,
        2,
        8,
        64,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=INTER,
        norm_topk_prob=False,
    )
    weights = {f"model.layers.0.mlp.{k}": v for k, v in ours.state_dict().items()}
    weights["model.embed_tokens.weight"] = torch.zeros(64, HIDDEN)
    half = shard_config(config, 2)
    assert half.moe_intermediate_size == INTER // 2
    x = torch.randn(9, HIDDEN)
    total = torch.zeros(9, HIDDEN)
    for rank in range(2):
        shard = shard_weights(weights, config, 2, rank)
        part = SparseMoE(HIDDEN, INTER // 2, EXPERTS, 2, norm_topk=False)
        part.load_state_dict(
            {k.removeprefix("model.layers.0.mlp."): v for k, v in shard.items() if ".mlp." in k}
        )
        with torch.no_grad():
            total += part(x)
    with torch.no_grad():
        torch.testing.assert_close(total, ours(x), atol=1e-6, rtol=1e-5)


def test_dense_layers_among_sparse_ones_as_the_config_says(tmp_path) -> None:
    """Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``: the model's dense layers are
    where transformers' are, and the logits of such a checkpoint equal transformers'."""
    import transformers as tf
    from families import SIZES, forward_all, load_astrai

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = tf.Qwen3MoeConfig(
        **SIZES, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], **moe
    )
    hf = tf.Qwen3MoeForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model = load_astrai(tmp_path)
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [False, True, False, False]
    ids = list(range(2, 40))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(forward_all(model, ids, [len(ids)]), want, atol=1e-4, rtol=1e-4)


def test_quantized_experts_give_a_row_the_same_bits_in_any_batch(family_gguf) -> None:
    """Experts kept in Q8_0 blocks run on the kernel's quant_linear (astrai-backend-cpu's where this
    CPU has one, else the reference), whose rows do not depend on their batch: routed the same, a
    row's output is the same bits alone and among others, whichever experts the others chose. (The
    router is a dense float GEMM, as batch-dependent as the model's other dense linears on a CPU
    without astrai-backend-cpu's packed kernel.)"""
    from families import load_astrai

    from astrai.extension.backend.policy import get_registry

    get_registry()  # the installed kernels, as a served model has them
    path, _ = family_gguf("qwen3_moe", "Q8_0")
    layer = load_astrai(path, quantized=True).model.layers[0].mlp
    assert isinstance(layer, SparseMoE)
    x = torch.randn(12, layer.gate.in_features)
    with torch.no_grad():
        weights, ids = layer.route(x)

        def run(rows: slice) -> torch.Tensor:
            layer.route = lambda _: (weights[rows], ids[rows])
            return layer(x[rows])

        whole = run(slice(0, 12))
        alone = torch.cat([run(slice(i, i + 1)) for i in range(12)])
        pairs = torch.cat([run(slice(i, i + 2)) for i in range(0, 12, 2)])
    assert torch.equal(whole, alone) and torch.equal(whole, pairs)


@pytest.fixture
def loaded_backends():
    """The installed backends' kernels loaded, as an engine loads them when it starts (a fresh
    registry before and after)."""
    from astrai.extension.backend.policy import get_registry, load_backends, reset_registry

    reset_registry()
    get_registry()
    load_backends()
    yield
    reset_registry()


def test_the_grouped_kernel_gives_the_per_expert_loops_bits(family_gguf, loaded_backends) -> None:
    """Where a kernel lends ``quant_experts`` (astrai-backend-cpu), the quantized experts of a step run
    in two calls; the layer's output is the same bits as one ``quant_linear`` per expert, for a
    decode-sized step (experts as the parallel work) and a prefill-sized one (each in turn)."""
    from families import load_astrai

    from astrai.extension.backend.policy import get_registry
    from astrai.extension.fused import kernel_for

    get_registry()
    path, _ = family_gguf("qwen3_moe", "Q8_0")
    layer = load_astrai(path, quantized=True).model.layers[0].mlp
    with torch.no_grad():
        lent = kernel_for("quant_experts", torch.zeros(1, 1))
    if lent is None:
        pytest.skip("no installed kernel lends quant_experts on this machine (astrai-backend-cpu builds it)")
    assert layer._grouped() is not None
    for rows in (1, 3, 40):
        x = torch.randn(rows, layer.gate.in_features)
        with torch.inference_mode():  # as the model runs (the kernel's threads take the mode too)
            grouped = layer(x)
            layer._packed = None  # the per-expert loop
            looped = layer(x)
            del layer._packed
        assert torch.equal(grouped, looped), rows


def test_int8_activations_narrow_a_layers_experts_all_alike(
    family_gguf, loaded_backends, monkeypatch
) -> None:
    """Experts kept in Q5_0 blocks (codes the loader widens to int8): switched to int8 activations
    where the kernel reads 5-bit codes (astrai-backend-cpu on AVX512-VNNI), every expert of a layer
    is narrowed and the layer keeps its grouped kernel, the same bits as on the int8 codes; where
    one expert's codes do not fit 5 bits, none of that layer's experts is narrowed."""
    from families import load_astrai

    from astrai.extension.fused import kernel_for
    from astrai.model import activations

    path, _ = family_gguf("qwen3_moe", "Q5_0")
    narrowed, wide, mixed = (load_astrai(path, quantized=True).model for _ in range(3))
    with torch.no_grad():
        kernel = kernel_for("quant_linear", torch.zeros(1, 1))
    if "narrow_codes" not in getattr(kernel, "features", ()):
        pytest.skip("no installed quant_linear reads 5-bit codes here (astrai-backend-cpu on AVX512-VNNI)")
    activations.use_int8_activations(narrowed)
    first = mixed.layers[0].mlp.experts[0].gate_up_proj
    first.packed0[TILE * 2] = 100  # one code of expert 0 (past the record's 16 float16 scales): not 5 bits
    activations.use_int8_activations(mixed)
    monkeypatch.setattr(activations, "_narrow", lambda *a: None)
    activations.use_int8_activations(wide)
    for model, bits in ((narrowed, {5}), (wide, {8})):
        layer = model.layers[0].mlp
        assert {e.gate_up_proj.layouts[0].spec.bits for e in layer.experts} == bits
        assert {e.down_proj.layouts[0].spec.bits for e in layer.experts} == bits
    assert {e.gate_up_proj.layouts[0].spec.bits for e in mixed.layers[0].mlp.experts} == {8}
    assert {e.down_proj.layouts[0].spec.bits for e in mixed.layers[0].mlp.experts} == {5}
    for model in (narrowed, mixed):
        assert all(
            layer.mlp._grouped() is not None for layer in model.layers if isinstance(layer.mlp, SparseMoE)
        )
    for rows in (1, 3, 40):
        x = torch.randn(rows, first.in_features, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            assert torch.equal(narrowed.layers[0].mlp(x), wide.layers[0].mlp(x)), rows
