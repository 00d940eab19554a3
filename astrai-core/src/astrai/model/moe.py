"""``SparseMoE``: a mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks ``top_k`` of
``num_experts`` gated MLPs per token and sums their outputs weighted by the routing probabilities.

One router GEMM for the step's tokens; then the (token, choice) pairs are sorted by expert once, and
each expert that any token chose runs its gate/up/down on its own rows only (an expert no token chose
costs nothing), its outputs scaled by their weights and added back at their tokens. The loop is over
the experts a step uses, never over tokens. Routing follows transformers: softmax over all experts
in float32, the ``top_k`` largest, renormalised over those when ``norm_topk`` (Mixtral always;
Qwen3-MoE as its config says), the weights then rounded to the hidden states' dtype.

A shared expert (Qwen2-MoE), where the config has one, runs on every token beside the routed ones,
its output scaled by ``sigmoid(shared_expert_gate(x))`` and added to theirs.

Parameter names are the checkpoints': ``gate.weight`` (the router), ``experts.{e}.gate_proj``,
``up_proj``, ``down_proj`` (Mixtral's ``w1``/``w3``/``w2`` are renamed at load: ``Architecture``),
``shared_expert.*`` and ``shared_expert_gate.weight``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from astrai.extension.fused import kernel_for, silu_and_mul
from astrai.model.layers import GatedMLP
from astrai.model.quant import QuantizedLinear

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig

#: llama.cpp's mixture-of-experts tensors: the router, and every expert of a kind stacked in one
#: tensor (``{e}``: the GGUF loader enters each expert under its own name)
GGUF_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
#: llama.cpp's shared expert (Qwen2-MoE) and its gate
GGUF_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def moe_mlp(config: ModelConfig, layer_id: int) -> nn.Module | None:
    """Layer ``layer_id``'s mixture of experts, or None where the config keeps a dense MLP."""
    if not config.sparse(layer_id):
        return None
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size or config.intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        config.hidden_act,
        shared=config.shared_expert_intermediate_size,
    )


class SparseMoE(nn.Module):
    """``sum_k w_k * expert_k(x)`` over each token's ``top_k`` experts (plus the gated shared
    expert's output where ``shared`` gives it intermediate rows)."""

    #: the linears ``astrai.model.cpu_linear.prepack_linears`` leaves as ``nn.Linear`` (the router,
    #: ``gate``, is packed like the other linears: the whole-step kernel takes it packed)
    UNPACKED = ("shared_expert_gate",)

    reduce = None  # tensor parallel: the sum over ranks of the experts' partial outputs

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        act: str = "silu",
        shared: int = 0,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.shared_expert = GatedMLP(hidden, shared, act) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None

    def fuse(self) -> None:
        """Each expert's gate and up projections in one GEMM; after loading weights."""
        for expert in self.experts:
            expert.fuse()
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k] in x's dtype, expert ids [T, top_k])`` of the step's tokens."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forget_layouts(self) -> None:
        """Drop the grouped experts' layouts ``_grouped`` kept (their layouts changed)."""
        self._packed = False

    def _grouped(self) -> tuple[list, list[int], list, list[int]] | None:
        """The experts' packed gate_up and down weights and their layouts, when every expert holds
        its fused projections as one quantized block of the same layout (``quant_experts``)."""
        if getattr(self, "_packed", False) is not False:
            return self._packed
        self._packed = None
        parts = [(getattr(e, "gate_up_proj", None), e.down_proj) for e in self.experts]
        if all(isinstance(g, QuantizedLinear) and isinstance(d, QuantizedLinear) for g, d in parts):
            gate_up = [g.segments for g, _ in parts]
            down = [d.segments for _, d in parts]
            if all(len(s) == 1 and s[0][1] == gate_up[0][0][1] for s in gate_up) and all(
                len(s) == 1 and s[0][1] == down[0][0][1] for s in down
            ):
                self._packed = (
                    [s[0][0] for s in gate_up],
                    gate_up[0][0][1].ints(),
                    [s[0][0] for s in down],
                    down[0][0][1].ints(),
                )
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert, tokens in order
        rows_of = order // self.top_k
        scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        kernel = kernel_for("quant_experts", x)
        grouped = self._grouped() if kernel is not None and x.dtype in kernel.dtypes else None
        if grouped is not None:  # every chosen expert's projection in one call, no loop here
            gate_up, gate_up_layout, down, down_layout = grouped
            offsets = torch.zeros(self.num_experts + 1, dtype=torch.long)
            torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0, out=offsets[1:])
            h = kernel(x.index_select(0, rows_of), offsets, gate_up, gate_up_layout)
            first = self.experts[0]  # (as GatedMLP computes its activation)
            if first.act_name == "silu":
                h = silu_and_mul(h)
            else:
                gate, up = h.chunk(2, dim=-1)
                h = first.act(gate) * up
            y = kernel(h.contiguous(), offsets, down, down_layout) * scale
            out = torch.zeros_like(x).index_add_(0, rows_of, y)
        else:
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
            out = torch.zeros_like(x)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    rows = rows_of[start : start + n]
                    y = self.experts[e](x.index_select(0, rows)) * scale[start : start + n]
                    out.index_add_(0, rows, y)
                    start += n
        if self.shared_expert is not None:  # (its partial output, under tensor parallel: gated, then summed)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.reduce is None else self.reduce(out)
