"""Host buffers on 2 MiB pages, for weights that a step reads in many short runs.

A decode step on the CPU is bound by how fast memory streams into the cores, and with 4 KiB pages
each page of a read is a translation the TLB misses (inside a virtual machine a miss walks two
page tables). Weights read as one long run hide the walks behind the hardware prefetchers; weights
read as hundreds of runs of 20-100 KB each (a LoRA adapter's blocks, one A and one B per projection
and row: ``astrai.lora``) do not. Measured on 2 Zen 4 vCPUs (a C++ copy of the adapter kernels'
loops, 8 rows on 8 rank-16 adapters of the default model, 78 MB): 23-26 GB/s on 4 KiB pages, 28-34
GB/s on 2 MiB pages (six alternating runs each).

``huge_page_buffer`` maps anonymous memory aligned to 2 MiB and asks Linux for transparent huge
pages on it (``MADV_HUGEPAGE``, honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` or ``always``) before it is touched, so the first write faults whole huge pages in
(no later ``khugepaged`` collapse). Elsewhere, or for a buffer under one huge page, it is an
ordinary zeroed tensor. ``packed_on_huge_pages`` copies tensors one after another into such a
buffer, in the order given (the order a step reads them in).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

__all__ = ["HUGE_PAGE", "huge_page_buffer", "packed_on_huge_pages"]

HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8, CPU) on transparent huge pages where the system gives them.

    The mapping lives as long as the tensor or any view of it does.
    """
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advise is None:
        return torch.zeros(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # one huge page more than asked: the mapping starts on a 4 KiB page, the buffer on the next 2 MiB
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(mapping)
    offset = -ctypes.addressof(probe) % HUGE_PAGE
    del probe  # (an exported buffer pins the mapping's size)
    try:
        mapping.madvise(advise, offset, size)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)


def packed_on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` side by side in one ``huge_page_buffer``, in order, each
    from a 64-byte boundary (a cache line)."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buffer = huge_page_buffer(sum(sizes))
    out, offset = [], 0
    for t, size in zip(tensors, sizes, strict=True):
        view = buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += size
    return out
