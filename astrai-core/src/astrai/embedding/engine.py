"""``EmbeddingEngine``: an encoder model that turns inputs into vectors (an embedder) or into
relevance scores (a cross-encoder: ``task`` "score"), batching whatever requests are waiting into one
forward pass.

Requests are token-id lists (``encode`` makes them from text as the checkpoint's tokenizer does,
with its special tokens). A worker thread takes the waiting inputs in arrival order, up to
``max_batch_tokens`` tokens (and ``max_batch_size`` inputs) a pass (an input longer than that runs
alone; 2,048 by default: on 2 cores, passes of 8,192 tokens ran a fifth slower, their MLP's
activations out of cache), waiting a moment for the clients it has just answered where they come
back (``astrai.embedding.gather``), runs the encoder once over them (``BertModel``: packed, padding only inside attention),
pools each input (``Pooling``), or scores it with the cross-encoder's head, and resolves its future.
A cross-encoder's input is a pair, ``encode_pairs``' ids and token types; its score is the head's one
logit through the activation its config names (sentence-transformers' ``activation_fn``: Sigmoid,
the default for one label as in sentence-transformers and vLLM, or Identity for the raw logit). Nothing is kept between passes: an encoder
has no cache. A future cancelled before its pass is left out of it.

``astrai.embedding.loader.load_embedder(name_or_path)`` loads a checkpoint folder (or the known name
``minilm-l6``, a Hub id) with its tokenizer and pooling.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

import torch

from astrai.embedding.gather import Gatherer
from astrai.embedding.pooling import Pooling, pool
from astrai.errors import EngineNotReady, ModelFormatError, RequestRejected
from astrai.extension.backend.policy import load_backends
from astrai.model.bert import BertModel

__all__ = ["ACTIVATIONS", "EmbeddingEngine", "Withdrawable", "check_inputs", "saved_activation"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Input:
    ids: list[int]
    types: list[int] | None
    future: Future
    at: float  # perf_counter() on arrival
    opens: bool  # the first input of its request
    closes: bool  # its request's last


class Withdrawable(list):
    """The futures a request submitted (``EmbeddingEngine.embed(futures=...)``), which another thread
    may ``withdraw``: those not yet in a pass are cancelled, and so is any added afterwards (a
    client that left while its texts were still being tokenized)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.withdrawn = False

    def add(self, futures: list[Future]) -> None:
        with self._lock:
            self.extend(futures)
            if self.withdrawn:
                for future in futures:
                    future.cancel()

    def withdraw(self) -> None:
        with self._lock:
            self.withdrawn = True
            for future in self:
                future.cancel()


#: sentence-transformers' activation names -> the function on a cross-encoder's logit
ACTIVATIONS = {"Sigmoid": torch.sigmoid, "Identity": lambda x: x}


def saved_activation(cfg: dict, where: str) -> str:
    """The cross-encoder's activation, as sentence-transformers saved it in ``config.json``
    (``sentence_transformers.activation_fn``, or the older ``sbert_ce_default_activation_function``):
    a dotted class path whose last part names it; Sigmoid where none is saved."""
    saved = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function"
    )
    name = str(saved).rpartition(".")[2] if saved else "Sigmoid"
    if name not in ACTIVATIONS:
        raise ModelFormatError(f"{where}: activation {saved!r} is not supported ({', '.join(ACTIVATIONS)})")
    return name


