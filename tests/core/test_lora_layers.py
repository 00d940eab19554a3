"""LoRA on torch_native alone (no backend lends a ``lora`` kernel: ``lora_reference`` runs), on the
tiny model: an adapter's requests give the greedy tokens of the model with the adapter merged into
its weights, beside requests of the base model in the same steps; a step without adapter rows
leaves every projection's output as the base model's, bit for bit."""

from __future__ import annotations

import copy
import json

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _write_peft(folder, cfg, rank: int = 4, alpha: float = 8.0, seed: int = 7) -> None:
    """A PEFT folder for the tiny model, HF names and HF row order (the reader permutes q/k rows)."""
    from safetensors.torch import save_file

    shapes = {
        "self_attn.q_proj": (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size),
        "self_attn.k_proj": (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size),
        "self_attn.v_proj": (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size),
        "self_attn.o_proj": (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim),
        "mlp.gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "mlp.up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "mlp.down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (out, inp) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / rank**0.5
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": TARGETS})
    )
    save_file(tensors, folder / "adapter_model.safetensors")


def _merged(model, adapter) -> torch.nn.Module:
    """``model`` with each of the adapter's updates added into its weights (its own projections,
    wrapped for LoRA only to find each HF module's rows; no step binds adapter rows on it)."""
    from astrai.lora import install_lora

    merged = copy.deepcopy(model)
    targets = install_lora(merged, 1).targets
    with torch.no_grad():
        for name, (a, b) in adapter.modules.items():
            mod, o0, o1 = targets[name]
            mod.base.weight[o0:o1] += b @ a
    return merged


def test_adapter_rows_equal_the_merged_model_and_base_rows_the_base(
    tiny_model, tiny_tokenizer, make_engine, kernel_registry, reference, tmp_path
):
    from astrai.lora import read_adapter

    kernel_registry()  # torch_native alone: the LoRA updates run on lora_reference
    model = copy.deepcopy(tiny_model)
    engine = make_engine(model, tiny_tokenizer, enable_lora=True, max_loras=2, page_size=4, n_tokens=512)
    _write_peft(tmp_path / "t", tiny_model.config)
    engine.loras.load("t", tmp_path / "t")
    adapter = read_adapter("t", tmp_path / "t", tiny_model.config, model.lora.shapes, 64)
    merged = _merged(tiny_model, adapter)
    prompts = [
        tiny_tokenizer.encode(t) for t in ("hello adapters", "a longer prompt for the base model rows")
    ]
    params = engine._params({"max_tokens": 12, "temperature": 0, "ignore_eos": True})
    results = [engine.submit(prompts[0], params, lora="t"), engine.submit(prompts[1], params)]
    results.append(engine.submit(prompts[1], params, lora="t"))
    for r in results:
        assert r.wait_completion(60) and r.error is None
    assert results[0].output_ids == reference(merged, prompts[0], 12)
    assert results[1].output_ids == reference(tiny_model, prompts[1], 12)
    assert results[2].output_ids == reference(merged, prompts[1], 12)
    assert results[2].output_ids != results[1].output_ids  # the adapter changes the text


def test_the_wrappers_stand_in_only_during_steps_with_adapter_rows(tiny_model):
    from astrai.lora import LoraLinear, install_lora

    model = copy.deepcopy(tiny_model)
    own = {name: mod for name, mod in model.named_modules()}
    lora = install_lora(model, 2)
    assert dict(model.named_modules()) == own  # the model as it was: a base step pays nothing
    lora.bind([-1, -1], [2, 3])  # rows of the base model only
    assert lora.rows is None and dict(model.named_modules()) == own
    lora.bind([-1, 1], [2, 3])
    wrapped = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(wrapped) == 7 * tiny_model.config.num_hidden_layers  # unfused: each projection
    assert lora.rows.tolist() == [-1, -1, 1, 1, 1] and lora.compact.tolist() == [-1, -1, 0, 0, 0]
    lora.clear()  # after the step the wrappers stay, running their projections alone
    assert lora.rows is None and all(m.lora.rows is None for m in wrapped)
    assert any(isinstance(m, LoraLinear) for m in model.modules())
    lora.bind([-1], [4])  # until a step without adapter rows
    assert dict(model.named_modules()) == own
