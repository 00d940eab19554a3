"""``astrai.hugepages``: memory moved onto transparent huge pages keeps its bytes, is counted, and
shows as huge pages in the kernel's own account of the mapping; ``ASTRAI_HUGE_PAGES=0`` leaves
everything alone."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from astrai import hugepages


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return sys.platform.startswith("linux") and "[never]" not in f.read()
    except OSError:
        return False


def _huge_kb(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings overlapping [lo, hi), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                m_lo, m_hi = int(head.group(1), 16), int(head.group(2), 16)
                inside = m_lo < hi and lo < m_hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.fixture
def fresh_madvise(monkeypatch):
    hugepages._madvise.cache_clear()
    yield monkeypatch
    hugepages._madvise.cache_clear()


def test_a_tensor_moved_onto_huge_pages_keeps_its_bytes(fresh_madvise):
    if not _thp_available():
        pytest.skip("this kernel offers no transparent huge pages (mode never, or not Linux)")
    fresh_madvise.delenv("ASTRAI_HUGE_PAGES", raising=False)
    t = torch.arange(6 << 20, dtype=torch.int32)  # 24 MiB
    want = t.clone()
    moved = hugepages.huge_pages([t])
    if moved == 0:
        pytest.skip("the kernel refused MADV_COLLAPSE (older than Linux 6.1, or no huge page free)")
    lo = t.untyped_storage().data_ptr()
    assert 20 << 20 <= moved <= t.numel() * 4  # whole 2 MB pages inside the tensor's 24 MiB
    assert _huge_kb(lo, lo + t.numel() * 4) * 1024 >= moved
    assert torch.equal(t, want)
    assert hugepages.huge_pages([t]) == moved  # (again: already there, the same ranges)


def test_turned_off_by_the_environment(fresh_madvise):
    fresh_madvise.setenv("ASTRAI_HUGE_PAGES", "0")
    t = torch.zeros(8 << 20, dtype=torch.uint8)
    assert hugepages.huge_pages([t]) == 0
    assert hugepages.huge_pages() == 0


def test_tensors_elsewhere_than_the_cpu_or_empty_move_nothing(fresh_madvise):
    fresh_madvise.delenv("ASTRAI_HUGE_PAGES", raising=False)
    assert hugepages.huge_pages([torch.empty(0), torch.empty(4 << 20, device="meta")]) == 0
