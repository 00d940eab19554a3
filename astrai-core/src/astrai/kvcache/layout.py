"""KVLayout: which layers share a page, for models whose layers attend over sliding windows.

A model whose layers all attend to every position (Llama, Qwen) keeps one page per ``page_size``
positions holding every layer's K/V: one group of all its layers. A model with local layers
(Gemma 2/3, Ministral, Mistral with a sliding window) needs a local layer's K/V only for the last
``window`` positions, while a global layer needs them all. Its layers are cut into groups of equal
size, each group of layers with the same window; a page holds ``page_size`` positions of one
group, and each request has one page table per group. A windowed group's pages that fall out of
the window go back to the pool while the request runs (``PagePool.slide``); a global group's stay.
All groups draw their pages from the one allocator, so short and long requests share the memory
as they need it (vLLM's hybrid KV manager does the same).

The group size is the size of the smallest set of layers with one window (Gemma 3: its global
layers, one in six); a larger set fills several groups, the last padded with unused layer slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KVLayout"]


@dataclass(frozen=True)
class KVLayout:
    """``group_size`` layer slots per page; group ``g`` attends over ``windows[g]`` positions (0: all);
    layer ``i`` keeps its K/V in slot ``slots[i][1]`` of group ``slots[i][0]``'s pages."""

    group_size: int
    windows: tuple[int, ...]
    slots: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, windows: tuple[int, ...] | list[int]) -> KVLayout:
        """The layout of layers with these windows (0: a global layer), global groups first."""
        windows = tuple(int(w) for w in windows)
        if not windows or min(windows) < 0:
            raise ValueError(f"layer windows must be >= 0, one per layer: {windows}")
        sets: dict[int, list[int]] = {}
        for layer, w in enumerate(windows):
            sets.setdefault(w, []).append(layer)
        size = min(len(layers) for layers in sets.values())
        group_windows: list[int] = []
        slots: list[tuple[int, int]] = [(0, 0)] * len(windows)
        for w in sorted(sets):  # 0 (global) first: group 0 of a mixed model is a global one
            layers = sets[w]
            for first in range(0, len(layers), size):
                for j, layer in enumerate(layers[first : first + size]):
                    slots[layer] = (len(group_windows), j)
                group_windows.append(w)
        return cls(size, tuple(group_windows), tuple(slots))

    @property
    def n_groups(self) -> int:
        return len(self.windows)

    @property
    def n_global(self) -> int:
        """Groups whose pages are kept for every position."""
        return sum(1 for w in self.windows if not w)

    @property
    def trivial(self) -> bool:
        """One group of every layer, none windowed: the layout of a model without local layers."""
        return self.windows == (0,)

    def pages(self, n_positions: int, page_size: int, chunk: int = 1) -> int:
        """Pages a request of ``n_positions`` holds at most, computed ``chunk`` positions a step: every
        page of a global group; a windowed group's window, the step's chunk and one page of slack
        (the next page is taken before the one leaving the window goes back)."""
        full = math.ceil(n_positions / page_size)
        total = 0
        for w in self.windows:
            total += full if not w else min(full, math.ceil((w - 1 + max(chunk, 1)) / page_size) + 1)
        return total

    def positions(self, n_pages: int, page_size: int, chunk: int = 1) -> int:
        """The most positions one request can hold in ``n_pages`` (the inverse of ``pages``); a layout
        of windowed groups only holds any number of positions in the pages of its windows."""
        if self.pages(1, page_size, chunk) > n_pages:
            return 0
        if not self.n_global:
            return 1 << 62
        lo, hi = 1, n_pages * page_size  # pages() is monotone: the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.pages(mid, page_size, chunk) <= n_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo
