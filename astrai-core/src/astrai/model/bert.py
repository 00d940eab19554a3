"""BERT encoders (all-MiniLM, BGE and E5 base models, the cross-encoders built on them): learned
absolute positions and token types added to the word embeddings and normalised, then layers of
bidirectional attention and a GELU MLP, each followed by its residual add and LayerNorm (post-norm).

Parameter names are transformers' ``BertModel``'s (``embeddings.*``, ``encoder.layer.{i}.*``), so
that a checkpoint loads as it is. Sentence embeddings pool the token states themselves and leave the
``pooler`` out; a cross-encoder (``BertForSequenceClassification``: ``num_labels`` > 0) keeps it, the
first token's state through ``tanh(dense(.))``, and its ``classifier`` gives each input's logits.

A batch is a list of sequences of different lengths, packed: every linear runs on the packed tokens
only, and attention too where a backend lends the ``encoder_attention`` kernel (bf16), else on the
sequences padded in groups (``astrai.model.bert_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from astrai.errors import ModelFormatError
from astrai.model.bert_attention import Attend, attention

__all__ = ["BertConfig", "BertModel"]


@dataclass(frozen=True)
class BertConfig:
    """The encoder's shape, from its ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"
    num_labels: int = 0  # a classification head's outputs (a cross-encoder's); 0: none

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "") -> BertConfig:
        """Raises ModelFormatError for what this encoder does not compute (relative positions, an
        activation other than GELU)."""
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelFormatError(
                f"{where}: position_embedding_type {cfg['position_embedding_type']!r} is not supported"
            )
        act = cfg.get("hidden_act", "gelu")
        heads = [a for a in cfg.get("architectures") or [] if a.endswith("ForSequenceClassification")]
        labels = (len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))) if heads else 0
        if act not in _ACTIVATIONS:
            raise ModelFormatError(
                f"{where}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})"
            )
        try:
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=int(cfg["num_attention_heads"]),
                intermediate_size=int(cfg["intermediate_size"]),
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                hidden_act=act,
                num_labels=labels,
            )
        except KeyError as exc:
            raise ModelFormatError(f"{where}: config.json has no {exc.args[0]}") from None


_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class _Output(nn.Module):
    """``LayerNorm(dense(x) + residual)``."""

    def __init__(self, into: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(into, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def fuse(self) -> None:
        """The three projections as one GEMM (``qkv``); after loading the weights."""
        parts = (self.query, self.key, self.value)
        self.qkv = nn.Linear(parts[0].in_features, 3 * parts[0].out_features)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([p.weight for p in parts]))
            self.qkv.bias.copy_(torch.cat([p.bias for p in parts]))
        self.qkv.to(parts[0].weight.dtype)
        del self.query, self.key, self.value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 3H]: queries, keys and values side by side."""
        if hasattr(self, "qkv"):
            return self.qkv(x)
        return torch.cat([self.query(x), self.key(x), self.value(x)], dim=-1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.add_module("self", _SelfAttention(hidden))  # (transformers' name)
        self.output = _Output(hidden, hidden, eps)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inter)


class BertLayer(nn.Module):
    """``h = LN(x + attn(x))``, then ``LN(h + down(act(up(h))))``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = _Attention(h, eps)
        self.intermediate = _Intermediate(h, config.intermediate_size)
        self.output = _Output(config.intermediate_size, h, eps)
        self.heads = config.num_attention_heads
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``x`` [T, H] packed; ``attend`` its sequences' attention (``astrai.model.bert_attention``)."""
        h = self.attention.output(attend(self.attention.self(x), self.heads), x)
        return self.output(self.act(self.intermediate.dense(h)), h)


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class BertModel(nn.Module):
    """The encoder: token ids of a batch of sequences -> each token's last hidden state; with a
    classification head (``config.num_labels``), ``logits`` of each sequence."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        if config.num_labels:
            self.pooler = _Pooler(config.hidden_size)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        # checkpoint tensors it does not use (the pooler of an embedder, a buffer of position ids)
        self.unused = (
            ("embeddings.position_ids",) if config.num_labels else ("pooler.", "embeddings.position_ids")
        )

    def logits(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, num_labels] of ``forward``'s states: the classifier on each sequence's first token,
        pooled as transformers' ``BertPooler`` (dense, tanh)."""
        first = hidden.index_select(0, torch.cumsum(lengths, 0) - lengths)
        return self.classifier(torch.tanh(self.pooler.dense(first)))

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids`` [T] the sequences one after another, ``lengths`` [B] theirs (int64, each at
        least 1 and at most ``max_position_embeddings``), ``token_type_ids`` [T] (None: all 0) ->
        [T, hidden] packed like ``input_ids``."""
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(input_ids.shape[0]) - torch.repeat_interleave(starts, lengths)  # each from 0
        emb = self.embeddings
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = (
            emb.word_embeddings(input_ids)
            + emb.token_type_embeddings(types)
            + emb.position_embeddings(positions)
        )
        x = emb.LayerNorm(x)
        attend = attention(x, lengths)  # (once for every layer)
        for layer in self.encoder.layer:
            x = layer(x, attend)
        return x

    def load_weights(self, state: dict[str, torch.Tensor], where: str = "") -> None:
        """The checkpoint's tensors (transformers' names, an optional ``bert.`` prefix), the
        unused ones left out; raises ModelFormatError naming what is missing, unexpected or of
        another shape."""
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        state = {k: v for k, v in state.items() if not k.startswith(self.unused)}
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ModelFormatError(
                f"{where}: weights do not fit a BERT encoder: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        with torch.no_grad():
            for name, param in own.items():
                if state[name].shape != param.shape:
                    raise ModelFormatError(
                        f"{where}: {name} has shape {tuple(state[name].shape)}, the config says {tuple(param.shape)}"
                    )
                param.copy_(state[name])

    def fuse(self) -> None:
        """Each layer's q/k/v projections as one GEMM; after ``load_weights``."""
        for layer in self.encoder.layer:
            layer.attention.self.fuse()
