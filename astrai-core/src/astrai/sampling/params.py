"""Sampling parameters of one request (host side) and of one step's batch (device tensors)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from itertools import chain
from typing import Any

import torch

from astrai.errors import RequestRejected

__all__ = ["SamplingParams", "SamplingBatch"]


def _real(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RequestRejected(f"{name} must be a finite number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise RequestRejected(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(name: str, value: Any, lo: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestRejected(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise RequestRejected(f"{name} must be >= {lo}, got {value!r}")
    return int(value)


def _token_id(key: Any) -> int:
    # JSON object keys are strings: OpenAI clients send {"50256": -100}.
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    return _integer("logit_bias token id", key, 0)


@dataclass
class SamplingParams:
    """How one request chooses its tokens. Validated on construction.

    ``None`` for a field with a non-``None`` default means that default (``stop``,
    ``logit_bias`` and ``extra`` become empty).

    Raises:
        RequestRejected: a value is out of range or of the wrong type (the message names it).
    """

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy (argmax of the penalised logits)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    stop: list[str] = field(default_factory=list)  # a single str is wrapped into a list
    seed: int | None = None  # None: fresh randomness every step
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    ignore_eos: bool = False
    strategy: str | None = None  # extra SamplingStrategy entry-point name (plugins, e.g. "min_p")
    extra: dict[str, Any] = field(default_factory=dict)  # parameters of plugin strategies

    def __post_init__(self) -> None:
        for f in fields(self):  # None (JSON null) means "use the default" for scalar fields
            if getattr(self, f.name) is None and f.default not in (MISSING, None):
                setattr(self, f.name, f.default)
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1)
        self.temperature = _real("temperature", self.temperature, 0.0, 2.0)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = _integer("top_k", self.top_k, 0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, None)
        self.stop = self._check_stop(self.stop)
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, dict):
            raise RequestRejected(
                f"logit_bias must be an object of token id -> bias, got {self.logit_bias!r}"
            )
        self.logit_bias = {
            _token_id(k): _real(f"logit_bias[{k!r}]", v, -100.0, 100.0) for k, v in self.logit_bias.items()
        }
        if not isinstance(self.ignore_eos, bool):
            raise RequestRejected(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.strategy is not None and (not isinstance(self.strategy, str) or not self.strategy):
            raise RequestRejected(f"strategy must be a non-empty string or null, got {self.strategy!r}")
        if self.extra is None:
            self.extra = {}
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise RequestRejected(f"extra must be an object with string keys, got {self.extra!r}")

    @staticmethod
    def _check_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestRejected(f"stop must be a non-empty string or a list of them, got {stop!r}")
        return list(stop)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first (no penalty, no logit bias, no plugin
        strategy): the token is the argmax of the model's logits, whatever the pipeline holds."""
        return (
            self.temperature == 0.0
            and not (self.frequency_penalty or self.presence_penalty or self.logit_bias)
            and self.strategy is None
        )


