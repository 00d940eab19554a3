"""Decoders as pooling models: an embedder whose vector is the final-normed hidden state of an input's
last token (the Qwen3-Embedding / e5-mistral / gte-Qwen2 recipe), or a sequence classifier (a
reranker: ``*ForSequenceClassification``'s ``score`` head on the last token, one label; or a causal
LM whose ``config.json`` names the tokens it answers with, vLLM's ``classifier_from_token``: for
Qwen3-Reranker ``["no", "yes"]``, scored as the probability of "yes" between the two).

The model is a decoder family astrai serves (``astrai.models``), its LM head replaced by a
``PoolingHead``; an ``InferenceEngine`` runs it, so its requests are prefill-only work of the
scheduler: batched under the token budget (``max_prefill_tokens``), chunked, preempted and aborted as
generation is. The runner takes each finished prompt's vector instead of sampling
(``StepResult.pooled``); the request ends there and its pages go back. The engine has no prefix
cache (nothing enters a radix tree) and, by default, a KV pool of 256 MiB (``KV_MEMORY_BYTES``) for
inputs of up to 8,192 tokens (``MAX_INPUT_TOKENS``; fewer where the checkpoint or the pool says). ``DecoderPooler`` gives that engine the interface of
``EmbeddingEngine`` (``encode``, ``check``, ``embed``, ``task``...), so the HTTP routes serve both.

Which task: ``task`` ("embed" or "score") when given (``astrai serve --model PATH --task embed``),
else the checkpoint says: a ``*ForSequenceClassification`` architecture scores; anything else embeds
(as sentence-transformers' files, ``modules.json``, say, or last-token pooling, normalised, without
them). Mean, CLS and max pooling are encoder recipes: a decoder's
earlier tokens never see the later ones, and such a checkpoint is refused.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future
from pathlib import Path

import torch
from torch import nn

from astrai.embedding.engine import ACTIVATIONS, EmbeddingEngine, Withdrawable, check_inputs, saved_activation
from astrai.embedding.pooling import Pooling
from astrai.errors import EngineNotReady, ModelFormatError

__all__ = ["DecoderPooler", "PoolingHead", "decoder_task", "load_decoder_pooler", "start_pooler"]

TASKS = ("embed", "score")
#: a causal LM's config.json key (vLLM's) that makes it a reranker scored by these tokens' logits:
#: ``["no", "yes"]`` for Qwen3-Reranker
FROM_TOKENS = "classifier_from_token"
#: a decoder pooler's KV pool: pages for the prompts being computed (each is freed when pooled)
KV_MEMORY_BYTES = 256 << 20
#: the longest input a decoder pooler takes by default (the pool may cap it lower)
MAX_INPUT_TOKENS = 8192


class PoolingHead(nn.Module):
    """A pooling model's head in place of the LM head: the rows as they are (an embedder) or a
    classifier's scores (``weight`` [labels, hidden])."""

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.weight is None else x @ self.weight.t()


def decoder_task(folder: Path, cfg: dict) -> str | None:
    """The pooling task a decoder checkpoint declares: "score" for a sequence classifier (or a
    causal LM scored by its tokens' logits, ``FROM_TOKENS``), "embed" for a sentence-transformers
    model (``modules.json``), None for a plain causal LM."""
    if any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ()):
        return "score"
    if cfg.get(FROM_TOKENS):
        return "score"
    return "embed" if (folder / "modules.json").is_file() else None


class _Pooled(Future):
    """A request's future: cancelling it aborts the request in the engine."""

    def __init__(self, engine: object, request_id: str) -> None:
        super().__init__()
        self._engine, self._rid = engine, request_id

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._engine.abort(self._rid)  # type: ignore[attr-defined]
        return cancelled


