"""Property tests: random interleavings of the request lifecycle against a shadow model.

The shadow knows which page-aligned token prefixes were recorded (and, after each
extend, which ones the pool evicted), which of them every live request holds, and
what K value each position must hold. It checks matches against a brute-force
longest-prefix search, eviction against what was legal, ref-counts against the
holders, and that no request's K values are ever overwritten by another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from astrai.errors import CapacityExceeded
from astrai.kvcache import KVConfig, PagePool, assert_nothing_held, check_pool_invariants

MAX_SEQ = 12
ROWS = 3
# prompts share a few families of prefixes (diverging at different pages) so that matches,
# sibling branches and duplicate computations are common
FAMILIES = [(0,) * 8, (0, 0, 0, 0, 1, 1, 1, 1), (0, 0, 1, 1, 0, 0, 1, 1), (1, 0) * 4]
TOKENS = st.builds(
    lambda family, cut, tail: (list(family[:cut]) + tail)[:MAX_SEQ] or [0],
    st.sampled_from(FAMILIES),
    st.integers(2, 8),
    st.lists(st.integers(0, 1), max_size=5),
)


def kv_value(tokens: list[int], pos: int) -> float:
    """The K value position ``pos`` holds: a fingerprint of the prefix it was computed from."""
    return float(hash(tuple(tokens[: pos + 1])) % 1_000_003 + 1)  # exact in float32


@dataclass
class Req:
    tokens: list[int]
    materialized: int  # positions whose K values were written (or shared)
    extended: int  # positions given slots
    held: set[tuple[int, ...]] = field(default_factory=set)  # cached prefixes it holds pages of


class KVMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4, 2, 4]), n_pages=st.integers(3, 8))
    def setup(self, page_size, n_pages):
        self.ps = page_size
        config = KVConfig(
            max_batch_size=ROWS, max_seq_len=MAX_SEQ, page_size=page_size, n_tokens=n_pages * page_size
        )
        self.pool = PagePool(1, 1, 1, 1, config, torch.float32, "cpu")
        self.reqs: dict[int, Req] = {}
        self.cached: set[tuple[int, ...]] = set()  # shadow of the radix: recorded, not evicted

    # ------------------------------------------------------------ shadow helpers
    def radix_paths(self) -> set[tuple[int, ...]]:
        radix = self.pool.radix
        return set() if radix is None else {node.token_path() for node in radix.iter_nodes()}

    def pinned(self) -> set[tuple[int, ...]]:
        """Cached prefixes that some live request holds a page of, at or below them."""
        pins = set()
        for req in self.reqs.values():
            for path in req.held:
                pins.update(path[: k * self.ps] for k in range(1, len(path) // self.ps + 1))
        return pins

    def expected_match(self, tokens: list[int]) -> int:
        if self.pool.radix is None:
            return 0
        k = 0
        while (k + 1) * self.ps <= len(tokens) - 1 and tuple(tokens[: (k + 1) * self.ps]) in self.cached:
            k += 1
        return k * self.ps

    def checked_extend(self, row: int, old_extended: int, target: int) -> bool:
        pages_needed = -(-target // self.ps) - -(-old_extended // self.ps)
        free = self.pool.allocator.num_free
        evictable = len(self.cached - self.pinned())
        pinned = self.pinned()
        table = self.pool.req_to_token.clone()
        ok = self.pool.extend(row, target)
        assert ok == (pages_needed <= free + evictable)
        now = self.radix_paths()
        assert now <= self.cached
        evicted = self.cached - now
        assert not evicted & pinned, f"evicted pinned prefixes {evicted & pinned}"
        if ok:
            assert len(evicted) == max(0, pages_needed - free)
            assert self.pool.req_len(row) == target
        else:
            assert not evicted and torch.equal(self.pool.req_to_token, table)
            assert self.pool.req_len(row) == old_extended and self.pool.allocator.num_free == free
        self.cached = now
        return ok

    def pick(self, i: int) -> tuple[int, Req]:
        row = sorted(self.reqs)[i % len(self.reqs)]
        return row, self.reqs[row]

    # ------------------------------------------------------------ rules
    @rule(tokens=TOKENS, share=st.booleans())
    def start(self, tokens, share):
        """A new request; without ``share`` it skips matching and computes every page itself."""
        if len(self.reqs) == ROWS:
            with pytest.raises(CapacityExceeded):
                self.pool.task_alloc()
            return
        row = self.pool.task_alloc()
        n = self.pool.match_prefix(row, tokens) if share else 0
        assert n == (self.expected_match(tokens) if share else 0)
        held = {tuple(tokens[: k * self.ps]) for k in range(1, n // self.ps + 1)}
        self.reqs[row] = Req(list(tokens), n, n, held)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, ROWS - 1), k=st.integers(1, 8), extra=st.lists(st.integers(0, 2), max_size=4))
    def compute(self, i, k, extra):
        row, req = self.pick(i)
        req.tokens = (req.tokens + extra)[:MAX_SEQ]
        target = min(req.materialized + k, len(req.tokens))
        if target <= req.materialized:
            return
        if target > req.extended:
            if not self.checked_extend(row, req.extended, target):
                return
            req.extended = target
        slots = self.pool.req_to_token[row, req.materialized : target].long()
        values = [kv_value(req.tokens, p) for p in range(req.materialized, target)]
        self.pool.k_buffer[0, slots, 0, 0] = torch.tensor(values)
        req.materialized = target

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, ROWS - 1), upto=st.integers(0, MAX_SEQ))
    def record(self, i, upto):
        row, req = self.pick(i)
        m = min(upto, req.materialized)
        self.pool.record(row, req.tokens[:m])
        if self.pool.radix is None:
            return
        for k in range(1, m // self.ps + 1):
            path = tuple(req.tokens[: k * self.ps])
            if path not in self.cached:
                self.cached.add(path)
                req.held.add(path)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, ROWS - 1))
    def finish(self, i):
        """What the scheduler does at the end: compute the rest, record it, free the request."""
        row, req = self.pick(i)
        self.compute(i, MAX_SEQ, [])
        self.record(i, req.materialized)
        self.free(i)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, ROWS - 1))
    def free(self, i):
        row, _ = self.pick(i)
        self.pool.task_free(row)
        del self.reqs[row]

    @precondition(lambda self: len(self.reqs) < ROWS)
    @rule(slack=st.integers(0, 2))
    def pressure(self, slack):
        """A filler request takes all but ``slack`` pages of what is available (evicting), then leaves."""
        row = self.pool.task_alloc()
        available = self.pool.available_tokens()
        if available + self.ps <= MAX_SEQ:  # one page too many: must fail without evicting anything
            assert not self.checked_extend(row, 0, available + self.ps)
        target = min(available - slack * self.ps, MAX_SEQ)
        if target > 0:
            assert self.checked_extend(row, 0, target)
            if not slack and target + self.ps <= MAX_SEQ:
                assert not self.checked_extend(row, target, target + self.ps)
        self.pool.task_free(row)

    # ------------------------------------------------------------ invariants
    @invariant()
    def pool_is_consistent(self):
        check_pool_invariants(self.pool)
        assert self.radix_paths() == self.cached
        pinned = self.pinned()
        if self.pool.radix is not None:
            assert self.pool.radix.evictable_pages == len(self.cached - pinned)
        refcount = self.pool.allocator.refcount
        table = self.pool.req_to_token
        for row, req in self.reqs.items():
            first_slots = table[row, : req.extended : self.ps].long()
            for k, page in enumerate((first_slots // self.ps).tolist()):
                path = tuple(req.tokens[: (k + 1) * self.ps])
                if path in req.held:
                    holders = sum(path in other.held for other in self.reqs.values())
                    assert refcount[page] == 1 + holders
                    assert self.pool.radix.node_of_page(page).token_path() == path
                else:
                    assert refcount[page] == 1  # private page
            got = self.pool.k_buffer[0, table[row, : req.materialized].long(), 0, 0].tolist()
            assert got == [kv_value(req.tokens, p) for p in range(req.materialized)]
        assert self.pool.stats()["kv_tokens_cached"] == self.ps * len(self.cached - pinned)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for row in list(self.reqs):
            self.pool.task_free(row)
        check_pool_invariants(self.pool)
        assert_nothing_held(self.pool)
        assert self.pool.stats()["kv_tokens_cached"] == self.ps * len(self.cached)
        if self.pool.radix is not None:
            assert self.pool.radix.evict(len(self.cached) + 1) == len(self.cached)
        assert self.pool.allocator.num_free == self.pool.allocator.n_pages
        assert self.pool.stats()["kv_tokens_cached"] == 0
        check_pool_invariants(self.pool)


KVMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestKVLifecycle = KVMachine.TestCase


@settings(max_examples=40, deadline=None)
@given(
    paged=st.booleans(),
    page_size=st.sampled_from([1, 2, 4]),
    batch=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 149)), min_size=1, max_size=4),
)
def test_bind_tasks_agrees_with_a_per_token_reference(paged, page_size, batch):
    config = KVConfig(max_batch_size=4, max_seq_len=150, page_size=page_size, n_tokens=600 if paged else None)
    pool = PagePool(1, 2, 1, 4, config)
    rows, q_lens, seq_lens = [], [], []
    for seq_len, cached in batch:
        row = pool.task_alloc()
        assert pool.extend(row, seq_len)
        rows.append(row)
        seq_lens.append(seq_len)
        q_lens.append(seq_len - min(cached, seq_len - 1))
    kv = pool.bind_tasks(rows, q_lens, seq_lens)
    out = []
    for row, q, s in zip(rows, q_lens, seq_lens, strict=True):
        out += [int(pool.req_to_token[row, pos]) for pos in range(s - q, s)]
    assert kv.out_cache_loc.tolist() == out
    assert kv.kv_indptr.tolist() == [sum(seq_lens[:i]) for i in range(len(rows) + 1)]
    assert kv.qo_indptr.tolist() == [sum(q_lens[:i]) for i in range(len(rows) + 1)]
    assert len(set(out)) == len(out)  # no two new tokens write the same slot
    check_pool_invariants(pool)
