"""The ``cuda`` attention backend of astrai: paged decode, ragged paged prefill and rotary kernels.

Registered in ``astrai.attention_backends`` as ``cuda`` (``CudaBackend``, in ``backend``),
the default on a CUDA machine. Importing this package is cheap: the kernels load (or are
compiled, once per machine) when ``load_kernels()`` first runs, which
``CudaBackend.is_available()`` does. ``reference`` holds a pure-PyTorch version of each
op's contract; ``python -m astrai_backend_cuda.compile_check`` compiles every kernel.
"""

from __future__ import annotations

from astrai_backend_cuda.build import load_kernels

__all__ = ["load_kernels"]
