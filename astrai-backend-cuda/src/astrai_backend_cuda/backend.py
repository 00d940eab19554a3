"""``CudaBackend``: paged decode and ragged paged prefill on astrai's own CUDA kernels.

Decode steps (one token per request) are a single ``attn_paged_decode`` launch that
writes the new K/V and attends straight from the pool through ``req_to_token``, split-K
(the split count chosen per step from the batch, the longest sequence and the GPU's
size); other steps write K/V with ``index_copy_`` and run ``attn_paged_prefill``.
``prepare`` fills the ``KVCache`` fields only these kernels read, once per step: the
prefill tile maps (one host-to-device copy), or slices of split-K scratch allocated once
per pool. Nothing is gathered, nothing is allocated in decode, the device is never synchronised.
Sliding-window layers and soft-capped scores (``features``) run on the same kernels, which take
the layer's window and soft-cap; so does an int8 pool (``--kv-cache-dtype int8``, K, V or both):
decode quantizes the new K/V in the kernel, other steps quantize them as they are written
(``reference.write_kv``), and both kernels read ``q * scale``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from astrai.extension.api import AttentionBackend, KernelUnavailable, ops
from astrai_backend_cuda.build import load_kernels, rotary_kernel
from astrai_backend_cuda.plan import DECODE_MAX_SPLITS, HEAD_DIMS, MAX_GROUP, decode_num_splits, prefill_tiles
from astrai_backend_cuda.reference import write_kv

if TYPE_CHECKING:
    from collections.abc import Mapping

    from astrai.extension.api import Kernel, KVCache

_DTYPES = (torch.bfloat16, torch.float16)


class CudaBackend(AttentionBackend):
    """Attention on astrai's CUDA kernels; see ``AttentionBackend.forward``.

    Handles bfloat16/float16 on CUDA devices of compute capability 8.0 or newer, head
    dims 64 and 128, up to 16 query heads per KV head; ``supports()`` names what it
    cannot handle so the policy falls back (automatic) or raises (explicit).
    """

    name = "cuda"
    priority = 10
    #: Both kernels take a sliding window, a soft-cap and an int8 pool (``AttentionBackend.features``).
    features = frozenset({"window", "softcap", "kv_int8"})
    #: Device type of the tensors the ops accept.
    device_type = "cuda"

    def __init__(self) -> None:
        self._slots: dict[
            tuple[int, torch.dtype, int, int, bool, bool], tuple[int, int]
        ] = {}  # (device, dtype, D, group, int8 K, int8 V)
        # split-K scratch per (device, dtype, rows, heads, D): allocated once, sliced per step
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """A CUDA device of compute capability >= 8.0, and the kernels load (building them on first use)."""
        if not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return False, f"compute capability {major}.{minor}: the kernels need 8.0 (Ampere) or newer"
        try:
            load_kernels()
        except KernelUnavailable as err:
            return False, str(err)
        return True, ""

    def kernels(self, device_type: str) -> Mapping[str, Kernel]:
        """For CUDA tensors, the fused rotary kernel (``apply_rotary_emb`` takes it for bf16)."""
        if device_type != "cuda":
            return {}
        load_kernels()
        return {"rotary": rotary_kernel}

    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """None, or the first of: dtype, head_dim, head grouping, device (host facts only)."""
        kv = kv_cache
        stored = {
            buf.dtype if scales is None else q.dtype
            for buf, scales in ((kv.k_buffer, kv.k_scale), (kv.v_buffer, kv.v_scale))
        }
        if q.dtype not in _DTYPES or stored != {q.dtype}:
            return f"dtype {q.dtype} (KV {kv.k_buffer.dtype}) not supported: bfloat16 or float16 (or an int8 pool)"
        head_dim, n_heads, n_kv = q.shape[-1], q.shape[1], kv_cache.k_buffer.shape[2]
        if head_dim not in HEAD_DIMS:
            return f"head_dim {head_dim} not supported ({', '.join(map(str, HEAD_DIMS))})"
        if n_heads % n_kv or n_heads // n_kv > MAX_GROUP:
            return (
                f"{n_heads} query heads over {n_kv} KV heads not supported (at most {MAX_GROUP} per KV head)"
            )
        if q.device.type != self.device_type:
            return f"device {q.device.type}"
        return None

    def prepare(self, q: torch.Tensor, kv_cache: KVCache) -> None:
        """Decode steps: the split count (``kv_cache.plan["cuda"]``) and the split-K scratch; other
        steps: the prefill tile maps. Fields already set (a hand-built step) are kept."""
        kv = kv_cache
        if kv.max_q_len == 1:
            if kv.decode_o_part is None:
                o_part, ml_part, out = self._decode_scratch(q, kv)
                b = kv.req_pool_indices.shape[0]
                kv.decode_o_part, kv.decode_ml_part, kv.decode_out = o_part[:b], ml_part[:b], out[:b]
            kv.plan[self.name] = self._decode_splits(q, kv)
        elif kv.q_tile_to_batch is None:
            # hand-built steps may lack host facts
            q_lens = kv.q_lens_host or tuple(kv.qo_indptr.diff().tolist())
            to_batch, to_index = prefill_tiles(q_lens)
            tiles = torch.tensor([to_batch, to_index], dtype=torch.int32).to(q.device)
            kv.q_tile_to_batch, kv.q_tile_to_index = tiles[0], tiles[1]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Decode steps: one fused launch, result in ``kv_cache.decode_out``; others: write, then prefill.

        A sliding-window layer's decode splits its window (``min(max_len, window)`` positions at most),
        with a split count of its own, chosen once per step and window (``kv_cache.plan["cuda:w<W>"]``).
        """
        kv = kv_cache
        if q.shape[0] == kv.req_pool_indices.shape[0]:  # T == B: every request brings one token
            if self.name not in kv.plan or kv.decode_o_part is None:  # a direct call, without prepare()
                self.prepare(q, kv)
            max_len, splits = kv.max_len, kv.plan[self.name]
            if window and window < max_len:
                max_len, key = window, f"{self.name}:w{window}"
                if key not in kv.plan:
                    kv.plan[key] = self._decode_splits(q, kv, max_len)
                splits = kv.plan[key]
            return ops.attn_paged_decode(
                q,
                k,
                v,
                kv.k_buffer,
                kv.v_buffer,
                layer_id,
                kv.req_to_token,
                kv.req_pool_indices,
                kv.seq_lens,
                kv.out_cache_loc,
                max_len,
                splits,
                kv.decode_o_part,
                kv.decode_ml_part,
                kv.decode_out,
                scale,
                window=window,
                softcap=softcap,
                k_scale=kv.k_scale,
                v_scale=kv.v_scale,
            )
        if kv.q_tile_to_batch is None:  # a direct call, without prepare()
            self.prepare(q, kv)
        write_kv(kv.k_buffer, kv.k_scale, layer_id, kv.out_cache_loc, k)
        write_kv(kv.v_buffer, kv.v_scale, layer_id, kv.out_cache_loc, v)
        return ops.attn_paged_prefill(
            q,
            kv.k_buffer,
            kv.v_buffer,
            layer_id,
            kv.req_to_token,
            kv.req_pool_indices,
            kv.qo_indptr,
            kv.kv_indptr,
            kv.q_tile_to_batch,
            kv.q_tile_to_index,
            scale,
            window=window,
            softcap=softcap,
            k_scale=kv.k_scale,
            v_scale=kv.v_scale,
        )

    def _decode_splits(self, q: torch.Tensor, kv: KVCache, max_len: int | None = None) -> int:
        """The step's split count over ``max_len`` positions at most (default ``kv.max_len``), from host
        facts and the (cached) size of the device."""
        n_kv = kv.k_buffer.shape[2]
        num_sms, blocks_per_sm = self._device_slots(
            q, q.shape[1] // n_kv, kv.k_scale is not None, kv.v_scale is not None
        )
        return decode_num_splits(
            kv.req_pool_indices.shape[0],
            n_kv,
            kv.max_len if max_len is None else max_len,
            num_sms,
            blocks_per_sm,
            kv.decode_o_part.shape[2],
        )

    def _decode_scratch(
        self, q: torch.Tensor, kv: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(o_part, ml_part, out)`` for every row of ``req_to_token``, made once per pool shape."""
        rows, n_heads, head_dim = kv.req_to_token.shape[0], q.shape[1], q.shape[-1]
        key = (q.device, q.dtype, rows, n_heads, head_dim)
        if key not in self._scratch:
            partial = (rows, n_heads, DECODE_MAX_SPLITS)
            self._scratch[key] = (
                torch.zeros((*partial, head_dim), dtype=torch.float32, device=q.device),
                torch.zeros(partial, dtype=torch.float32, device=q.device),
                torch.zeros((rows, n_heads, head_dim), dtype=q.dtype, device=q.device),
            )
        return self._scratch[key]

    def _device_slots(
        self, q: torch.Tensor, group: int, k8: bool = False, v8: bool = False
    ) -> tuple[int, int]:
        """``(SM count, decode blocks per SM)`` of q's device for this shape and pool (``k8``/``v8``:
        int8 K/V), asked once per key."""
        device = q.device.index if q.device.index is not None else torch.cuda.current_device()
        key = (device, q.dtype, q.shape[-1], group, k8, v8)
        if key not in self._slots:
            with torch.cuda.device(device):
                blocks = torch.ops.astrai.paged_decode_blocks_per_sm(q.dtype, q.shape[-1], group, k8, v8)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self._slots[key] = (sms, max(1, blocks))
        return self._slots[key]
