"""LoRA adapters read from their files: PEFT folders and llama.cpp's GGUF LoRA files.

An adapter's update of a linear is ``scale * B @ A`` (``A``: ``[rank, in]``, ``B``: ``[out, rank]``);
``read_adapter`` returns it per projection of the base model, by HF's unfused name
(``model.layers.3.self_attn.q_proj``), in float32 with the scale folded into ``B`` and ``B``'s
rows in the layout the base model holds (q/k rows in interleaved RoPE order, as the loaders put
the base weights: ``astrai.model.layout``). Everything is checked against the base model's
projections before anything is kept: an adapter that does not fit raises ``AdapterError`` naming
the problem.

PEFT: ``adapter_config.json`` (``peft_type`` LORA; ``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern``/``alpha_pattern``) and ``adapter_model.safetensors``. DoRA, biases, trained
embeddings or LM heads (``modules_to_save``, ``lora_embedding_*``) are refused. GGUF (llama.cpp's
``convert_lora_to_gguf.py``): ``general.type`` "adapter", ``adapter.type`` "lora",
``adapter.lora.alpha``, tensors ``<base tensor>.lora_a`` / ``.lora_b`` (the scale is
``alpha / rank``, or 1 when alpha is 0, as llama.cpp reads it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from astrai.errors import AdapterError
from astrai.model.layout import fused_parts, to_rope_layout, unfuse

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig

__all__ = ["LoraAdapter", "read_adapter", "resolve_adapter"]

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoraAdapter:
    """One adapter as read: ``modules[name] = (A [rank, in], scale * B [out, rank])``, float32."""

    name: str
    path: str
    rank: int  # the largest of its projections' ranks
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    base_model: str | None = None  # what the adapter says it was trained on, when it says

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.modules.values())


def read_adapter(
    name: str, path: str | Path, config: ModelConfig, shapes: Mapping[str, tuple[int, int]], max_rank: int
) -> LoraAdapter:
    """The adapter at ``path`` (a PEFT folder, its ``adapter_config.json``, or a GGUF file) for a base
    model of ``config`` whose LoRA-capable projections are ``shapes`` (HF module name -> ``(out,
    in)``). Raises AdapterError: no such path, not a LoRA, a rank over ``max_rank``, a target the
    base model has not, shapes of another base."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == "adapter_config.json":
        p = p.parent
    if p.is_dir():
        if not (p / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a LoRA adapter: it has no adapter_config.json")
        cfg, raw = _read_peft(p, config)
        base, permute = cfg.get("base_model_name_or_path"), True
    elif p.is_file() and p.suffix == ".gguf":
        raw, base = _read_gguf(p, config)
        from astrai.model.architecture import get_architecture

        permute = not get_architecture(config.architecture).gguf_rope_interleaved
    elif p.exists():
        raise AdapterError(f"{path} is not a LoRA adapter: neither a PEFT folder nor a .gguf file")
    else:
        raise AdapterError(f"no LoRA adapter at {path}: the path does not exist")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    parts = fused_parts(config)
    for module, (a, b, scale) in sorted(raw.items()):
        for part, rows in unfuse(f"{module}.weight", b.shape[0], parts) or [(f"{module}.weight", None)]:
            target = part.removesuffix(".weight")
            piece = b if rows is None else b[rows]
            _check_shape(target, a, piece, shapes, name)
            piece = piece.float() * scale
            if permute:
                piece = to_rope_layout(part, piece, config)
            modules[target] = (a.float().contiguous(), piece.contiguous())
    if not modules:
        raise AdapterError(f"{path} holds no LoRA weights")
    rank = max(a.shape[0] for a, _ in modules.values())
    if rank > max_rank:
        raise AdapterError(
            f"adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}; "
            "start the server with a larger --max-lora-rank"
        )
    return LoraAdapter(name, str(path), rank, modules, base)


def resolve_adapter(path: str, revision: str | None = None) -> str:
    """A local path as it is; a Hub id (``org/name``) to its snapshot's folder (the adapter's files:
    ``adapter_config.json``, ``adapter_model.safetensors``, ``*.gguf``), from huggingface_hub's
    cache first, else downloaded (unless ``HF_HUB_OFFLINE``). Raises AdapterError when neither."""
    from astrai.model.hub import parse_hub_id

    parsed = None if Path(path).expanduser().exists() else parse_hub_id(path)
    if parsed is None:
        return path
    from huggingface_hub import snapshot_download

    patterns = ["adapter_config.json", "adapter_model.safetensors", "*.gguf"]
    try:
        return snapshot_download(parsed[0], revision=revision, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(parsed[0], revision=revision, allow_patterns=patterns)
    except Exception as exc:
        raise AdapterError(
            f"no LoRA adapter at {path}: not a local path, and not on the Hub ({exc})"
        ) from exc


def _check_shape(
    target: str, a: torch.Tensor, b: torch.Tensor, shapes: Mapping[str, tuple[int, int]], name: str
) -> None:
    if target not in shapes:
        kind = target.rsplit(".", 1)[-1]
        raise AdapterError(
            f"adapter {name!r} targets {target} ({kind}), which the base model has not "
            f"(LoRA applies to {', '.join(sorted({k.rsplit('.', 1)[-1] for k in shapes}))})"
        )
    out, inp = shapes[target]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"adapter {name!r}: {target}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not pair"
        )
    if a.shape[1] != inp or b.shape[0] != out:
        raise AdapterError(
            f"adapter {name!r} is for another base model: {target} is {out}x{inp} here, "
            f"the adapter's update is {b.shape[0]}x{a.shape[1]}"
        )


def _read_peft(
    folder: Path, config: ModelConfig
) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]:
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder}/adapter_config.json is not readable JSON: {exc}") from exc
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{folder} is not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "trained copies of whole modules")):
        if cfg.get(key):
            raise AdapterError(f"{folder}: {why} ({key}) is not supported, only plain LoRA")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{folder}: fan_in_fan_out (GPT-2's Conv1D) is not supported")
    tensors = _peft_tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if "lora_embedding" in key or "lora_magnitude" in key:
            raise AdapterError(f"{folder}: {key} trains an embedding or DoRA magnitude; not supported")
        m = _PEFT_KEY.match(key)
        if m is None:
            raise AdapterError(f"{folder}: unexpected tensor {key} in a LoRA adapter")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    from astrai.model.architecture import get_architecture

    arch = get_architecture(config.architecture)
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: {module} has lora_{'A' if 'B' in ab else 'B'} but not its pair")
        rank = ab["A"].shape[0]
        alpha = float(_pattern(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8)))
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        out[arch.checkpoint_name(f"{module}.weight").removesuffix(".weight")] = (ab["A"], ab["B"], scale)
    return cfg, out


