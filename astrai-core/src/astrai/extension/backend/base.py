"""The ``AttentionBackend`` ABC: cache I/O plus attention for one layer of one step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astrai.plugins import check_class

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from astrai.kvcache.cache import KVCache

#: The ops a backend may lend a kernel for (``AttentionBackend.kernels`` gives each one's contract).
OPS = ("rotary", "rms_norm", "add_rms_norm", "silu_and_mul", "linear", "decoder_layers", "quant_linear")
OPS += ("quant_experts", "lora", "encoder_attention", "argmax", "categorical", "top_p")

#: A fused kernel: a callable, or an object with the methods and attributes its op names.
Kernel = Callable[..., Any]
#: ``rotary``'s kernel: ``kernel(x, freqs) -> rotated x`` (``apply_rotary_emb``'s contract).
RotaryKernel = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


class AttentionBackend(ABC):
    """One way to write new K/V into the pool and attend over it.

    Implementations are registered in the ``astrai.attention_backends`` entry-point
    group; the entry-point name is the backend's ``name`` (what ``ASTR_BACKEND``
    takes). A backend module must import cheaply: heavy imports (compiled
    kernels, flash_attn) happen inside methods.
    """

    #: Entry-point name, e.g. ``"torch_native"``.
    name: str = ""
    #: Lower runs first in automatic selection (cuda 10, flash 20, cpu 50, torch_native 100).
    priority: int = 100
    #: The per-layer options of ``forward`` it implements: ``"window"`` (sliding-window layers) and
    #: ``"softcap"`` (soft-capped scores). A model whose layers use one (``KVCache.features``) never
    #: gets a backend without it; one that has none is called with the spec's six arguments.
    features: frozenset[str] = frozenset()

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether this backend can run in this process at all.

        Returns ``(ok, reason)``; ``reason`` says why not (missing package,
        no CUDA device, kernels not built) and is empty when ``ok``. Must not
        raise and must not allocate device memory.
        """

    @abstractmethod
    def supports(self, q: torch.Tensor, kv_cache: KVCache) -> str | None:
        """Capability check for one step.

        ``q`` carries the step's query layout: its dtype, device and ``[n_heads, head_dim]``
        (the engine passes a zero-row tensor; values are never read). Returns ``None`` when
        this backend can run the step, else a short reason (``"dtype torch.float32 not
        supported"``, ``"head_dim 80 not supported"``, ``"device cpu"``). Host facts only:
        must not synchronise the device.
        """

    def prepare(self, q: torch.Tensor, kv_cache: KVCache) -> None:  # noqa: B027 - optional hook
        """Derive what this backend reads in every layer, once per step, before the first layer.

        ``q`` as in ``supports``. Stash it in ``kv_cache.plan[self.name]``, or fill the
        ``KVCache`` fields only this backend reads (they are ``None`` until then). Runs only
        for the steps this backend runs; a ``forward`` called without it (a direct call)
        must prepare for itself. Default: nothing.
        """

    def kernels(self, device_type: str) -> Mapping[str, Kernel]:
        """The fused kernels this backend lends the model for tensors on ``device_type``: ``{op: kernel}``.

        The registry asks each backend it has loaded for use (made its instance; an engine loads
        every available backend when it starts), once per device type, the first time a tensor of
        that type looks an op up (``astrai.extension.kernels.KernelTable``): it may load the
        backend's compiled ops and make kernel objects, but must not allocate device memory or
        synchronise the device. It is never asked from a capability check. Default: none.

        The model calls an op's kernel only while grad is disabled, on tensors of ``device_type``,
        in place of the op's PyTorch formulation, whose roundings it must keep (only the order
        of its float32 sums may differ). A kernel allocates its outputs and mutates nothing else
        unless said below. The ops (``astrai.extension.kernels.OPS``):

        - ``rotary``: ``kernel(x, freqs)``, ``apply_rotary_emb``'s contract for bf16 ``x [...,
          heads, head_dim]`` (other dtypes take the torch path) and float32 ``freqs [...,
          head_dim/2, 2]`` (``[cos, sin]``; leading dims broadcast to x's): the rotated ``x``,
          rounded once; it may rotate ``x`` in place and return it.
        - ``rms_norm``: ``kernel(x, weight, eps)`` for ``x [rows, hidden]``, ``weight [hidden]``:
          ``F.rms_norm(x) * weight``, float32 inside, rounded to x's dtype, then the product rounded.
        - ``add_rms_norm``: ``kernel(x, residual, weight, eps) -> (s, rms_norm(s))`` with ``s = x +
          residual`` rounded to the dtype first; ``[rows, hidden]`` each.
        - ``silu_and_mul``: ``kernel(x)`` for ``x [rows, 2 * n] = [gate | up]``: ``F.silu(gate) *
          up``, ``[rows, n]``, each rounded to the dtype.
        - ``linear``: an object; ``pack(weight)`` puts an ``[N, K]`` weight in the kernel's layout
          (once per weight, kept by ``PackedLinear``); ``kernel(x, packed, bias, float_out=False)``
          for bf16 rows ``x [M, K]`` is ``F.linear``'s result (one rounding of the float32 sum,
          after the bias), or with ``float_out`` the float32 sums unrounded, any number of rows (an
          LM head's logits); ``max_rows``: the most rows it takes (``None``: any number), larger
          inputs go to oneDNN.
        - ``quant_linear``: an object running ``QuantizedLinear`` (GGUF weights in its tile layout):
          ``kernel(x, packed, layout, bias, float_out=False)`` for bf16 or float32 ``x [M, K]``
          (the dequantized weight's product summed in float32, the bias added, one rounding to x's
          dtype; with ``float_out`` float32, any number of rows); ``dtypes`` (optional, default
          both): the activation dtypes it takes (others run on the reference); ``max_rows``: the
          most rows it takes, more go to ``wide(x, packed, layout, bias)`` when it has one, else to
          ``weight_t(packed, layout, dtype)`` (the weight dequantized, ``[K, N]``) and oneDNN;
          ``rows(packed, layout, ids, dtype)``: rows of the weight dequantized (embedding lookups).
        - ``quant_experts``: ``kernel(x, offsets, packed, layout)``: one projection of a
          mixture-of-experts layer's chosen experts in one call (``astrai.model.moe``): ``x [R, K]``
          the rows sorted by expert, expert ``e``'s rows ``offsets[e]:offsets[e + 1]`` (int64,
          ``[experts + 1]``), ``packed`` one tile-layout weight per expert, all of ``layout``;
          each row's result ``quant_linear``'s on that row (no bias), ``[R, N]``; ``dtypes`` as
          ``quant_linear``'s.
        - ``lora``: ``kernel(y, x, rows, a, b, spans)``: adds the LoRA updates of a step's rows to
          a linear's output ``y [T, N]`` in place (``astrai.lora``); ``x [T, K]`` its input, ``rows``
          int32 ``[T]`` each row's adapter slot (-1: none), per slot ``a``, ``b`` and ``spans`` in
          ``astrai.lora.layers``' blocks (``a [parts * R / 4, ceil(K / 16), 4, 16]``, ``b [C / 16,
          R, 16]``; ``plain_a``/``plain_b`` give them as ``[parts * R, K]`` and ``[R, C]``) and
          ``spans`` int64 ``[parts, 3]`` ``(o0, o1, c0)``: part ``p`` adds ``(x @ A[p*R:(p+1)*R].T)
          @ B[:, c0:c0 + o1 - o0]`` to ``y[:, o0:o1]`` (empty tensors for a slot the module has no
          update for); ``dtypes`` the ``x`` dtypes it takes.
        - ``encoder_attention``: ``kernel(qkv, lengths, heads, scale)`` for bf16 ``qkv [T, 3 * heads *
          head_dim]`` (each row a token's q, k and v heads side by side; rows may be strided), the
          sequences one after another, ``lengths`` int64 ``[B]`` their tokens: each sequence's
          bidirectional attention over its own tokens alone, ``[T, heads * head_dim]`` (an
          encoder's, ``astrai.model.bert``; probabilities rounded to bf16 before their product with
          V, as PyTorch's flash attention rounds them); ``head_dims``: the head dims it takes.
        - ``argmax``: ``kernel(logits)`` for float32 ``logits [B, V]`` (contiguous rows): int64
          ``[B]``, each row's greedy token as ``logits.max(dim=-1).indices`` gives it (the first
          position of the maximum; of the first NaN where the row holds one).
        - ``categorical``: ``kernel(logits, temperature, seeds, steps)`` for float32 ``logits [B, V]``
          (contiguous rows; -inf for tokens a filter removed), ``temperature`` float32 ``[B]`` or
          ``None`` (1; a row's 0 counts as 1), ``seeds``/``steps`` int64 ``[B]``: int64 ``[B]``, each
          row's draw from ``softmax(logits / temperature)`` by ``astrai.sampling.noise.categorical``'s
          race on its noise (the same token wherever that race's two best ratios are not within a
          float32 rounding of each other); token 0 for a row whose softmax is NaN. Not modified.
        - ``top_p``: ``kernel(logits, top_p)`` for float32 ``logits [B, V]`` (contiguous rows) and
          ``top_p`` float32 ``[B]``: in place, each row with ``top_p < 1`` keeps the tokens whose logit
          is at least that of the last token, in descending order, whose probability mass strictly
          ahead of it is under ``top_p`` (``TopPStrategy``'s nucleus, ties with it kept), the others
          -inf; rows with a NaN, +inf or nothing above -inf unchanged. Returns ``logits``.
        - ``decoder_layers``: ``kernel(model, x, freqs, kv_cache)`` with the embeddings ``x [T,
          hidden]``, the rotary rows ``freqs``, a list of ``[1, T, head_dim/2, 2]`` tables (the
          model's, then its local layers'; ``model.decoder_stack()`` says which turns each
          layer) and the step's ``KVCache`` (its layer groups, if any, in ``groups``): runs
          all of ``model``'s decoder layers (writing the step's K/V as they would) and returns the
          hidden states after the last one, bit for bit the layers' own on the same kernels; or
          ``None``, without side effects, when it cannot run this model or step. A step with LoRA
          rows (``astrai.lora``) reaches it only if it has ``lora = True``: it then adds
          ``model.stack_lora()``'s updates after each projection, as the layers' wrappers do.
        """
        return {}

    @abstractmethod
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
        """Write this step's K/V, then attend.

        Shapes: ``q [T, n_heads, head_dim]``, ``k``/``v [T, n_kv_heads, head_dim]``
        (RoPE already applied to ``q`` and ``k``), in the model dtype, on the
        pool's device; ``T = kv_cache.num_tokens``. Writes ``k``/``v`` into
        ``kv_cache.k_buffer[layer_id, kv_cache.out_cache_loc]`` (and ``v_buffer``),
        then returns ``o [T, n_heads, head_dim]``: for each request, causal
        attention of its new tokens over its ``seq_len`` cached-plus-new tokens
        (a new token at position ``p`` sees positions ``0..p``). ``n_heads`` is a
        multiple of ``n_kv_heads`` (grouped-query attention). Reads what ``prepare`` made;
        must not mutate anything but the pool's new slots and its own ``plan`` entry.

        The keywords come only to a backend that lists them in ``features``. ``window > 0``: a
        sliding-window layer, where the token at position ``p`` sees positions ``p - window + 1
        .. p`` only (HF's ``sliding_window``). ``softcap > 0``: each scaled score ``s`` becomes
        ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).
        """


ATTENTION_BACKENDS = "astrai.attention_backends"
"""The entry-point group of ``AttentionBackend`` subclasses; the name is what ``ASTR_BACKEND`` takes."""


def check_backend_class(name: str, plugin: object, origin: str) -> type[AttentionBackend]:
    """Validate an ``astrai.attention_backends`` plugin: an ``AttentionBackend`` named ``name``.

    ``origin`` names the entry point and distribution for the message. Raises PluginError.
    """
    return check_class(AttentionBackend, name, plugin, origin)