def _as_int64(seed: int) -> int:
    """Wrap any Python int into the signed 64-bit range (the hash uses all 64 bits)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(eq=False)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the model's device.

    Built once per step by :meth:`from_params`; read by every :class:`SamplingStrategy`.
    Row ``i`` describes request ``params[i]``. The ``needs_*`` / ``max_*`` summaries are
    host-side Python values, so strategies decide whether to run without a device sync;
    they consider sampled rows only (greedy rows ignore every filter).
    """

    params: tuple[SamplingParams, ...]
    temperature: torch.Tensor  # [B] f32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] f32; 1 = off
    seeds: torch.Tensor  # [B] int64; unseeded rows hold a fresh random seed for this step
    steps: torch.Tensor  # [B] int64; the noise counter of each row
    frequency_penalty: torch.Tensor  # [B] f32
    presence_penalty: torch.Tensor  # [B] f32
    greedy: torch.Tensor  # [B] bool
    bias_rows: torch.Tensor  # [N] int64: logit_bias entries flattened over rows
    bias_tokens: torch.Tensor  # [N] int64
    bias_values: torch.Tensor  # [N] f32
    output_ids: torch.Tensor | None  # [B, L] int64, -1 padded; generated ids of rows with penalties
    all_greedy: bool
    any_greedy: bool
    needs_temperature: bool  # some sampled row has temperature != 1
    max_top_k: int  # largest top_k among sampled rows (0: no row filters by top-k)
    needs_top_p: bool  # some sampled row has top_p < 1
    top_p_k_bound: int  # every sampled top-p row has 0 < top_k <= this; 0 when some has top_k == 0
    needs_penalties: bool
    has_logit_bias: bool
    _extra: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        """Number of rows ``B``."""
        return len(self.params)

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @property
    def strategies(self) -> tuple[str | None, ...]:
        """``SamplingParams.strategy`` of each row (host side)."""
        return tuple(p.strategy for p in self.params)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        device: torch.device | str = "cpu",
        output_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Build the batch tensors for one step.

        Args:
            params: one :class:`SamplingParams` per row.
            steps: per-row noise counter, e.g. the number of tokens the request has generated
                so far; a seeded request must use a new step for every token it draws.
            device: where the tensors go (the logits' device).
            output_ids: per-row generated token ids, needed by frequency/presence penalties
                (rows without penalties are not copied), or an int64 ``[B, L]`` tensor padded
                with -1. ``None``: penalties have nothing to count.

        Rows without a seed get a fresh seed drawn from torch's global CPU generator, so
        they stay random yet follow ``torch.manual_seed``. Raises ``ValueError`` when the
        lengths of ``params``, ``steps`` and ``output_ids`` disagree.
        """
        params = tuple(params)
        n = len(params)
        if len(steps) != n or (output_ids is not None and len(output_ids) != n):
            raise ValueError(
                f"{n} params, {len(steps)} steps and output_ids of length "
                f"{None if output_ids is None else len(output_ids)} do not match"
            )
        seeds = [0 if p.seed is None else _as_int64(p.seed) for p in params]
        ints = torch.tensor([[p.top_k for p in params], seeds, list(steps)], dtype=torch.int64)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            ints[1, unseeded] = torch.randint(0, 1 << 62, (len(unseeded),), dtype=torch.int64)
        floats = torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            dtype=torch.float32,
        )
        # One host-to-device copy per dtype instead of one per field.
        ints, floats = ints.to(device), floats.to(device)
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias.items()]
        bias_idx = torch.tensor([(i, t) for i, t, _ in bias], dtype=torch.int64).reshape(-1, 2).to(device)

        sampled = [p for p in params if not p.greedy]
        top_p_rows = [p for p in sampled if p.top_p < 1.0]
        needs_penalties = any(p.frequency_penalty or p.presence_penalty for p in params)
        return cls(
            params=params,
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            seeds=ints[1],
            steps=ints[2],
            frequency_penalty=floats[2],
            presence_penalty=floats[3],
            greedy=floats[0] == 0.0,
            bias_rows=bias_idx[:, 0],
            bias_tokens=bias_idx[:, 1],
            bias_values=torch.tensor([v for _, _, v in bias], dtype=torch.float32).to(device),
            output_ids=_pad_output_ids(params, output_ids, device) if needs_penalties else None,
            all_greedy=not sampled,
            any_greedy=len(sampled) < n,
            needs_temperature=any(p.temperature != 1.0 for p in sampled),
            max_top_k=max((p.top_k for p in sampled), default=0),
            needs_top_p=bool(top_p_rows),
            top_p_k_bound=0
            if any(p.top_k == 0 for p in top_p_rows)
            else max((p.top_k for p in top_p_rows), default=0),
            needs_penalties=needs_penalties,
            has_logit_bias=bool(bias),
        )

    def extra_tensor(
        self, key: str, default: float = 0.0, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Per-row plugin parameter ``params[i].extra.get(key, default)`` as a ``[B]`` tensor.

        Returns a ``dtype`` tensor on :attr:`device`, built once per batch and cached.
        Raises :class:`RequestRejected` when a row's value is not a number.
        """
        cache_key = (key, default, dtype)
        if cache_key not in self._extra:
            values = [p.extra.get(key, default) for p in self.params]
            for v in values:
                if not isinstance(v, numbers.Real):
                    raise RequestRejected(f"extra[{key!r}] must be a number, got {v!r}")
            self._extra[cache_key] = torch.tensor(values, dtype=dtype).to(self.device)
        return self._extra[cache_key]


def _pad_output_ids(
    params: tuple[SamplingParams, ...],
    output_ids: Sequence[Sequence[int]] | torch.Tensor | None,
    device: torch.device | str,
) -> torch.Tensor | None:
    """``[B, L]`` int64, -1 padded; only rows with a penalty carry their ids (the rest is pad)."""
    if output_ids is None:
        return None
    if isinstance(output_ids, torch.Tensor):
        return output_ids.to(device=device, dtype=torch.int64)
    rows = [
        list(ids) if p.frequency_penalty or p.presence_penalty else []
        for p, ids in zip(params, output_ids, strict=True)
    ]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    width = int(lengths.max()) if rows else 0
    padded = torch.full((len(rows), width), -1, dtype=torch.int64)
    # Flat copy: one tensor from all ids, placed by a mask (no per-row tensor building).
    padded[torch.arange(width) < lengths.unsqueeze(1)] = torch.tensor(
        list(chain.from_iterable(rows)), dtype=torch.int64
    )
    return padded.to(device)