def _pattern(patterns: Mapping[str, float] | None, module: str, default: float) -> float:
    """PEFT's per-module override: a key matching the module's name or its end."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(key, module) or re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _peft_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st, pt = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(st)
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise AdapterError(f"{folder}: the adapter's weights are not readable: {exc}") from exc
    raise AdapterError(f"{folder} has adapter_config.json but no adapter_model.safetensors")


def _read_gguf(
    path: Path, config: ModelConfig
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, float]], str | None]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from astrai.model.architecture import get_architecture

    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise AdapterError(f"{path} is not a readable GGUF file: {exc}") from exc

    def field_value(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field_value("general.type") != "adapter" or field_value("adapter.type") != "lora":
        raise AdapterError(f"{path} is a GGUF file but not a LoRA adapter (general.type, adapter.type)")
    arch = field_value("general.architecture")
    base = get_architecture(config.architecture)
    if arch not in (base.name, *base.aliases):
        raise AdapterError(f"{path} is a LoRA for architecture {arch!r}; the base model is {base.name!r}")
    alpha = float(field_value("adapter.lora.alpha") or 0.0)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        stem, _, kind = t.name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            raise AdapterError(f"{path}: unexpected tensor {t.name} in a LoRA file")
        values = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        found.setdefault(stem, {})[kind] = values.reshape([int(n) for n in reversed(t.shape)])
    out = {}
    for stem, ab in found.items():
        hf = base.hf_name(stem)
        if hf is None or set(ab) != {"lora_a", "lora_b"}:
            raise AdapterError(
                f"{path}: {stem} is not a projection of a {base.name} model, or lacks its pair"
            )
        rank = ab["lora_a"].shape[0]
        out[hf.removesuffix(".weight")] = (ab["lora_a"], ab["lora_b"], alpha / rank if alpha else 1.0)
    return out, field_value("general.base_model.0.repo_url")
