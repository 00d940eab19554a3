"""``EngineConfig``: how an engine batches, sizes its KV pool and configures its plugins.

A contract at the bottom of core: plain values, no torch, no subsystem above it (the pool's
sizing from a model is ``astrai.kvcache.sizing.kv_config``). Each default is written here once;
``astrai serve``'s settings take theirs from it (astrai_server.config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from astrai.grammar.base import GrammarConfig
from astrai.limits import RequestLimits

__all__ = [
    "DEFAULT_KV_MEMORY_BYTES",
    "KV_CACHE_DTYPES",
    "LORA_DTYPES",
    "SCHEDULING_POLICIES",
    "SPECULATIVE_METHODS",
    "EngineConfig",
]

#: ``EngineConfig.scheduling_policy`` values.
SCHEDULING_POLICIES = ("fcfs", "priority")
#: ``EngineConfig.speculative`` values (None: off).
SPECULATIVE_METHODS = ("ngram",)
#: ``EngineConfig.lora_dtype`` values: what adapters' weights are kept in (``astrai.lora``).
LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")

#: What the KV pool may keep K and V in (``astrai.kvcache.quant``, which this must match; config
#: imports no torch): the model's dtype, or 8-bit integers with a scale per token and head.
KV_CACHE_DTYPES = ("auto", "int8")

#: KV budget of a paged pool when neither n_tokens nor kv_memory_bytes is given.
DEFAULT_KV_MEMORY_BYTES = 512 * 2**20


@dataclass
class EngineConfig:
    """How the engine batches and sizes its KV pool (maps onto ``KVConfig``), and its plugins' settings.

    Paged by default: ``page_size`` 16 with radix prefix caching, the pool sized by
    ``n_tokens`` or ``kv_memory_bytes`` (default: ``DEFAULT_KV_MEMORY_BYTES``, capped
    at ``max_batch_size * max_seq_len`` tokens). ``paged=False`` gives the
    contiguous pool (``max_batch_size * max_seq_len`` slots, no prefix caching).
    ``sampling``: defaults of plugin sampling parameters for every request, e.g.
    ``{"min_p": 0.05}`` (see ``SamplingPipeline``). ``plugin_options``: values of the
    options hook plugins declared (``astrai_add_options``), by ``dest``.

    Load shedding: at most ``max_queued_requests`` requests wait for admission (beyond that,
    ``submit`` raises ``Overloaded``; None: no limit), and a request still waiting for its first
    admission after ``queue_timeout`` seconds ends with ``Overloaded`` (None: it waits).
    ``scheduling_policy``: "fcfs" admits in arrival order; "priority" admits by
    ``submit(priority=)`` (lower first, then arrival) and preempts the lowest priority first.
    ``tensor_parallel_size`` > 1: ``InferenceEngine.from_model`` splits the model over that many
    ranks (``astrai.distributed``), whose collectives wait at most ``tp_timeout`` seconds.
    ``speculative="ngram"``: greedy requests speculate up to ``num_speculative_tokens`` tokens
    per step from their last ``ngram_min`` to ``ngram_max`` tokens (``astrai.speculative``).
    ``limits``: what one request's stop strings and ``logit_bias`` may hold (``astrai.limits``).
    ``chat_template``: a Jinja file or inline template that replaces the checkpoint's
    (``astrai.model.chat_template.load_chat_template``; None: the checkpoint's own).
    ``generation_defaults``: ``SamplingParams`` values that requests leaving them out get, e.g.
    ``{"temperature": 0.2}`` (``astrai.model.generation_config``: a checkpoint's).
    ``enable_lora``: the model's projections take LoRA adapters (``astrai.lora``), at most
    ``max_loras`` resident at once, each of rank ``max_lora_rank`` at most, its weights kept in
    ``lora_dtype``: "float32", "float16", "bfloat16" or "auto" (float16 where the model's
    projections are GGUF blocks kept quantized, whose own rounding is far coarser than float16's,
    halving what a step reads for its adapters; float32 otherwise). The products sum in float32.
    ``kv_cache_dtype``: what the KV pool keeps K and V in (``astrai.kvcache.quant``): "auto" (the
    model's dtype) or "int8"; ``kv_cache_dtype_k`` / ``_v`` set K's or V's alone (None: as
    ``kv_cache_dtype``). A quantized pool holds more tokens in the same ``kv_memory_bytes``.
    ``kv_cache_host_memory_bytes`` / ``kv_cache_dir``: the prefix cache's evicted pages go to host RAM
    (that many bytes) and to files in that folder (at most ``kv_cache_dir_bytes``), and a later
    prompt with their prefix loads them back (``astrai.kvcache.tier``); the folder's pages outlive
    the process.
    ``prefill_step_ratio``: while requests decode, a step's prefill tokens are cut so that it takes
    at most this many times a decode-only step (``astrai.pacing``: measured costs; None: every step
    may prefill ``max_prefill_tokens``).
    ``activations``: "int8" multiplies a GGUF model's quantized weights by activations quantized to
    8 bits per group, as llama.cpp does (``astrai.model.activations``); "dtype": by the activations
    in the model's dtype, exactly; "auto": int8 where the kernel's int8 path is measured to keep a
    model of that dtype's quality (``int8_by_default``: bf16 on AVX512-VNNI), else "dtype".
    """

    max_batch_size: int = 64
    max_seq_len: int | None = None  # None: the model's context length
    paged: bool = True
    page_size: int = 16
    n_tokens: int | None = None
    kv_memory_bytes: int | None = None
    prefix_caching: bool = True
    max_prefill_tokens: int = 2048
    # a step that prefills while requests decode may take this many decode steps' time (astrai.pacing); None: off
    prefill_step_ratio: float | None = None
    # strict selection for every request that made none in an attn_backend() context (beats ASTR_BACKEND)
    attention_backend: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    grammar_backend: str | None = None  # astrai.grammars entry point for constrained decoding; None: xgrammar
    grammar: GrammarConfig = field(
        default_factory=GrammarConfig
    )  # compile workers, time-out, size and cache bounds
    plugin_options: dict[str, Any] = field(default_factory=dict)
    max_queued_requests: int | None = None
    queue_timeout: float | None = None
    scheduling_policy: str = "fcfs"  # or "priority"
    tensor_parallel_size: int = 1  # ranks the model is split over (astrai.distributed); 1: this process alone
    tp_timeout: float = 300.0  # seconds a tensor-parallel collective may wait; idle ranks get a heartbeat
    speculative: str | None = (
        None  # "ngram": prompt-lookup speculative decoding of greedy requests; None: off
    )
    num_speculative_tokens: int = 4  # drafts per request and step
    ngram_min: int = 2  # shortest suffix matched against the request's earlier tokens
    ngram_max: int = 4  # longest (tried first)
    limits: RequestLimits = field(
        default_factory=RequestLimits
    )  # stop strings, logit_bias: checked at submit
    chat_template: str | None = None  # a file or an inline Jinja string; None: the checkpoint's
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # sampling values left out
    enable_lora: bool = False  # LoRA adapters (astrai.lora), loaded with InferenceEngine.loras
    max_loras: int = 4  # adapters resident at once
    max_lora_rank: int = 64  # the largest rank an adapter may have
    lora_dtype: str = "auto"  # adapters' weights: auto (float16 on quantized GGUF weights), float32, ...
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "int8", for K and V
    kv_cache_dtype_k: str | None = None  # K's alone (None: kv_cache_dtype)
    kv_cache_dtype_v: str | None = None  # V's alone
    kv_cache_host_memory_bytes: int = (
        0  # host RAM for pages evicted from the pool (astrai.kvcache.tier); 0: none
    )
    kv_cache_dir: str | None = None  # a folder the evicted pages are written to, found again on restart
    kv_cache_dir_bytes: int = 8 * 2**30  # what the folder may hold
    activations: str = "auto"  # "auto", "int8" or "dtype" (astrai.model.activations)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if (
            self.max_queued_requests is not None and self.max_queued_requests < 1
        ):  # each request waits a moment
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.tp_timeout > 0:
            raise ValueError(f"tp_timeout must be > 0 seconds, got {self.tp_timeout}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} or None, "
                f"got {self.speculative!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 15:  # astrai.speculative.MAX_SPECULATIVE_TOKENS
            raise ValueError(f"num_speculative_tokens must be in [1, 15], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                "need 1 <= ngram_min <= ngram_max, "
                f"got ngram_min {self.ngram_min}, ngram_max {self.ngram_max}"
            )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}"
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.kv_cache_host_memory_bytes < 0 or self.kv_cache_dir_bytes < 1:
            raise ValueError(
                "kv_cache_host_memory_bytes must be >= 0 and kv_cache_dir_bytes >= 1, got "
                f"{self.kv_cache_host_memory_bytes}, {self.kv_cache_dir_bytes}"
            )
        if self.prefill_step_ratio is not None and not self.prefill_step_ratio > 1:
            raise ValueError(f"prefill_step_ratio must be > 1, got {self.prefill_step_ratio}")
        if self.activations not in ("auto", "int8", "dtype"):  # astrai.model.activations.ACTIVATIONS
            raise ValueError(f"activations must be auto, int8 or dtype, got {self.activations!r}")
        for kind in self.kv_kinds:
            if kind not in KV_CACHE_DTYPES:
                raise ValueError(f"KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kind!r}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {self.queue_timeout}")

    @property
    def kv_kinds(self) -> tuple[str, str]:
        """What K and V are kept in: ``kv_cache_dtype_k`` / ``_v``, else ``kv_cache_dtype``."""
        return (self.kv_cache_dtype_k or self.kv_cache_dtype, self.kv_cache_dtype_v or self.kv_cache_dtype)
