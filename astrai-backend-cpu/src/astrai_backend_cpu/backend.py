"""``CpuBackend``: torch_native, with decode rows on a kernel that reads the pool directly.

Decode rows (one new token per request) go to ``astrai_cpu::paged_decode``: no gather of
K/V into a padded ``[B, L]`` copy, no mask, one pass over each request's own slots; on 2
cores it takes about half the time of torch_native's gather + bmm at batch 8-32 and a
fifth at batch 1 (``benchmarks/README.md``). Prefill rows (fresh prompts and chunks after a cached
prefix) in bf16 with head dim 64, 128 or 256 go to ``astrai_cpu::prefill_attention`` (AVX512-BF16
builds), which reads each request's K/V from the pool too (4-5x SDPA on a fresh 512-token
prompt); other dtypes and head dims take torch_native's paths. Both kernels take a sliding window
(``paged_decode`` as each request's first position, ``prefill_attention`` as the window); where
the build has no prefill kernel (no AVX512-BF16) windowed prefill rows take torch_native's windowed
plans. Soft-capped layers run as torch_native.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from astrai.extension.api import KernelUnavailable, NativePlan, TorchNativeBackend, dequantize_kv, plan_step
from astrai_backend_cpu import kernels
from astrai_backend_cpu.build import load_kernels

if TYPE_CHECKING:
    from collections.abc import Mapping

    from astrai.extension.api import Kernel, KVCache

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _has_prefill_kernel() -> bool:
    """The build targets AVX512-BF16 (asked once the kernels are loaded)."""
    return bool(torch.ops.astrai_cpu.has_prefill_attention())


class _CpuPlan(NamedTuple):
    native: NativePlan | None  # torch_native's plan for rows the kernels do not take (None: they take all)
    tok_rows: torch.Tensor | None  # [b] token row of each decode request; None: every row, in order
    rows: torch.Tensor  # [b] int64 req_to_token row of each decode request
    seq_lens: torch.Tensor  # [b] int64
    # the prefill kernel's chunks (every request with more than one new token): req_to_token rows,
    # first token rows, token counts, cached prefix lengths, int64 [c]; None: torch_native runs them
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None


def _prefill_kernel_runs(q: torch.Tensor, kv: KVCache) -> bool:
    """``astrai_cpu::prefill_attention`` takes the step's prefill rows (bf16, a bf16 or int8 pool,
    head dim 64, 128 or 256, an AVX512-BF16 build)."""
    return (
        q.dtype == torch.bfloat16
        and all(
            buf.dtype == (torch.bfloat16 if s is None else torch.int8)
            for buf, s in ((kv.k_buffer, kv.k_scale), (kv.v_buffer, kv.v_scale))
        )
        and q.shape[-1] in (64, 128, 256)
        and _has_prefill_kernel()
    )


def _cpu_plan(kv: KVCache, q: torch.Tensor) -> _CpuPlan:
    """Which rows go to which kernel (host facts only; ``q`` for its dtype and head dim)."""
    if kv.max_q_len == 1:  # a pure decode step: every request, in order
        return _CpuPlan(None, None, kv.req_pool_indices.long(), kv.seq_lens.long(), None)
    q_lens = torch.tensor(kv.q_lens_host) if kv.q_lens_host else kv.qo_indptr.diff().long()
    seq_lens = torch.tensor(kv.seq_lens_host) if kv.seq_lens_host else kv.seq_lens.long()
    starts, req_rows = kv.qo_indptr[:-1].long(), kv.req_pool_indices.long()
    # decode rows, and speculative verify rows (KVCache.drafts_host) token by token, each token over
    # the positions up to its own: what decoding them one step at a time computes, bit for bit
    short = q_lens == 1
    if kv.drafts_host:
        short |= torch.tensor(kv.drafts_host) > 0
    n = q_lens[short]
    total = int(n.sum())
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n, output_size=total)
    tok_rows = torch.repeat_interleave(starts[short], n, output_size=total) + within
    rows = torch.repeat_interleave(req_rows[short], n, output_size=total)
    lens = torch.repeat_interleave((seq_lens - q_lens)[short], n, output_size=total) + within + 1
    if bool(short.all()):  # every token, in order
        return _CpuPlan(None, None, rows, lens, None)
    if not _prefill_kernel_runs(q, kv):
        return _CpuPlan(plan_step(kv, q.dtype), tok_rows, rows, lens, None)
    other = (~short).nonzero()[:, 0]
    chunks = (req_rows[other], starts[other], q_lens[other], (seq_lens - q_lens)[other])
    return _CpuPlan(None, tok_rows, rows, lens, chunks)


class CpuBackend(TorchNativeBackend):
    """torch_native plus the CPU decode kernel; see ``AttentionBackend.forward`` (torch_native's,
    which writes the K/V and then calls ``attend_step``).

    Handles CPU tensors in float32, bfloat16 and float16, any head dim; ``supports()``
    names what it cannot handle so the policy falls back (automatic) or raises (explicit).
    """

    name = "cpu"
    priority = 50
    features = frozenset({"window", "softcap", "kv_int8"})

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """The kernels load (building them on first use on this machine)."""
        try:
            load_kernels()
        except KernelUnavailable as err:
            return False, str(err)
        return True, ""

    def kernels(self, device_type: str) -> Mapping[str, Kernel]:
        """For CPU tensors, the fused CPU kernels: norms, rotary, and where the build has them
        ``linear``, whole-step decode and ``quant_linear`` (``astrai_backend_cpu.kernels``)."""
        if device_type != "cpu":
            return {}
        load_kernels()
        return kernels.fused_kernels(type(self))

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """``None`` for CPU tensors of a supported dtype, else the reason."""
        if q.device.type != "cpu":
            return f"device {q.device.type} (the kernels run on the CPU)"
        if q.dtype not in _DTYPES:
            return f"dtype {q.dtype} not supported (float32, bfloat16, float16)"
        return None

    def prepare(self, q: torch.Tensor, kv_cache: KVCache) -> None:
        """The step's split between the kernels and torch_native, kept in ``kv_cache.plan["cpu"]``."""
        kv_cache.plan[self.name] = _cpu_plan(kv_cache, q)

    def store(
        self, x: torch.Tensor, buf: torch.Tensor, scale: torch.Tensor | None, kv_cache: KVCache
    ) -> torch.Tensor:
        """torch_native's ``store`` in one ``astrai_cpu::store_kv`` call (the same bytes); the new rows
        are read back only for a step whose prefill rows attend to them."""
        torch.ops.astrai_cpu.store_kv(x, kv_cache.out_cache_loc, buf, scale)
        if scale is None or kv_cache.max_q_len == 1:  # decode rows read the pool itself
            return x
        loc = kv_cache.out_cache_loc
        return dequantize_kv(buf.index_select(0, loc), scale.index_select(0, loc), x.dtype)

    def attend_step(
        self,
        q,
        k,
        v,
        k_buf,
        v_buf,
        kv_cache: KVCache,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        scales=(None, None),
    ) -> torch.Tensor:
        """After torch_native's K/V write: decode rows on ``paged_decode`` (a sliding window as the
        first position each request attends; int8 K/V with their ``scales``), the others on
        ``prefill_attention`` where it runs (it takes the window and int8 K/V too), else as
        torch_native (its windowed plans). Soft-capped layers run as torch_native."""
        if softcap:  # no kernel caps its scores
            return super().attend_step(q, k, v, k_buf, v_buf, kv_cache, scale, window, softcap, scales)
        plan = kv_cache.plan.get(self.name)
        if plan is None:  # a direct call, without prepare()
            plan = kv_cache.plan[self.name] = _cpu_plan(kv_cache, q)
        if plan.rows.numel():
            dq = q if plan.tok_rows is None else q.index_select(0, plan.tok_rows)
            starts = (plan.seq_lens - window).clamp(min=0) if window else None
            decoded = torch.ops.astrai_cpu.paged_decode(
                dq.contiguous(),
                k_buf,
                v_buf,
                kv_cache.req_to_token,
                plan.rows,
                plan.seq_lens,
                scale,
                starts,
                *scales,
            )
            if plan.tok_rows is None:  # a pure decode step
                return decoded
        if plan.chunks is not None:
            out = torch.ops.astrai_cpu.prefill_attention(
                q, k_buf, v_buf, kv_cache.req_to_token, *plan.chunks, scale, window, *scales
            )
        else:
            native = (
                plan.native
                if plan.native is not None and not window
                else self.native_plan(q, kv_cache, window)
            )
            out = self.attend(q, k, v, k_buf, v_buf, native._replace(decode=None), scale, scales=scales)
        return out.index_copy_(0, plan.tok_rows, decoded) if plan.rows.numel() else out
