"""``EmbeddingEngine``: an encoder model that turns inputs into vectors, batching whatever requests
are waiting into one forward pass.

Requests are token-id lists (``encode`` makes them from text as the checkpoint's tokenizer does,
with its special tokens). A worker thread takes the waiting inputs in arrival order, up to
``max_batch_tokens`` tokens (and ``max_batch_size`` inputs) a pass (an input longer than that runs
alone), runs the encoder once over them (``BertModel``: packed, padding only inside attention),
pools each input (``Pooling``) and resolves its future. Nothing is kept between passes: an encoder
has no cache. A future cancelled before its pass is left out of it.

``load_embedder(name_or_path)`` loads a checkpoint folder (or the known name ``minilm-l6``, a Hub
id) with its tokenizer and pooling.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from astrai.embedding.pooling import Pooling, pool
from astrai.errors import EngineNotReady, ModelFormatError, ModelNotFound, RequestRejected
from astrai.model.bert import BertConfig, BertModel

__all__ = ["EmbeddingEngine", "load_embedder"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Input:
    ids: list[int]
    future: Future


class EmbeddingEngine:
    """Vectors of token-id inputs from an encoder, batched (see the module)."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: object,
        pooling: Pooling,
        name: str = "embedder",
        max_batch_tokens: int = 8192,
        max_batch_size: int = 256,
    ) -> None:
        self.model, self.tokenizer, self.pooling, self.name = model, tokenizer, pooling, name
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        positions = model.config.max_position_embeddings
        #: the longest input served: the checkpoint's max_seq_length where it says, else its positions
        self.context_limit = min(pooling.max_seq_length or positions, positions)
        self.dimensions = model.config.hidden_size
        self._queue: queue.SimpleQueue[_Input | None] = queue.SimpleQueue()
        self._stopped = False
        self.counters = {"requests": 0, "inputs": 0, "tokens": 0, "passes": 0}
        self._thread = threading.Thread(target=self._loop, name=f"astrai-embed-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids with the tokenizer's special tokens (``[CLS] ... [SEP]``)."""
        return [list(ids) for ids in self.tokenizer.hf(texts, add_special_tokens=True)["input_ids"]]

    def check(self, inputs: list[list[int]]) -> None:
        """RequestRejected for an empty input, an id outside the vocabulary, or an input longer
        than ``context_limit`` (the message says which and by how much)."""
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(inputs):
            if not ids:
                raise RequestRejected(f"input {i} is empty")
            if len(ids) > self.context_limit:
                raise RequestRejected(
                    f"input {i} has {len(ids)} tokens; this model takes at most {self.context_limit}"
                )
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(f"input {i}: token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def submit(self, inputs: list[list[int]]) -> list[Future]:
        """One future per input, each resolving to its vector ([dimensions] float32); checked first
        (``check``). Raises EngineNotReady after ``shutdown``."""
        if self._stopped:
            raise EngineNotReady("the embedding engine has been shut down")
        self.check(inputs)
        self.counters["requests"] += 1
        futures = []
        for ids in inputs:
            future: Future = Future()
            self._queue.put(_Input(list(ids), future))
            futures.append(future)
        return futures

    def embed(self, inputs: list[list[int]], timeout: float | None = None) -> torch.Tensor:
        """[len(inputs), dimensions] float32: ``submit``, then wait for every vector."""
        return torch.stack([f.result(timeout) for f in self.submit(inputs)])

    def shutdown(self) -> None:
        """Stop the worker; inputs still waiting fail with EngineNotReady. Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)
            self._thread.join(timeout=30)

    def is_healthy(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    def get_stats(self) -> dict:
        return dict(self.counters)

    # ------------------------------------------------------------------ the worker

    def _batch(self, first: _Input) -> tuple[list[_Input], bool]:
        """``first`` and the inputs waiting behind it, within the budgets; whether a stop came."""
        batch, tokens = [first], len(first.ids)
        while len(batch) < self.max_batch_size:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            if tokens + len(item.ids) > self.max_batch_tokens:
                self._held = item  # the first of the next pass
                break
            batch.append(item)
            tokens += len(item.ids)
        return batch, False

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        self._held: _Input | None = None
        stop = False
        while not stop:
            item, self._held = (self._held, None) if self._held is not None else (self._queue.get(), None)
            if item is None:
                break
            batch, stop = self._batch(item)
            batch = [i for i in batch if i.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)
        leftover = [self._held] if self._held is not None else []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                leftover.append(item)
        for item in leftover:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineNotReady("the embedding engine has been shut down"))

    def _run(self, batch: list[_Input]) -> None:
        try:
            lengths = torch.tensor([len(i.ids) for i in batch])
            ids = torch.tensor([t for i in batch for t in i.ids])
            start = time.perf_counter()
            vectors = pool(self.model(ids, lengths), lengths, self.pooling)
            logger.debug(
                "embedded %d inputs (%d tokens) in %.3f s", len(batch), len(ids), time.perf_counter() - start
            )
        except Exception as exc:  # a failed pass fails its inputs, never the worker
            logger.exception("embedding pass failed")
            for item in batch:
                item.future.set_exception(exc)
            return
        self.counters["passes"] += 1
        self.counters["inputs"] += len(batch)
        self.counters["tokens"] += int(lengths.sum())
        for item, vector in zip(batch, vectors, strict=True):
            item.future.set_result(vector)


def load_embedder(name_or_path: str, dtype: torch.dtype = torch.float32, **engine: object) -> EmbeddingEngine:
    """An ``EmbeddingEngine`` on a BERT checkpoint folder (``config.json``, safetensors weights, a
    tokenizer, sentence-transformers' pooling files where it has them): a path, a known name
    (``minilm-l6``) or a Hub id. ``engine``: ``EmbeddingEngine``'s batch budgets. Raises
    ModelNotFound for nothing there or another kind of model, ModelFormatError for a malformed one."""
    from astrai.model.hf_loader import read_safetensors_folder
    from astrai.model.resolve import resolve_model
    from astrai.model.tokenizer import Tokenizer

    kind, folder = resolve_model(name_or_path)
    if kind != "hf":
        raise ModelNotFound(f"{name_or_path}: an embedding model is a checkpoint folder, not a GGUF file")
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "bert":
        raise ModelNotFound(
            f"{name_or_path}: model_type {cfg.get('model_type')!r} is not an embedding model astrai serves (bert)"
        )
    config = BertConfig.from_dict(cfg, str(folder))
    pooling = Pooling.from_folder(folder)
    model = BertModel(config)
    model.load_weights(read_safetensors_folder(folder), str(folder))
    model = model.to(dtype).eval()
    tokenizer = Tokenizer.from_pretrained(folder)
    if tokenizer.hf.cls_token_id is None and pooling.mode == "cls":
        raise ModelFormatError(f"{folder}: CLS pooling, but the tokenizer has no CLS token")
    name = Path(str(name_or_path)).name if Path(str(name_or_path)).exists() else str(name_or_path)
    return EmbeddingEngine(model, tokenizer, pooling, name=name, **engine)  # type: ignore[arg-type]
