"""``SamplingBatch``: the sampling parameters of one step's rows, as tensors on the model's device."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch

from astrai.errors import RequestRejected

if TYPE_CHECKING:
    from astrai.sampling.params import SamplingParams

__all__ = ["SamplingBatch"]

_INT64_MAX = (1 << 63) - 1


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
    min_p: torch.Tensor  # [B] f32; 0 = off
    seeds: torch.Tensor  # [B] int64; unseeded rows hold a fresh random seed for this step
    steps: torch.Tensor  # [B] int64; the noise counter of each row
    frequency_penalty: torch.Tensor  # [B] f32
    presence_penalty: torch.Tensor  # [B] f32
    repetition_penalty: torch.Tensor  # [B] f32; 1 = off
    greedy: torch.Tensor  # [B] bool
    bias_rows: torch.Tensor  # [N] int64: logit_bias entries flattened over rows
    bias_tokens: torch.Tensor  # [N] int64
    bias_values: torch.Tensor  # [N] f32
    ban_rows: torch.Tensor  # [M] int64: banned (row, token) pairs flattened (min_tokens not reached)
    ban_tokens: torch.Tensor  # [M] int64
    output_ids: torch.Tensor | None  # [B, L] int64, -1 padded; generated ids of rows with penalties
    seen_ids: torch.Tensor | None  # [B, L'] int64, -1 padded; prompt + generated ids of repetition rows
    all_greedy: bool
    any_greedy: bool
    needs_temperature: bool  # some sampled row has temperature != 1
    max_top_k: int  # largest top_k among sampled rows (0: no row filters by top-k)
    needs_top_p: bool  # some sampled row has top_p < 1
    top_p_k_bound: int  # every sampled top-p row has 0 < top_k <= this; 0 when some has top_k == 0
    needs_min_p: bool  # some sampled row has min_p > 0
    needs_penalties: bool  # some row has a frequency or presence penalty
    needs_repetition: bool  # some row has repetition_penalty != 1
    has_logit_bias: bool
    has_bans: bool
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

    @property
    def changes_logits(self) -> bool:
        """Some row's logits change before the draw: penalties, logit bias or banned tokens."""
        return self.needs_penalties or self.needs_repetition or self.has_logit_bias or self.has_bans

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        device: torch.device | str = "cpu",
        output_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Build the batch tensors for one step.

        Args:
            params: one :class:`SamplingParams` per row.
            steps: per-row noise counter, e.g. the number of tokens the request has generated
                so far; a seeded request must use a new step for every token it draws.
            device: where the tensors go (the logits' device).
            output_ids: per-row generated token ids, needed by frequency/presence/repetition
                penalties (rows without them are not copied), or an int64 ``[B, L]`` tensor
                padded with -1. ``None``: penalties have nothing to count.
            prompt_ids: per-row prompt ids, read by repetition penalties (which cover prompt
                and output, as in Hugging Face and vLLM). ``None``: only the output counts.
            banned: per-row token ids that must not be sampled this step (EOS and
                ``stop_token_ids`` before ``min_tokens``). ``None``: none.

        Rows without a seed get a fresh seed drawn from torch's global CPU generator, so
        they stay random yet follow ``torch.manual_seed``. Raises ``ValueError`` when the
        lengths of ``params``, ``steps``, ``output_ids``, ``prompt_ids`` and ``banned`` disagree.
        """
        params = tuple(params)
        n = len(params)
        lengths = [len(x) for x in (steps, output_ids, prompt_ids, banned) if x is not None]
        if any(k != n for k in lengths):
            raise ValueError(f"{n} params but per-row inputs of lengths {lengths}")
        seeds = [0 if p.seed is None else _as_int64(p.seed) for p in params]
        # top_k is bounded by the vocabulary at submit; the cap only keeps a direct caller's huge value
        # (any k >= V keeps the row whole) inside int64.
        ints = torch.tensor(
            [[min(p.top_k, _INT64_MAX) for p in params], seeds, list(steps)], dtype=torch.int64
        )
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            ints[1, unseeded] = torch.randint(0, 1 << 62, (len(unseeded),), dtype=torch.int64)
        floats = torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in params],
            ],
            dtype=torch.float32,
        )
        # One host-to-device copy per dtype instead of one per field.
        ints, floats = ints.to(device), floats.to(device)
        bias_rows, bias_tokens, bias_values = _bias(params, device)
        bans = [(i, t) for i, row in enumerate(banned or ()) for t in row]
        pairs = torch.tensor(bans, dtype=torch.int64).reshape(-1, 2).to(device)

        sampled = [p for p in params if not p.greedy]
        top_p_rows = [p for p in sampled if p.top_p < 1.0]
        counted = [bool(p.frequency_penalty or p.presence_penalty) for p in params]
        repetition = [p.repetition_penalty != 1.0 for p in params]
        seen = None
        if any(repetition) and not isinstance(output_ids, torch.Tensor):
            prompts, outputs = prompt_ids or [()] * n, output_ids or [()] * n
            seen = _pad(
                [
                    [*pr, *out] if rep else []
                    for rep, pr, out in zip(repetition, prompts, outputs, strict=True)
                ],
                device,
            )
        return cls(
            params=params,
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[4],
            seeds=ints[1],
            steps=ints[2],
            frequency_penalty=floats[2],
            presence_penalty=floats[3],
            repetition_penalty=floats[5],
            greedy=floats[0] == 0.0,
            bias_rows=bias_rows,
            bias_tokens=bias_tokens,
            bias_values=bias_values,
            ban_rows=pairs[:, 0],
            ban_tokens=pairs[:, 1],
            output_ids=_output_ids(counted, output_ids, device) if any(counted) else None,
            seen_ids=seen,
            all_greedy=not sampled,
            any_greedy=len(sampled) < n,
            needs_temperature=any(p.temperature != 1.0 for p in sampled),
            max_top_k=min(max((p.top_k for p in sampled), default=0), _INT64_MAX),
            needs_top_p=bool(top_p_rows),
            top_p_k_bound=0
            if any(p.top_k == 0 for p in top_p_rows)
            else max((p.top_k for p in top_p_rows), default=0),
            needs_min_p=any(p.min_p > 0.0 for p in sampled),
            needs_penalties=any(counted),
            needs_repetition=any(repetition),
            has_logit_bias=bias_rows.numel() > 0,
            has_bans=bool(bans),
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


def _bias(params: tuple[SamplingParams, ...], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Every row's ``logit_bias`` flattened: ``(rows, tokens, values)``, ``[N]`` each. A request's entries
    become tensors once (kept on its ``SamplingParams``), so a step costs a concatenation per row,
    not a Python loop over every entry of every row."""
    biased = [(i, _bias_of(p)) for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, torch.empty(0, dtype=torch.float32, device=device)
    counts = torch.tensor([len(t) for _, (t, _) in biased], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.tensor([i for i, _ in biased], dtype=torch.int64), counts)
    tokens = torch.cat([t for _, (t, _) in biased])
    values = torch.cat([v for _, (_, v) in biased])
    return rows.to(device), tokens.to(device), values.to(device)


def _bias_of(p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``p.logit_bias`` as host tensors ``(tokens int64, values f32)``, made at the first step that
    needs them."""
    cached = p.__dict__.get("_bias_tensors")
    if cached is None or cached[0] is not p.logit_bias:
        tensors = (
            torch.tensor(list(p.logit_bias), dtype=torch.int64),
            torch.tensor(list(p.logit_bias.values()), dtype=torch.float32),
        )
        cached = p.__dict__["_bias_tensors"] = (p.logit_bias, tensors)
    return cached[1]


def _output_ids(
    counted: list[bool], output_ids: Sequence[Sequence[int]] | torch.Tensor | None, device: torch.device | str
) -> torch.Tensor | None:
    """``[B, L]`` int64, -1 padded; only rows with a penalty carry their ids (the rest is pad)."""
    if output_ids is None:
        return None
    if isinstance(output_ids, torch.Tensor):
        return output_ids.to(device=device, dtype=torch.int64)
    return _pad([list(ids) if c else [] for c, ids in zip(counted, output_ids, strict=True)], device)


def _pad(rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Rows of ids as one ``[B, max len]`` int64 tensor padded with -1."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    width = int(lengths.max()) if rows else 0
    padded = torch.full((len(rows), width), -1, dtype=torch.int64)
    # Flat copy: one tensor from all ids, placed by a mask (no per-row tensor building).
    padded[torch.arange(width) < lengths.unsqueeze(1)] = torch.tensor(
        list(chain.from_iterable(rows)), dtype=torch.int64
    )
    return padded.to(device)