class EmbeddingEngine:
    """Vectors of token-id inputs from an encoder, batched (see the module)."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: object,
        pooling: Pooling,
        name: str = "embedder",
        max_batch_tokens: int = 2048,
        max_batch_size: int = 256,
        activation: str = "Sigmoid",
        regather: float = 0.5,
    ) -> None:
        load_backends()  # their fused kernels (the encoder's attention), as an engine's start does
        self.model, self.tokenizer, self.pooling, self.name = model, tokenizer, pooling, name
        #: "embed" (vectors) or "score" (a cross-encoder's relevance of each pair)
        self.task = "score" if model.config.num_labels else "embed"
        self.activation = activation
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        positions = model.config.max_position_embeddings
        #: the longest input served: the checkpoint's max_seq_length where it says, else its positions
        self.context_limit = min(pooling.max_seq_length or positions, positions)
        self.dimensions = model.config.hidden_size
        #: the sizes its vectors may be cut to (``loader.truncations``: () any; None: not cut)
        self.truncations: tuple[int, ...] | None = None
        #: how long a pass may wait for the clients the last one answered, as a share of its time
        self._gatherer = Gatherer(max_batch_tokens, max_batch_size, regather)
        self._stopped = False
        self.counters = {"requests": 0, "inputs": 0, "tokens": 0, "passes": 0}
        self._counting = threading.Lock()  # (submitters and the worker both count)
        self._thread = threading.Thread(target=self._loop, name=f"astrai-embed-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids with the tokenizer's special tokens (``[CLS] ... [SEP]``)."""
        return [list(ids) for ids in self.tokenizer.hf(texts, add_special_tokens=True)["input_ids"]]

    def encode_pairs(self, first: list[str], second: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """A cross-encoder's inputs: each ``(first[i], second[i])`` as one sequence (``[CLS] a [SEP] b
        [SEP]``), its ids and token types; cut to ``context_limit`` from the longer text where too long,
        as sentence-transformers' ``CrossEncoder`` does."""
        coded = self.tokenizer.hf(
            first, second, add_special_tokens=True, truncation="longest_first", max_length=self.context_limit
        )
        return [list(i) for i in coded["input_ids"]], [list(t) for t in coded["token_type_ids"]]

    def check(self, inputs: list[list[int]]) -> None:
        """RequestRejected for an empty input, an id outside the vocabulary, or an input longer
        than ``context_limit`` (the message says which and by how much)."""
        check_inputs(inputs, self.context_limit, self.model.config.vocab_size)

    def submit(self, inputs: list[list[int]], types: list[list[int]] | None = None) -> list[Future]:
        """One future per input, each resolving to its vector ([dimensions] float32) or, for a
        cross-encoder, its score (a float32 scalar); ``types``: each input's token types (None:
        all 0). Checked first (``check``). Raises EngineNotReady after ``shutdown``."""
        if self._stopped:
            raise EngineNotReady("the embedding engine has been shut down")
        self.check(inputs)
        with self._counting:
            self.counters["requests"] += 1
        futures = []
        for i, ids in enumerate(inputs):
            future: Future = Future()
            kinds = None if types is None else list(types[i])
            item = _Input(list(ids), kinds, future, time.perf_counter(), i == 0, i == len(inputs) - 1)
            self._gatherer.put(item)
            futures.append(future)
        return futures

    def embed(
        self,
        inputs: list[list[int]],
        types: list[list[int]] | None = None,
        timeout: float | None = None,
        futures: Withdrawable | None = None,
    ) -> torch.Tensor:
        """[len(inputs), dimensions] float32 vectors, or [len(inputs)] scores of a cross-encoder:
        ``submit``, then wait for every one. ``futures``: where the submitted futures go, so that
        another thread can withdraw them (inputs not yet in a pass are then left out; this call
        raises ``CancelledError``)."""
        if futures is not None and futures.withdrawn:
            raise CancelledError("withdrawn before it was submitted")
        submitted = self.submit(inputs, types)
        if futures is not None:
            futures.add(submitted)
        return torch.stack([f.result(timeout) for f in submitted])

    def shutdown(self) -> None:
        """Stop the worker; inputs still waiting fail with EngineNotReady. Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._gatherer.stop()
            self._thread.join(timeout=30)

    def is_healthy(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    def get_stats(self) -> dict:
        """requests (submitted), inputs and tokens (encoded), passes (forward passes) so far."""
        with self._counting:
            return dict(self.counters)

    # ------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        stop = False
        while not stop:
            batch, stop = self._gatherer.next_pass()
            batch = [i for i in batch if i.future.set_running_or_notify_cancel()]
            if batch:
                started = time.perf_counter()
                self._run(batch)
                self._gatherer.ended(sum(i.closes for i in batch), started)
        for item in self._gatherer.leftover():
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineNotReady("the embedding engine has been shut down"))

    def _run(self, batch: list[_Input]) -> None:
        try:
            lengths = torch.tensor([len(i.ids) for i in batch])
            ids = torch.tensor([t for i in batch for t in i.ids])
            types = None
            if any(i.types is not None for i in batch):
                types = torch.tensor([t for i in batch for t in (i.types or [0] * len(i.ids))])
            start = time.perf_counter()
            hidden = self.model(ids, lengths, types)
            if self.task == "score":
                vectors = ACTIVATIONS[self.activation](self.model.logits(hidden, lengths).float()[:, 0])
            else:
                vectors = pool(hidden, lengths, self.pooling)
            logger.debug(
                "embedded %d inputs (%d tokens) in %.3f s", len(batch), len(ids), time.perf_counter() - start
            )
        except Exception as exc:  # a failed pass fails its inputs, never the worker
            logger.exception("embedding pass failed")
            for item in batch:
                item.future.set_exception(exc)
            return
        with self._counting:
            self.counters["passes"] += 1
            self.counters["inputs"] += len(batch)
            self.counters["tokens"] += int(lengths.sum())
        for item, vector in zip(batch, vectors, strict=True):
            item.future.set_result(vector)


def check_inputs(inputs: list[list[int]], limit: int, vocab: int) -> None:
    """RequestRejected for an empty input, one longer than ``limit`` tokens, or an id outside
    ``0 .. vocab - 1`` (the message says which input and why)."""
    for i, ids in enumerate(inputs):
        if not ids:
            raise RequestRejected(f"input {i} is empty")
        if len(ids) > limit:
            raise RequestRejected(f"input {i} has {len(ids)} tokens; this model takes at most {limit}")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"input {i}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
