"""``astrai.hugepages``: buffers on 2 MiB pages (aligned, zeroed, given huge pages where the system's
transparent huge pages allow them) and tensors packed into one in order."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from astrai.hugepages import HUGE_PAGE, huge_page_buffer, packed_on_huge_pages

LINUX_THP = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def _thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled (None: not there)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not LINUX_THP, reason="transparent huge pages are a Linux feature")
def test_a_large_buffer_is_zeroed_and_starts_on_a_huge_page():
    buf = huge_page_buffer(5 * HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * HUGE_PAGE + 123 and buf.device.type == "cpu"
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    buf.fill_(7)
    view = buf[HUGE_PAGE : HUGE_PAGE + 64].view(torch.int32)
    del buf
    gc.collect()
    assert view.tolist() == [0x07070707] * 16  # a view keeps the mapping alive


@pytest.mark.skipif(
    not LINUX_THP or _thp_mode() not in ("always", "madvise"),
    reason="the system gives no transparent huge pages (enabled: never)",
)
def test_the_buffer_is_backed_by_huge_pages_once_written():
    buf = huge_page_buffer(4 * HUGE_PAGE)
    buf.fill_(1)
    assert _anon_huge_kb(buf.data_ptr()) >= 2048


def test_a_small_buffer_is_an_ordinary_zeroed_tensor():
    buf = huge_page_buffer(100)
    assert buf.dtype == torch.uint8 and buf.tolist() == [0] * 100


@pytest.mark.parametrize("scale", [1, 4096], ids=["small", "past-a-huge-page"])
def test_tensors_packed_in_order_in_one_buffer_keep_their_values(scale):
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5 * scale, generator=gen).to(torch.float16),
        torch.randn(7, 16, generator=gen).to(torch.bfloat16),
        torch.arange(11 * scale, dtype=torch.int64).view(-1, 1),
        torch.randn(2, 3, 4, scale, generator=gen),
    ]
    packed = packed_on_huge_pages(tensors)
    for got, want in zip(packed, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want) and got.data_ptr() != want.data_ptr()
        assert got.data_ptr() % 64 == 0
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    starts = [t.data_ptr() for t in packed]
    assert starts == sorted(starts)
    for first, second in zip(packed[:-1], packed[1:], strict=True):  # side by side, under a line apart
        end = first.data_ptr() + first.numel() * first.element_size()
        assert end <= second.data_ptr() < end + 64