class DecoderPooler:
    """``EmbeddingEngine``'s interface over an ``InferenceEngine`` whose model has a ``PoolingHead``."""

    def __init__(
        self, engine: object, pooling: Pooling, task: str, name: str, activation: str = "Sigmoid"
    ) -> None:
        from astrai.sampling import SamplingParams

        self.engine, self.pooling, self.task, self.name = engine, pooling, task, name
        self.tokenizer = engine.tokenizer  # type: ignore[attr-defined]
        self.activation = activation
        config = engine.model.config  # type: ignore[attr-defined]
        self.vocab_size = config.vocab_size
        self.dimensions = config.hidden_size
        #: the sizes its vectors may be cut to (``loader.truncations``: () any; None: not cut)
        self.truncations: tuple[int, ...] | None = None
        limit = engine.context_limit  # type: ignore[attr-defined]
        self.context_limit = min(pooling.max_seq_length or limit, limit)
        self._params = SamplingParams(max_tokens=0, temperature=0.0)
        self.counters = {"requests": 0, "inputs": 0, "tokens": 0, "passes": 0}
        self._counting = threading.Lock()
        self._ids = iter(range(1 << 62))

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids as the checkpoint's tokenizer makes them (its special tokens too)."""
        return [list(ids) for ids in self.tokenizer.hf(texts, add_special_tokens=True)["input_ids"]]

    def encode_pairs(self, first: list[str], second: list[str]) -> tuple[list[list[int]], None]:
        """A classifier's inputs: each pair as the tokenizer joins two texts (sentence-transformers'
        ``CrossEncoder``), cut to ``context_limit``; no token types (a decoder has none)."""
        coded = self.tokenizer.hf(
            first, second, add_special_tokens=True, truncation="longest_first", max_length=self.context_limit
        )
        return [list(i) for i in coded["input_ids"]], None

    def check(self, inputs: list[list[int]]) -> None:
        """RequestRejected for an empty input, one longer than ``context_limit`` or an id outside
        the vocabulary."""
        check_inputs(inputs, self.context_limit, self.vocab_size)

    def submit(self, inputs: list[list[int]], types: object = None) -> list[Future]:
        """One future per input, resolving to its vector ([dimensions] float32, normalised where the
        checkpoint says) or a classifier's score (a float32 scalar through its activation)."""
        if not self.is_healthy():
            raise EngineNotReady("the embedding engine has been shut down")
        self.check(inputs)
        self.engine.check_room(len(inputs))  # type: ignore[attr-defined]
        with self._counting:
            self.counters["requests"] += 1
        futures: list[Future] = []
        try:
            for ids in inputs:
                rid = f"pool-{self.name}-{next(self._ids)}"
                future = _Pooled(self.engine, rid)
                self.engine.submit(  # type: ignore[attr-defined]
                    ids, self._params, on_done=self._resolver(future, len(ids)), request_id=rid
                )
                futures.append(future)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return futures

    def _resolver(self, future: Future, tokens: int):  # noqa: ANN202 (a callback)
        def done(result: object) -> None:  # on the scheduler thread
            if not future.set_running_or_notify_cancel():
                return
            vector = result.pooled  # type: ignore[attr-defined]
            if vector is None:
                error = result.error  # type: ignore[attr-defined]
                future.set_exception(
                    error
                    if isinstance(error, Exception)
                    else CancelledError(f"ended: {result.finish_reason}")  # type: ignore[attr-defined]
                )
                return
            with self._counting:
                self.counters["inputs"] += 1
                self.counters["tokens"] += tokens
            future.set_result(self._finish(torch.tensor(vector, dtype=torch.float32)))

        return done

    def _finish(self, vector: torch.Tensor) -> torch.Tensor:
        if self.task == "score":
            return ACTIVATIONS[self.activation](vector[0])
        return torch.nn.functional.normalize(vector, dim=0) if self.pooling.normalize else vector

    def embed(
        self,
        inputs: list[list[int]],
        types: object = None,
        timeout: float | None = None,
        futures: Withdrawable | None = None,
    ) -> torch.Tensor:
        """``submit``, then wait for every one (``EmbeddingEngine.embed``'s contract)."""
        return EmbeddingEngine.embed(self, inputs, types, timeout, futures)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.engine.shutdown()  # type: ignore[attr-defined]

    def is_healthy(self) -> bool:
        return self.engine.is_healthy()  # type: ignore[attr-defined]

    def get_stats(self) -> dict:
        """requests, inputs and tokens as ``EmbeddingEngine`` counts them; passes: engine steps."""
        with self._counting:
            stats = dict(self.counters)
        stats["passes"] = self.engine.scheduler.iterations  # type: ignore[attr-defined]
        return stats


