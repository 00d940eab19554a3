"""How a Llama-family model splits over ``n`` tensor-parallel ranks (Megatron's layout, as vLLM's).

- q/k/v and gate/up are split by output rows (query heads, KV heads, intermediate rows): column
  parallel, no communication;
- o_proj and down_proj are split by input columns: row parallel, their outputs summed over the
  ranks (an all-reduce after each, ``astrai.distributed.tp``);
- a mixture of experts splits every expert the same way (each expert's gate/up rows and down
  columns: tensor parallel inside the experts, the router replicated), so that each rank runs
  every chosen expert on its slice and one all-reduce sums the layer, as the dense MLP's;
- embeddings are replicated; the LM head is split by vocabulary rows (padded to a multiple of
  ``n``) and its logits gathered on rank 0;
- with more ranks than KV heads, each KV head is replicated over ``n / num_key_value_heads``
  ranks (rank ``r`` holds KV head ``r * kv // n``), as vLLM does.

Weights are sharded in astrai's state-dict layout (HF names, before ``fuse_projections``); the
rows of q and k are in llama.cpp's RoPE layout, which permutes within a head only, so a split at
head boundaries is the same in either layout.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from astrai.errors import RequestRejected
from astrai.model.config import ModelConfig

__all__ = ["TPConfigError", "check_tp_size", "shard_config", "shard_weights", "valid_tp_sizes", "vocab_shard"]

#: The largest tensor-parallel size ``valid_tp_sizes`` considers.
MAX_TP = 64


class TPConfigError(RequestRejected):
    """A tensor-parallel size the model cannot be split into (the message names the valid ones)."""


def _problem(config: ModelConfig, n: int) -> str | None:
    """Why ``config`` cannot be split over ``n`` ranks (None: it can)."""
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if n < 1:
        return "the size must be at least 1"
    if heads % n:
        return f"{heads} query heads do not divide into {n}"
    if n <= kv and kv % n:
        return f"{kv} KV heads do not divide into {n}"
    if n > kv and n % kv:
        return f"{n} ranks cannot share {kv} KV heads evenly (a multiple of {kv} is needed to replicate them)"
    if inter % n:
        return f"the MLP's {inter} intermediate rows do not divide into {n}"
    experts = config.moe_intermediate_size
    if config.num_experts and experts and experts % n:
        return f"each expert's {experts} intermediate rows do not divide into {n}"
    shared = config.shared_expert_intermediate_size
    if config.num_experts and shared % n:
        return f"the shared expert's {shared} intermediate rows do not divide into {n}"
    return None


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size up to ``MAX_TP`` that ``config`` splits into exactly."""
    return [n for n in range(1, MAX_TP + 1) if _problem(config, n) is None]


def check_tp_size(config: ModelConfig, n: int) -> None:
    """Raise TPConfigError when ``config`` cannot be split over ``n`` ranks, naming the valid sizes."""
    problem = _problem(config, n)
    if problem is not None:
        valid = ", ".join(map(str, valid_tp_sizes(config)))
        raise TPConfigError(
            f"tensor parallel size {n} cannot split {config.name or 'this model'}: {problem}; "
            f"valid sizes: {valid}"
        )


def shard_config(config: ModelConfig, n: int) -> ModelConfig:
    """The configuration of one rank's shard: its heads and intermediate rows (vocabulary and
    hidden size whole)."""
    check_tp_size(config, n)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=max(1, config.num_key_value_heads // n),
        intermediate_size=config.intermediate_size // n,
        moe_intermediate_size=config.moe_intermediate_size and config.moe_intermediate_size // n,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // n,
    )


def vocab_shard(vocab_size: int, n: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s LM-head rows: equal slices of the vocabulary padded to a
    multiple of ``n``."""
    per = math.ceil(vocab_size / n)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def _kv_rows(config: ModelConfig, n: int, rank: int) -> slice:
    kv, d = config.num_key_value_heads, config.head_dim
    if n <= kv:
        per = kv // n
        return slice(rank * per * d, (rank + 1) * per * d)
    head = rank * kv // n  # replicated: n / kv ranks hold each KV head
    return slice(head * d, (head + 1) * d)


def shard_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, n: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of ``weights`` (astrai's state dict, before fusion): contiguous copies.

    The LM head keeps its rows ``vocab_shard(...)`` (of the embeddings when they are tied), zero
    rows padding it to the shard's full size; every other tensor that is not split is shared.
    """
    check_tp_size(config, n)
    d, heads, inter = config.head_dim, config.num_attention_heads, config.intermediate_size
    q_rows = slice(rank * heads // n * d, (rank + 1) * heads // n * d)
    kv_rows = _kv_rows(config, n, rank)
    mlp_rows = slice(rank * inter // n, (rank + 1) * inter // n)
    expert = config.moe_intermediate_size or inter
    expert_rows = slice(rank * expert // n, (rank + 1) * expert // n)
    shared = config.shared_expert_intermediate_size
    shared_rows = slice(rank * shared // n, (rank + 1) * shared // n)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        rows = expert_rows if ".experts." in name else shared_rows if ".shared_expert." in name else mlp_rows
        if leaf == "q_proj":
            part = w[q_rows]
        elif leaf in ("k_proj", "v_proj"):
            part = w[kv_rows]
        elif leaf == "o_proj":
            part = w[:, q_rows]
        elif leaf in ("gate_proj", "up_proj"):
            part = w[rows]
        elif leaf == "down_proj":
            part = w[:, rows]
        else:
            part = w
        out[name] = part.contiguous() if part is not w else w
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    start, end = vocab_shard(config.vocab_size, n, rank)
    per = math.ceil(config.vocab_size / n)
    lm = head.new_zeros((per, head.shape[1]))
    lm[: end - start] = head[start:end]
    out["lm_head.weight"] = lm
    return out
