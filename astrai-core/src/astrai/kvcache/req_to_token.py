"""ReqToTokenPool: the request-row x position -> slot table, and who owns each row."""

from __future__ import annotations

import torch

from astrai.errors import CapacityExceeded


class ReqToTokenPool:
    """``req_to_token [num_reqs, max_ctx_len]`` int32 on the pool's device, plus host bookkeeping.

    A live request owns one row; ``req_to_token[row, pos]`` is the slot holding the
    K/V of its token at ``pos`` for every ``pos < lens[row]``. Entries past
    ``lens[row]`` and rows that are not live hold stale values nobody may read.

    With ``linear_stride`` set (contiguous mode) the table is filled once with
    ``row * linear_stride + pos`` and never written again.

    Host-side state (``lens``, the free-row stack) is plain Python so that the
    scheduler never waits on the device to learn a length.

    With ``groups`` > 1 (paged, layer groups: ``astrai.kvcache.layout``) each group has a table
    of its own (``tables[g]``; ``req_to_token`` is group 0's) and page lists (``group_pages[g]``;
    ``pages`` is group 0's), where -1 marks a windowed group's page that went back to the pool
    (its slots in the table are stale: no window reaches them).
    """

    def __init__(
        self,
        num_reqs: int,
        max_ctx_len: int,
        device: torch.device | str,
        linear_stride: int | None = None,
        groups: int = 1,
    ) -> None:
        if num_reqs < 1 or max_ctx_len < 1:
            raise ValueError(f"need num_reqs >= 1 and max_ctx_len >= 1, got {num_reqs}, {max_ctx_len}")
        self.num_reqs = num_reqs
        self.max_ctx_len = max_ctx_len
        self.device = torch.device(device)
        if linear_stride is None:
            self.req_to_token = torch.zeros((num_reqs, max_ctx_len), dtype=torch.int32, device=self.device)
        else:
            rows = torch.arange(num_reqs, dtype=torch.int64).unsqueeze(1) * linear_stride
            table = rows + torch.arange(max_ctx_len, dtype=torch.int64)
            self.req_to_token = table.to(torch.int32).to(self.device)
        #: positions of each row that have a slot (0 for rows that are not live)
        self.lens: list[int] = [0] * num_reqs
        self.tables = [self.req_to_token]
        for _ in range(groups - 1):
            self.tables.append(torch.zeros((num_reqs, max_ctx_len), dtype=torch.int32, device=self.device))
        #: paged mode: each row's page ids in position order (empty for rows that are not live)
        self.group_pages: list[list[list[int]]] = [[[] for _ in range(num_reqs)] for _ in range(groups)]
        self.pages = self.group_pages[0]
        self._live = [False] * num_reqs
        # reversed so that alloc hands out row 0 first: deterministic, easy to read in logs.
        self._free_rows = list(range(num_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Rows that task_alloc can still hand out."""
        return len(self._free_rows)

    def alloc(self) -> int:
        """Take a free row (its ``lens`` is 0). Raises CapacityExceeded when every row is live."""
        if not self._free_rows:
            raise CapacityExceeded(f"all {self.num_reqs} request rows are in use")
        row = self._free_rows.pop()
        self._live[row] = True
        self.lens[row] = 0
        return row

    def free(self, row: int) -> None:
        """Release a live row. Raises ValueError for a row that is not live."""
        self.require_live(row)
        self._live[row] = False
        self.lens[row] = 0
        for pages in self.group_pages:
            pages[row] = []
        self._free_rows.append(row)

    def is_live(self, row: int) -> bool:
        return 0 <= row < self.num_reqs and self._live[row]

    def require_live(self, row: int) -> None:
        """Raise ValueError unless ``row`` is a live request row."""
        if not self.is_live(row):
            raise ValueError(f"request row {row} is not allocated")

    def live_rows(self) -> list[int]:
        """Live rows in ascending order."""
        return [r for r in range(self.num_reqs) if self._live[r]]

    def free_rows(self) -> list[int]:
        """A copy of the free-row stack (for invariant checks)."""
        return list(self._free_rows)

    def append_pages(self, row: int, new_pages: list[int], page_size: int, group: int = 0) -> None:
        """Paged mode: give ``row`` the next ``len(new_pages)`` pages of ``group`` and write their slots
        (a page of -1, one a windowed group does without, gets page 0's: stale, never read)."""
        pages = self.group_pages[group][row]
        first = len(pages) * page_size
        pages.extend(new_pages)
        page_t = torch.tensor(new_pages, dtype=torch.int64).clamp_(min=0)
        slots = (page_t.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)
        self.write(row, first, slots, group)

    def write(self, row: int, start: int, slots: torch.Tensor, group: int = 0) -> None:
        """Set ``req_to_token[row, start:start+len(slots)]``, clipped at ``max_ctx_len``.

        ``slots`` is a 1-D integer tensor on any device; the copy is the only
        device traffic extend() causes.
        """
        end = min(start + slots.numel(), self.max_ctx_len)
        if end > start:
            self.tables[group][row, start:end] = slots[: end - start].to(self.req_to_token.device)