def load_decoder_pooler(
    folder: Path, cfg: dict, task: str | None, dtype: torch.dtype, name: str, config: object = None
) -> DecoderPooler:
    """A ``DecoderPooler`` on a decoder checkpoint folder (see the module); ``config``: the engine's
    ``EngineConfig`` (its KV pool, batch and prefill budgets; prefix caching is turned off)."""
    from astrai.model import load_model

    task = task or decoder_task(folder, cfg) or "embed"
    if task not in TASKS:
        raise ModelFormatError(f"{folder}: task {task!r}: a pooling model serves one of {', '.join(TASKS)}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelFormatError(f"{folder}: bidirectional decoders (EmbeddingGemma) are not served")
    pooling = Pooling.from_folder(folder) if (folder / "modules.json").is_file() else Pooling("last", True)
    if task == "embed" and pooling.mode != "last":
        raise ModelFormatError(
            f"{folder}: {pooling.mode} pooling of a decoder; decoders are pooled at their last token"
        )
    head = None
    tokens = cfg.get(FROM_TOKENS) if task == "score" else None
    if task == "score" and not tokens:
        head = _score_weight(folder)
        if head is None or head.shape[0] != 1:
            raise ModelFormatError(
                f"{folder}: a reranker needs a one-label classifier head (score.weight [1, hidden]) "
                f"or {FROM_TOKENS} in config.json"
            )
    model, _tokenizer = load_model(str(folder), dtype=dtype, weights="dense")
    if tokens:
        head = _token_head(model, _tokenizer, tokens, str(folder / "config.json"))
    if head is not None and head.shape[1] != model.config.hidden_size:
        raise ModelFormatError(f"{folder}: score.weight {tuple(head.shape)} does not fit hidden size")
    activation = saved_activation(cfg, str(folder)) if task == "score" else "Sigmoid"
    return start_pooler(model, _tokenizer, head, task, pooling, name, config, activation)


def start_pooler(
    model: nn.Module,
    tokenizer: object,
    head: torch.Tensor | None,
    task: str,
    pooling: Pooling,
    name: str,
    config: object = None,
    activation: str = "Sigmoid",
) -> DecoderPooler:
    """``model`` (a loaded decoder) with ``head`` (None: the hidden rows) instead of its LM head, on
    an engine of its own (``config``: its ``EngineConfig``; None: ``KV_MEMORY_BYTES`` and inputs of
    up to ``MAX_INPUT_TOKENS``), behind a ``DecoderPooler``."""
    import dataclasses

    from astrai.config import EngineConfig
    from astrai.engine import InferenceEngine

    param = next(model.parameters())
    model.lm_head = PoolingHead(None if head is None else head.to(param.dtype))
    model.pooling = task
    model.config.final_logit_softcapping = None  # a language model's logits, not vectors
    if config is None:  # inputs of up to 8,192 tokens (fewer where the checkpoint says) in a small pool
        longest = min(pooling.max_seq_length or MAX_INPUT_TOKENS, MAX_INPUT_TOKENS)
        config = EngineConfig(kv_memory_bytes=KV_MEMORY_BYTES, max_seq_len=longest)
    engine_config = dataclasses.replace(config, prefix_caching=False, speculative=None)
    engine = InferenceEngine(model, tokenizer, engine_config, plugins=_no_plugins())
    return DecoderPooler(engine, pooling, task, name, activation)


def _token_head(model: nn.Module, tokenizer: object, tokens: object, where: str) -> torch.Tensor:
    """The one-label head of a causal LM scored by its tokens' logits (``FROM_TOKENS``): two tokens
    ``[no, yes]`` give the LM head's row of ``yes`` less that of ``no`` (the sigmoid of their
    logits' difference is ``yes``'s probability between the two, Qwen3-Reranker's score); one token
    its own row."""
    if (
        not isinstance(tokens, list)
        or len(tokens) not in (1, 2)
        or not all(isinstance(t, str) for t in tokens)
    ):
        raise ModelFormatError(f"{where}: {FROM_TOKENS} must list one or two tokens, not {tokens!r}")
    vocab = tokenizer.hf.get_vocab()  # type: ignore[attr-defined]
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ModelFormatError(f"{where}: {FROM_TOKENS}: {missing} not tokens of the model's vocabulary")
    rows = model.lm_head.weight.detach()[[vocab[t] for t in tokens]].float()
    return (rows[1] - rows[0] if len(tokens) == 2 else rows[0]).unsqueeze(0)


def _score_weight(folder: Path) -> torch.Tensor | None:
    from astrai.model.hf_loader import CLASSIFIER_HEAD, read_safetensors_folder

    found = read_safetensors_folder(folder, CLASSIFIER_HEAD)
    if set(found) - {"score.weight"}:
        raise ModelFormatError(f"{folder}: classifier tensors {sorted(found)}; only score.weight is read")
    return found.get("score.weight")


def _no_plugins() -> object:
    from astrai.hooks import PluginManager

    return PluginManager()
