"""``CpuBackend``: torch_native, with decode rows on a kernel that reads the pool directly.

Decode rows (one new token per request) go to ``astrai_cpu::paged_decode``: no gather of
K/V into a padded ``[B, L]`` copy, no mask, one pass over each request's own slots; on 2
cores it takes about half the time of torch_native's gather + bmm at batch 8-32 and a
fifth at batch 1 (``benchmarks/README.md``). Fresh prompts (no cached prefix) in bf16 with head
dim 64 or 128 go to ``astrai_cpu::prefill_attention`` (AVX512-BF16 builds; 4-5x SDPA on a 512-token
prompt); other prefill rows (chunks after a cached prefix, other dtypes) take torch_native's paths.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from astrai.errors import KernelUnavailable
from astrai.extension.backend.torch_native import TorchNativeBackend, _plan, _StepPlan
from astrai_backend_cpu.build import load_kernels

if TYPE_CHECKING:
    from astrai.kvcache.cache import KVCache

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _has_prefill_kernel() -> bool:
    """The build targets AVX512-BF16 (asked once the kernels are loaded)."""
    return bool(torch.ops.astrai_cpu.has_prefill_attention())


class _CpuPlan(NamedTuple):
    native: _StepPlan  # torch_native's plan, its decode part unused
    tok_rows: torch.Tensor | None  # [b] token row of each decode request; None: every row, in order
    rows: torch.Tensor  # [b] int64 req_to_token row of each decode request
    seq_lens: torch.Tensor  # [b] int64


def _cpu_plan(kv: KVCache, dtype: torch.dtype) -> _CpuPlan:
    native = _plan(kv, dtype)
    if kv.max_q_len == 1:  # a pure decode step: every request, in order
        return _CpuPlan(native, None, kv.req_pool_indices.long(), kv.seq_lens.long())
    q_lens = torch.tensor(kv.q_lens_host) if kv.q_lens_host else kv.qo_indptr.diff().long()
    pick = (q_lens == 1).nonzero()[:, 0]
    starts = kv.qo_indptr[:-1].long()
    return _CpuPlan(native, starts[pick], kv.req_pool_indices.long()[pick], kv.seq_lens.long()[pick])


class CpuBackend(TorchNativeBackend):
    """torch_native plus the CPU decode kernel; see ``AttentionBackend.forward`` (torch_native's,
    which writes the K/V and then calls ``_attend_step``).

    Handles CPU tensors in float32, bfloat16 and float16, any head dim; ``supports()``
    names what it cannot handle so the policy falls back (automatic) or raises (explicit).
    """

    name = "cpu"
    priority = 50

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """The kernels load (building them on first use on this machine)."""
        try:
            load_kernels()
        except KernelUnavailable as err:
            return False, str(err)
        return True, ""

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """``None`` for CPU tensors of a supported dtype, else the reason."""
        if q.device.type != "cpu":
            return f"device {q.device.type} (the kernels run on the CPU)"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} not supported (float32, bfloat16, float16)"
        return None

    @staticmethod
    def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """A fresh prompt: ``astrai_cpu::prefill_attention`` for bf16 with head dim 64 or 128 where the
        compiler targets AVX512-BF16, else torch_native's SDPA."""
        if q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and q.shape[-1] in (64, 128) and _has_prefill_kernel():
            return torch.ops.astrai_cpu.prefill_attention(q, k, v, scale)
        return TorchNativeBackend._causal(q, k, v, scale)

    def _attend_step(self, q, k, v, k_buf, v_buf, kv_cache: KVCache, scale: float) -> torch.Tensor:
        """After torch_native's K/V write: decode rows on the kernel, the others as torch_native."""
        plan = kv_cache.plan.get(self.name)
        if plan is None:
            plan = kv_cache.plan[self.name] = _cpu_plan(kv_cache, q.dtype)
        if plan.native.decode is None:
            return self._attend(q, k, v, k_buf, v_buf, plan.native, scale)
        dq = q if plan.tok_rows is None else q.index_select(0, plan.tok_rows)
        decoded = torch.ops.astrai_cpu.paged_decode(
            dq.contiguous(), k_buf, v_buf, kv_cache.req_to_token, plan.rows, plan.seq_lens, scale
        )
        if plan.tok_rows is None:
            return decoded
        out = self._attend(q, k, v, k_buf, v_buf, plan.native._replace(decode=None), scale)
        return out.index_copy_(0, plan.tok_rows, decoded)
