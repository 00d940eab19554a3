"""The whole-stack decode kernel (``decoder_layers``) of the cpu backend, watched or taken away in a test."""

from __future__ import annotations

import contextlib

import pytest
import torch


def cpu_kernels() -> dict:
    """The kernels the cpu backend lends CPU tensors in float32 (skips where it lends no quantized ones)."""
    from astrai.extension.backend.policy import get_registry
    from astrai.model import quantized_kernels

    why = quantized_kernels("cpu", torch.float32)
    if why is not None:
        pytest.skip(why)
    return get_registry().kernels.for_device("cpu")


@contextlib.contextmanager
def counted(kernels: dict, ran: list[bool]):
    """The ``decoder_layers`` kernel wrapped to record whether each call ran the step."""
    real = kernels["decoder_layers"]

    def kernel(*args):
        out = real(*args)
        ran.append(out is not None)
        return out

    kernel.lora = getattr(real, "lora", False)  # (whether it takes a step's LoRA rows)
    kernels["decoder_layers"] = kernel
    try:
        yield
    finally:
        kernels["decoder_layers"] = real


@contextlib.contextmanager
def without_stack(kernels: dict):
    """No ``decoder_layers`` kernel inside the block: the model runs its layers one by one."""
    real = kernels.pop("decoder_layers")
    try:
        yield
    finally:
        kernels["decoder_layers"] = real
