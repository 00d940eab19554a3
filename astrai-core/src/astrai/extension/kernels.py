"""Fused kernels that attention backends lend the model, and ``KernelTable``, the kernels in force.

The model's glue between the linears (RMSNorm, the residual add before a norm, SiLU-and-
multiply, RoPE) is a handful of small ATen ops per call; on a CPU each costs a few
microseconds of dispatch, which at batch 1 adds up to a third of a decode step, and a linear
on a small batch is faster on weights laid out for it. A backend lends one-call kernels for
these ops (``AttentionBackend.kernels``, whose docstring is the contract of each op); the
model's ops (``astrai.extension.fused``) run them, and their PyTorch formulation otherwise.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from astrai.errors import PluginError
from astrai.extension.backend.base import OPS, Kernel

if TYPE_CHECKING:
    from astrai.extension.backend.base import AttentionBackend


class KernelTable:
    """The fused kernels in force for each device type: what the loaded backends lend.

    One per ``BackendRegistry`` (its ``kernels``), filled as the registry makes each backend's
    instance; the model reaches the process registry's table through one function,
    ``astrai.extension.fused.kernel_for``. A table the model looks up, rather than kernels
    carried with the step as the attention backend is (``KVCache.backend``), because:

    - the glue ops run inside modules that get a tensor and nothing else (``RMSNorm``,
      ``PackedLinear``, ``QuantizedLinear``, the quantized embedding, which runs before a
      step's backend is even resolved);
    - the kernel of an op depends on the tensor's device type, not on the step's attention
      backend: the cpu plugin's norms serve a step that torch_native attends, so a model's
      numbers do not depend on which backend attends its steps;
    - a weight packed for a kernel (``PackedLinear``) is kept per kernel object, so an op's
      kernel must be the same object from one step to the next.

    Each loaded backend is asked for its kernels once per device type, the first time a
    tensor of that type looks an op up. Where several lend one op, the backend automatic
    selection prefers wins (lowest ``priority``, then name). Lookups take no lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backends: list[AttentionBackend] = []  # loaded, most preferred first
        # what each backend lent, by (backend, device type): asked once
        self._lent: dict[tuple[AttentionBackend, str], dict[str, Kernel]] = {}
        self._by_device: dict[str, dict[str, Kernel]] = {}  # device type -> op -> kernel in force

    def add(self, backend: AttentionBackend) -> None:
        """A backend loaded for use: its kernels count from now on (asked for on first use)."""
        with self._lock:
            self._backends.append(backend)
            self._backends.sort(key=lambda b: (b.priority, b.name))
            self._by_device = {}  # merged again on the next lookup; what each backend lent is kept

    def get(self, op: str, device_type: str) -> Kernel | None:
        """The kernel in force for ``op`` on tensors of ``device_type``, or ``None``."""
        in_force = self._by_device.get(device_type)
        if in_force is None:
            in_force = self.for_device(device_type)
        return in_force.get(op)

    def for_device(self, device_type: str) -> dict[str, Kernel]:
        """``{op: kernel}`` in force for ``device_type``, the very dict lookups read (a test may pin
        a kernel in it for a while; loading another backend rebuilds it)."""
        with self._lock:
            in_force = self._by_device.get(device_type)
            if in_force is None:
                in_force = {}
                for backend in reversed(self._backends):  # the most preferred last, so that it wins
                    in_force.update(self._lent_by(backend, device_type))
                self._by_device[device_type] = in_force
            return in_force

    def _lent_by(self, backend: AttentionBackend, device_type: str) -> dict[str, Kernel]:
        key = (backend, device_type)
        if key not in self._lent:
            lent = {op: kernel for op, kernel in backend.kernels(device_type).items() if kernel is not None}
            unknown = sorted(set(lent) - set(OPS))
            if unknown:
                raise PluginError(
                    f"attention backend {backend.name!r} lends kernels for unknown ops {unknown}; "
                    f"known: {', '.join(OPS)}"
                )
            self._lent[key] = lent
        return self._lent[key]
