"""LoRA in the model's step: ``LoraLinear`` wraps a projection, ``LoraSet`` holds the step's rows.

``install_lora(model, slots)`` wraps each of a decoder's LoRA-capable projections (the fused
``qkv_proj`` and ``gate_up_proj`` with their parts, ``o_proj``, ``down_proj``) once, at start; a
wrapper stands in for its projection from a step with adapter rows to the next step without. A
step's rows may belong to several adapters and to none: the base product runs once for all of
them, then the ``lora`` kernel (``astrai.extension``; ``lora_reference`` where no backend lends
one) adds each row's own adapter's update in place, the segmented ("punica") scheme. A step
without adapter rows runs the model exactly as it runs without LoRA.

An adapter lives in a slot: per projection, ``a``, ``b`` and ``spans``. ``A`` ``[parts * R, in]``
is each targeted part's A, zero-padded to the largest rank rounded up to a multiple of 4 (``R``);
``B`` ``[R, C]`` each part's scaled B, transposed, side by side, each part from a multiple of 16
columns (zeros between); ``spans`` ``[parts, 3]`` int64 ``(o0, o1, c0)``: the output columns each
part adds to and where its columns of ``B`` start. They are kept in blocks that a row's update reads
as a few long streams (a decode row reads every weight of its adapter once, so the read pattern is
its speed): ``a`` ``[parts * R / 4, ceil(in / 16), 4, 16]`` holds A's rows in groups of 4, each
group's columns 16 at a time with its 4 rows side by side, and ``b`` ``[C / 16, R, 16]`` holds B in
blocks of 16 columns, each block's ``R`` rows one after another (``plain_a`` and ``plain_b`` undo
them); a slot's blocks of every projection sit in one buffer on huge pages, in the model's order
(``astrai.hugepages``). Slots are written by ``LoraSet.put`` only while no step runs rows of that
slot (``astrai.lora.manager`` sees to it).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from astrai.extension.fused import kernel_for
from astrai.hugepages import packed_on_huge_pages

if TYPE_CHECKING:
    from astrai.lora.adapter import LoraAdapter

__all__ = ["LoraLinear", "LoraSet", "install_lora", "lora_dtype", "lora_reference", "plain_a", "plain_b"]

_EMPTY = torch.empty(0)


class LoraSet:
    """The model's LoRA state: its wrapped projections, by HF module name, and the step's rows."""

    def __init__(self, slots: int, dtype: torch.dtype = torch.float32) -> None:
        self.slots = slots
        self.dtype = dtype  # what the adapters' weights are kept in (the kernels widen them to float32)
        self.rows: torch.Tensor | None = None  # int32 [T]: each token's slot (-1: none); None: no rows
        self.present: list[int] = []  # the slots the step's rows use
        self._index: dict[int, torch.Tensor] = {}  # slot -> its rows, made when the reference asks
        # HF module name (``model.layers.3.self_attn.q_proj``) -> (its LoraLinear, o0, o1)
        self.targets: dict[str, tuple[LoraLinear, int, int]] = {}
        # (owner, attribute, LoraLinear): where each wrapper stands in for its projection during a
        # step with adapter rows; the model holds its own projections the rest of the time
        self.swaps: list[tuple[nn.Module, str, LoraLinear]] = []
        self._swapped = False
        self.version = 0  # counts ``put``s: a whole-stack kernel's weight lists (``stacked``) follow it
        self._stacked: tuple[tuple, tuple[list, list, list]] | None = None  # (version, layers): lists

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """HF module name -> ``(out, in)``: what an adapter may target (``read_adapter``)."""
        return {name: (o1 - o0, mod.in_features) for name, (mod, o0, o1) in self.targets.items()}

    def bind(self, slots: Sequence[int], q_lens: Sequence[int]) -> None:
        """The step's rows: ``slots[i]`` for row ``i``'s ``q_lens[i]`` tokens (-1: the base model)."""
        if all(s < 0 for s in slots):
            self.clear()
            self._swap(False)
            return
        self.present = sorted({s for s in slots if s >= 0})
        lens = torch.tensor(q_lens, dtype=torch.int64)
        self.rows = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32), lens)
        # the kernel gets the present slots' weights only: each token's index among them
        where = {s: i for i, s in enumerate(self.present)}
        compact = torch.tensor([where.get(s, -1) for s in slots], dtype=torch.int32)
        self.compact = torch.repeat_interleave(compact, lens)
        self._index = {}
        self._swap(True)

    def index(self, slot: int) -> torch.Tensor:
        """The step's rows of ``slot`` (int64), made once per step."""
        if slot not in self._index:
            self._index[slot] = (self.rows == slot).nonzero()[:, 0]
        return self._index[slot]

    def clear(self) -> None:
        """The step's rows dropped. The wrappers stay in place (alone, they run their projection) until
        a step without adapter rows (swapping 210 projections each step cost a SmolLM2 step 0.4 ms)."""
        self.rows, self.compact, self.present, self._index = None, None, [], {}

    def _swap(self, wrapped: bool) -> None:
        """Put the wrappers in the model (``wrapped``) or its own projections back: through the
        owners' ``_modules`` (a few microseconds for a whole model, where ``setattr`` takes a
        millisecond). A step without adapter rows runs the model as it is without LoRA."""
        if self._swapped != wrapped:
            for owner, attr, mod in self.swaps:
                owner._modules[attr] = mod if wrapped else mod.base
            self._swapped = wrapped

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[None]:
        """The model's own projections in place for the block (a step's wrappers back after it)."""
        was = self._swapped
        self._swap(False)
        try:
            yield
        finally:
            self._swap(was)

    def stacked(self, layers: Sequence[nn.Module]) -> tuple[torch.Tensor, int, list, list, list]:
        """The step's adapter rows for a whole-stack kernel: ``(rows, version, a, b, spans)``, each
        token's slot (int32, -1: none), the ``version`` of the weight lists and, for each layer's
        ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` in turn, every slot's ``a``,
        ``b`` and ``spans`` (empty where a projection has no wrapper, a mixture of experts' MLP, or
        the slot no update there). The lists are made once per ``put``: a kernel that keeps them
        (the CPU plugin's ``DecodeStack.set_lora``) takes them again when ``version`` moves."""
        key = (self.version, len(layers))
        if self._stacked is None or self._stacked[0] != key:
            wrappers = {(id(owner), attr): mod for owner, attr, mod in self.swaps}
            a, b, spans = [], [], []
            for layer in layers:
                for owner, attr in (
                    (layer.self_attn, "qkv_proj"),
                    (layer.self_attn, "o_proj"),
                    (layer.mlp, "gate_up_proj"),
                    (layer.mlp, "down_proj"),
                ):
                    mod = wrappers.get((id(owner), attr))
                    for slot in range(self.slots):
                        a.append(_EMPTY if mod is None else mod.a[slot])
                        b.append(_EMPTY if mod is None else mod.b[slot])
                        spans.append(_EMPTY.long() if mod is None else mod.spans[slot])
            self._stacked = (key, (a, b, spans))
        return (self.rows, self.version, *self._stacked[1])

    def put(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write ``adapter``'s weights into ``slot`` of every projection (None: empty the slot)."""
        self.version += 1
        by_module: dict[LoraLinear, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for name, (a, b) in (adapter.modules if adapter is not None else {}).items():
            mod, o0, o1 = self.targets[name]
            by_module.setdefault(mod, []).append((o0, o1, a, b))
        mods = list({id(m): m for m, _, _ in self.targets.values()}.values())  # the model's order
        for mod in mods:
            mod.set_slot(slot, by_module.get(mod, []))
        # the slot's blocks in one buffer on huge pages, in the order a row's step reads them
        lists = [w for mod in mods if mod.device.type == "cpu" for w in (mod.a, mod.b) if w[slot].numel()]
        for w, view in zip(lists, packed_on_huge_pages([w[slot] for w in lists]), strict=True):
            w[slot] = view


class LoraLinear(nn.Module):
    """A projection (``nn.Linear``, ``PackedLinear``, ``QuantizedLinear``) plus its rows' LoRA updates."""

    def __init__(self, base: nn.Module, lora: LoraSet) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora = lora
        held = next(itertools.chain(base.parameters(), base.buffers()), None)  # the adapters live beside it
        self.device = held.device if held is not None else torch.device("cpu")
        self.a: list[torch.Tensor] = [_EMPTY] * lora.slots
        self.b: list[torch.Tensor] = [_EMPTY] * lora.slots
        self.spans: list[torch.Tensor] = [_EMPTY.long()] * lora.slots

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def weight(self) -> torch.Tensor | None:
        return getattr(self.base, "weight", None)  # (a GGUF projection kept quantized has none)

    def set_slot(self, slot: int, parts: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        """``parts``: ``(o0, o1, A [r, in], B [o1 - o0, r])`` per targeted part (empty: no update)."""
        if not parts:
            self.a[slot], self.b[slot], self.spans[slot] = _EMPTY, _EMPTY, _EMPTY.long()
            return
        rank = -(-max(a.shape[0] for _, _, a, _ in parts) // 4) * 4
        widths = [-(-(o1 - o0) // 16) * 16 for o0, o1, _, _ in parts]
        kb = -(-self.in_features // 16)
        a_rows = torch.zeros(len(parts) * rank, kb * 16, device=self.device)
        b_cols = torch.zeros(rank, sum(widths), device=self.device)
        spans, c0 = [], 0
        for p, (o0, o1, a, b) in enumerate(sorted(parts, key=lambda part: part[0])):
            a_rows[p * rank : p * rank + a.shape[0], : self.in_features] = a
            b_cols[: b.shape[1], c0 : c0 + o1 - o0] = b.t()
            spans.append((o0, o1, c0))
            c0 += -(-(o1 - o0) // 16) * 16
        dtype = self.lora.dtype  # A and the scaled B rounded once to it, from float32
        self.a[slot] = a_rows.view(-1, 4, kb, 16).transpose(1, 2).contiguous().to(dtype)
        self.b[slot] = b_cols.view(rank, -1, 16).transpose(0, 1).contiguous().to(dtype)
        self.spans[slot] = torch.tensor(spans, dtype=torch.int64)  # (host values: the kernel reads them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.lora.rows is None:
            return y
        kernel = kernel_for("lora", x)
        if kernel is not None and x.dtype in kernel.dtypes and x.dim() == 2:
            present = self.lora.present
            a, b, spans = self.a, self.b, self.spans
            kernel(
                y,
                x.contiguous(),
                self.lora.compact,
                [a[s] for s in present],
                [b[s] for s in present],
                [spans[s] for s in present],
            )
            return y
        return lora_reference(y, x, self)

    def extra_repr(self) -> str:
        used = sum(1 for a in self.a if a.numel())
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={used}"


def plain_a(a: torch.Tensor, in_features: int) -> torch.Tensor:
    """A slot's ``a`` blocks as ``[parts * R, in_features]``."""
    groups, kb = a.shape[:2]
    return a.transpose(1, 2).reshape(groups * 4, kb * 16)[:, :in_features]


def plain_b(b: torch.Tensor) -> torch.Tensor:
    """A slot's ``b`` blocks as ``[R, C]``."""
    return b.transpose(0, 1).reshape(b.shape[1], -1)


def lora_reference(y: torch.Tensor, x: torch.Tensor, mod: LoraLinear) -> torch.Tensor:
    """The ``lora`` kernel's contract in torch ops: per adapter in the step, its rows' updates."""
    for slot in mod.lora.present:
        a = mod.a[slot]
        if not a.numel():
            continue
        idx = mod.lora.index(slot).to(x.device)
        xs = x.index_select(0, idx).float()
        rank = mod.b[slot].shape[1]
        s = xs @ plain_a(a, x.shape[-1]).float().t()
        b = plain_b(mod.b[slot]).float()
        for p, (o0, o1, c0) in enumerate(mod.spans[slot].tolist()):
            d = s[:, p * rank : (p + 1) * rank] @ b[:, c0 : c0 + o1 - o0]
            cols = y[:, o0:o1]
            cols.index_copy_(0, idx, (cols.index_select(0, idx).float() + d).to(y.dtype))
    return y


def lora_dtype(name: str, model: nn.Module) -> torch.dtype:
    """``EngineConfig.lora_dtype`` for ``model``: "auto" is float16 where the model's projections are
    GGUF blocks kept quantized (``QuantizedLinear``: 4 to 8 bits a weight, so float16's rounding of an
    adapter, 2^-11 of each weight, is far below the base's own), float32 otherwise: half the bytes a
    row reads (SmolLM2, rank 16 on all seven projections: 9.7 MB a token, beside its base's ~80)."""
    from astrai.model.quant import QuantizedLinear

    if name == "auto":
        quantized = any(isinstance(m, QuantizedLinear) for m in model.modules())
        return torch.float16 if quantized else torch.float32
    return getattr(torch, name)


def _wrap(owner: nn.Module, attr: str, lora: LoraSet) -> LoraLinear:
    mod = LoraLinear(getattr(owner, attr), lora)
    lora.swaps.append((owner, attr, mod))
    return mod


def install_lora(model: nn.Module, slots: int, dtype: torch.dtype = torch.float32) -> LoraSet:
    """Wrap ``model``'s decoder projections for ``slots`` adapters (the wrappers stand in only while a
    step has adapter rows: ``LoraSet.bind``); returns the model's ``LoraSet`` (also ``model.lora``). Fused projections (``fuse_projections``) take their parts' updates side by
    side; a layer whose MLP is not the gated MLP (a mixture of experts) gets attention updates only."""
    from astrai.model.layers import GatedMLP

    lora = LoraSet(slots, dtype)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        groups = [(attn, "self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), attn._split)]
        groups.append((attn, "self_attn", "o_proj", ("o_proj",), None))
        if type(mlp) is GatedMLP:  # (a mixture of experts: its experts take no adapter)
            half = mlp.down_proj.in_features
            groups.append((mlp, "mlp", "gate_up_proj", ("gate_proj", "up_proj"), [half, half]))
            groups.append((mlp, "mlp", "down_proj", ("down_proj",), None))
        for owner, path, fused, parts, sizes in groups:
            pre = f"model.layers.{i}.{path}"
            if len(parts) == 1 or hasattr(owner, fused):  # one projection, or the parts fused in one
                mod = _wrap(owner, parts[0] if len(parts) == 1 else fused, lora)
                o0 = 0
                for part, size in zip(parts, sizes or [mod.out_features], strict=True):
                    lora.targets[f"{pre}.{part}"] = (mod, o0, o0 + size)
                    o0 += size
            else:  # unfused: each part is a projection of its own
                for part in parts:
                    mod = _wrap(owner, part, lora)
                    lora.targets[f"{pre}.{part}"] = (mod, 0, mod.out_features)
    model.lora = lora
    return lora
