"""Random LoRA adapters for the default model, written by peft, and peft as their oracle.

``make_adapters(hf_model, folder)`` writes one PEFT folder per ``SPECS`` entry (its ranks, alphas,
rsLoRA, per-module alpha, target sets) and returns an ``Oracle``: the same adapters on a copy of
transformers' model (the caller's is left as it was), whose ``greedy(name, ids, n)`` gives peft's
greedy tokens and their log-probs (``name`` None: the base model). ``write_gguf_lora`` writes an
adapter's weights as llama.cpp's ``convert_lora_to_gguf.py`` writes them.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: the prompt the LoRA tests compare on, and the greedy tokens compared (the oracle's results are
#: kept: the engine's tests and the server's ask the same)
PROMPT = (
    "The old lighthouse keeper climbed the stairs every evening and looked out over the grey sea, "
    "counting the ships that passed"
)
N = 32

#: name -> LoraConfig keywords (B scaled by ``boost`` after peft's random init, so that each adapter
#: changes what the model says). A and B are then rounded to float16 values and every scaling is a
#: power of two, so that ``--lora-dtype auto`` (float16 on the GGUF default model) holds the
#: adapters exactly and peft in float32 stays their oracle to the last bit of the kernels' sums.
SPECS = {
    "a1": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "boost": 6.0},
    "a2": {
        "r": 16,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "boost": 8.0,
    },
    "a3": {
        "r": 4,
        "lora_alpha": 32,
        "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj"],
        "alpha_pattern": {"up_proj": 4},
        "boost": 4.0,
    },
}


@dataclass
class Oracle:
    model: object  # a peft PeftModel holding every adapter
    folders: dict[str, Path]
    done: dict = field(default_factory=dict)  # (name, ids, n) -> greedy's result

    @torch.no_grad()
    def greedy(self, name: str | None, ids: list[int], n: int) -> tuple[list[int], list[float], float]:
        """peft's greedy ``n`` tokens after ``ids`` on adapter ``name``, their log-probs, and the
        smallest top-1 margin (logits) along the way."""
        key = (name, tuple(ids), n)
        if key not in self.done:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.done[key] = self._greedy(self.model, name, ids, n)
        return self.done[key]

    @staticmethod
    def _greedy(model, name: str | None, ids: list[int], n: int) -> tuple[list[int], list[float], float]:
        if name is None:
            with model.disable_adapter():
                return _greedy(model, ids, n)
        model.set_adapter(name)
        return _greedy(model, ids, n)


def _greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float], float]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        output_logits=True,  # raw: min_new_tokens bans EOS in the processed scores
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs, margin = [], float("inf")
    for step, token in zip(out.logits, tokens, strict=True):
        logits = step[0].float()
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        top = logits.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
    return tokens, logprobs, margin


def make_adapters(hf_model, folder: Path, specs: dict | None = None, seed: int = 0) -> Oracle:
    import peft

    specs = SPECS if specs is None else specs
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return _make(peft, copy.deepcopy(hf_model), folder, specs, seed)


def _make(peft, base, folder: Path, specs: dict, seed: int) -> Oracle:
    torch.manual_seed(seed)
    model, folders = None, {}
    for name, spec in specs.items():
        spec = dict(spec)
        boost = spec.pop("boost", 1.0)
        config = peft.LoraConfig(init_lora_weights=False, **spec)
        if model is None:
            model = peft.get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        with torch.no_grad():
            for key, p in model.named_parameters():
                if f"lora_B.{name}." in key:
                    p.mul_(boost)
                if f"lora_A.{name}." in key or f"lora_B.{name}." in key:
                    p.copy_(p.half().float())  # float16 values: see SPECS
        out = folder / name
        model.save_pretrained(out, selected_adapters=[name], save_embedding_layers=False)
        config_file = next(out.rglob("adapter_config.json"))
        folders[name] = config_file.parent
    model.eval()
    return Oracle(model, folders)


def lora_weights(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(folder / "adapter_model.safetensors")


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): HF's rotate-half rows to its own."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf_lora(folder: Path, path: Path, n_head: int, n_kv_head: int) -> Path:
    """``folder``'s PEFT adapter (one alpha, no per-module patterns) as llama.cpp's GGUF LoRA file of
    a ``llama`` model: ``blk.N.<kind>.weight.lora_a``/``lora_b``, q/k B rows permuted as its
    converter permutes them, ``adapter.lora.alpha``."""
    import gguf

    config, tensors = lora_weights(folder)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, t in sorted(tensors.items()):
        module = key.removeprefix("base_model.model.model.layers.")
        layer, _, rest = module.partition(".")
        part, _, ab = rest.rpartition(".lora_")
        kind = _GGUF_NAMES[part]
        t = t.float()
        if ab.startswith("B") and kind in ("attn_q", "attn_k"):
            t = _llama_permute(t, n_head if kind == "attn_q" else n_kv_head)
        suffix = "lora_a" if ab.startswith("A") else "lora_b"
        writer.add_tensor(f"blk.{layer}.{kind}.weight.{suffix}", t.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
