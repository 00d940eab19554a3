"""Where the two flash-attn entry points come from, and what they can run on.

``resolve()`` returns ``flash_attn.flash_attn_with_kvcache`` and
``flash_attn.flash_attn_varlen_func`` (imported on first use, never at import of
this module), or ``stand_in`` when it is set: functions with flash-attn's
signatures and documented behaviour that run elsewhere, such as the plain-PyTorch
test double that runs the backend end to end on a machine without CUDA.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Compute capability flash-attn 2 needs (its C++ entry points refuse anything older than Ampere).
MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class FlashKernels:
    """The flash-attn functions the backend calls, and the device type they run on."""

    with_kvcache: Callable[..., torch.Tensor]  # flash_attn.flash_attn_with_kvcache
    varlen_func: Callable[..., torch.Tensor]  # flash_attn.flash_attn_varlen_func
    device_type: str = "cuda"


#: Used instead of flash_attn when set. Set it before the backend is first instantiated
#: (and call ``astrai.extension.backend.policy.reset_registry()`` so that availability is asked again).
stand_in: FlashKernels | None = None


def resolve() -> FlashKernels:
    """``stand_in``, else flash_attn's functions.

    Raises ImportError when flash_attn does not import, RuntimeError when it is too
    old to take a block table in ``flash_attn_varlen_func`` (flash-attn < 2.6).
    """
    if stand_in is not None:
        return stand_in
    import flash_attn

    varlen = flash_attn.flash_attn_varlen_func
    if "block_table" not in inspect.signature(varlen).parameters:
        version = getattr(flash_attn, "__version__", "?")
        raise RuntimeError(
            f"flash_attn {version} takes no block_table in flash_attn_varlen_func (paged prefill); "
            "needs flash-attn >= 2.6"
        )
    return FlashKernels(flash_attn.flash_attn_with_kvcache, varlen)


def device_reason(kernels: FlashKernels, device: torch.device) -> str | None:
    """Why ``kernels`` cannot run on ``device``, or None. Host-side only: no device sync."""
    if device.type != kernels.device_type:
        return f"device {device} (flash-attn runs on {kernels.device_type})"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_CAPABILITY:
            need = ".".join(map(str, MIN_CAPABILITY))
            have = f"{major}.{minor}"
            return f"CUDA device {device} has compute capability {have}; flash-attn needs {need} or newer"
    return None


def availability() -> tuple[bool, str]:
    """``(ok, reason)`` for ``AttentionBackend.is_available``: never raises, allocates nothing."""
    try:
        kernels = resolve()
    except ImportError as err:
        return False, f"flash_attn does not import ({err}); install astrai-backend-flash[flash]"
    except Exception as err:  # a broken flash_attn install must not break backend selection
        return False, f"flash_attn unusable: {type(err).__name__}: {err}"
    if kernels.device_type != "cuda":
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    reason = device_reason(kernels, torch.device("cuda", torch.cuda.current_device()))
    return (False, reason) if reason else (True, "")
