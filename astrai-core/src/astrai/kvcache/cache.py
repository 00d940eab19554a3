"""The per-step view of the KV system that a model forward receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVCache:
    """Everything attention needs for one forward step: pure data, no methods.

    The step is a ragged batch of ``B`` requests. Request ``i`` brings
    ``q_len[i] = qo_indptr[i+1] - qo_indptr[i]`` new tokens and, after this step,
    holds ``seq_lens[i]`` tokens of KV (its cached prefix plus the new tokens),
    so its new tokens sit at positions ``seq_lens[i] - q_len[i] .. seq_lens[i] - 1``.
    New tokens are flattened request after request: ``T = qo_indptr[-1]``.
    A decode step is the case where every ``q_len`` is 1.

    The fields, by who fills them:

    - ``k_buffer`` to ``qo_indptr`` (the spec's): ``PagePool.bind_tasks``, for every backend.
    - ``q_tile_to_batch`` to ``decode_out`` (the spec's too, read by the cuda backend's kernels
      alone): ``None`` until that backend's ``prepare`` fills them, once per step and only for the
      steps it runs. Other backends keep what they derive per step in ``plan``.
    - ``max_q_len`` to ``page_size``, host facts: ``bind_tasks`` (``drafts_host``: the model
      runner). Not in ``plan``, because no backend derives them: they are what the host knows of
      the step (and of the pool's layout), and a backend could only learn them by reading device
      tensors back, a device sync per step. Every backend reads ``max_q_len`` and the per-request
      lengths, and a tensor-parallel step sends them to the other ranks (``astrai.distributed.tp``)
      with ``num_tokens`` and ``page_size``; ``drafts_host`` (read by the cpu backend) and
      ``page_size`` (by flash) are facts of the step that any backend may use. A hand-built step
      may leave them at their defaults: backends then do without.
    - ``backend`` (``astrai.extension.bind_step``): the step's attention backend, resolved once;
      every layer uses it as it is. ``plan``: what backends derive once per step, by backend name.

    All tensors live on the pool's device. Integer index tensors are int64 unless
    stated; the ``*_indptr`` and tile maps are int32 (kernel-friendly).
    """

    k_buffer: torch.Tensor  # [n_layers, size, n_kv_heads, head_dim], model dtype (or int8: k_scale)
    v_buffer: torch.Tensor  # [n_layers, size, n_kv_heads, head_dim], model dtype (or int8: v_scale)
    req_to_token: torch.Tensor  # [num_reqs, max_ctx_len] int32: request row, position -> slot
    req_pool_indices: torch.Tensor  # [B] int64: row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64: KV length of each request after this step
    out_cache_loc: torch.Tensor  # [T] int64: slot where each new token's K/V is written
    max_len: int  # max(seq_lens), kept on the host to avoid a device sync in decode
    kv_indptr: torch.Tensor  # [B + 1] int32: prefix sum of seq_lens
    qo_indptr: torch.Tensor  # [B + 1] int32: prefix sum of per-request q_len
    # A quantized pool (``astrai.kvcache.quant``): K (V) is int8 and its float32 scale per slot and
    # head is here, [n_layers, size, n_kv_heads]; None: K (V) is in the model dtype. A backend
    # serving a quantized pool lists "kv_int8" in its ``features`` (``features`` below then has it).
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # Filled by the backend that reads them (astrai-backend-cuda), in its prepare():
    q_tile_to_batch: torch.Tensor | None = None  # [num_q_tiles] int32: prefill Q tile -> request
    q_tile_to_index: torch.Tensor | None = None  # [num_q_tiles] int32: Q tile -> request-local tile index
    decode_o_part: torch.Tensor | None = None  # [B, n_heads, splits, head_dim] f32: split-K partial outputs
    decode_ml_part: torch.Tensor | None = None  # [B, n_heads, splits] f32: split-K partial log-sum-exp
    decode_out: torch.Tensor | None = None  # [B, n_heads, head_dim] model dtype: decode output accumulator
    # Host-side facts, so no backend has to read a device tensor to learn them.
    max_q_len: int = 0  # max(q_len); 1 means a pure decode step
    num_tokens: int = 0  # T
    q_lens_host: tuple[int, ...] = ()  # per-request q_len
    seq_lens_host: tuple[int, ...] = ()  # per-request seq_len
    # per-request speculative drafts (``StepPlan.drafts``; empty: none): a row with drafts is a
    # decode token and its drafts, whose logits must be what decoding them one by one gives
    drafts_host: tuple[int, ...] = ()
    # Slots come in aligned runs of page_size: positions [j*page_size, (j+1)*page_size) of a
    # request sit in slots [p*page_size, (p+1)*page_size), in order. The pool's page size in
    # paged mode, max_seq_len in contiguous mode; 1 promises nothing.
    page_size: int = 1
    # The attention backend of this step (an astrai.extension AttentionBackend, which sits above this
    # module: not imported here), resolved once (None: not yet; attention() resolves it).
    backend: Any = None
    # What the model's layers ask of attention beyond the spec's causal softmax ("window",
    # "softcap"; ``AttentionBackend.features``): set before the backend is resolved (the runner,
    # or the model on a direct call), so that one lacking an option is never picked.
    features: frozenset[str] = frozenset()
    # A pool of layer groups (``astrai.kvcache.layout``: models with sliding-window layers): the
    # step's view of each group (this one is group 0's; the others share everything but
    # ``req_to_token`` and ``out_cache_loc``), and where layer i's K/V live: group
    # ``layer_slots[i][0]``, index ``layer_slots[i][1]`` of ``k_buffer``. Empty: one group, layer i
    # at index i. ``attention`` hands each layer its group's view.
    groups: tuple[KVCache, ...] = ()
    layer_slots: tuple[tuple[int, int], ...] = ()
    # Per-step scratch for backends: metadata a backend derives once per step (gather
    # indices, masks, block tables) and reuses in every layer, keyed by backend name.
    plan: dict[str, Any] = field(default_factory=dict)
