"""The ``cpu`` attention backend of astrai: decode attention straight from the paged KV pool.

Registered in ``astrai.attention_backends`` as ``cpu`` (``CpuBackend``, in ``backend``),
preferred over torch_native for CPU tensors. Importing this package is cheap: the kernel is
compiled (once per machine, into a persistent cache) when ``load_kernels()`` first runs,
which ``CpuBackend.is_available()`` does.
"""

from __future__ import annotations

from astrai_backend_cpu.build import load_kernels, paged_decode

__all__ = ["load_kernels", "paged_decode"]
