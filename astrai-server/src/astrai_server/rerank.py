"""Relevance of texts to a query: ``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``, the
shapes vLLM, Jina and Cohere clients send) and vLLM's ``POST /v1/score`` (also ``/score``), on the
pooling models of ``--embedding-model`` (``astrai_server.embeddings``).

A cross-encoder (a ``BertForSequenceClassification`` checkpoint: ``task`` "score") reads each
(query, document) pair as one input and its head gives the score, through the activation its
config names (sigmoid by default, as sentence-transformers' ``CrossEncoder`` and vLLM). An
embedding model scores a pair by the cosine similarity of their vectors, as llama-server and vLLM
do for bi-encoders. Inputs longer than the model takes are cut to fit, as sentence-transformers
cuts them (a pair from its longer text first).

Rerank: ``query``, ``documents`` (strings, or objects with a ``text``), ``top_n`` (the best n;
absent or 0: all), ``return_documents`` (default true); results sorted by ``relevance_score``, each
with its ``index`` in ``documents``. Score: ``text_1`` and ``text_2`` each a string or a list; one
against many, or pairwise for two lists of one length; ``data`` in order.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from astrai.errors import RequestRejected
from astrai_server.request_parts import Strict

__all__ = ["RerankRequest", "ScoreRequest", "pooling_routes", "rerank_answer", "score_answer"]


class Document(BaseModel):
    """A document given as an object (Jina's shape): its ``text``; other keys are kept unread."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(Strict):
    model: str
    query: str
    documents: list[str | Document] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True


class ScoreRequest(Strict):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]


def _scores(engine: Any, first: list[str], second: list[str], futures: list) -> tuple[list[float], int]:
    """The score of each pair (first[i], second[i]) and the tokens read."""
    if engine.task == "score":
        ids, types = engine.encode_pairs(first, second)
        return engine.embed(ids, types, futures=futures).tolist(), sum(map(len, ids))
    texts = list(dict.fromkeys(first + second))  # each distinct text once
    coded = engine.tokenizer.hf(
        texts, add_special_tokens=True, truncation=True, max_length=engine.context_limit
    )
    ids = [list(i) for i in coded["input_ids"]]
    vectors = dict(zip(texts, engine.embed(ids, futures=futures), strict=True))
    a = torch.stack([vectors[t] for t in first])
    b = torch.stack([vectors[t] for t in second])
    return F.cosine_similarity(a, b).tolist(), sum(map(len, ids))


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts or any(not t for t in texts):
        raise RequestRejected(f"{param} must hold at least one text and no empty one", param=param)
    return texts


def rerank_answer(req: RerankRequest, engine: Any, name: str, futures: list) -> dict[str, Any]:
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    if not req.query or any(not t for t in texts):
        raise RequestRejected(
            "query and documents must not be empty", param="documents" if req.query else "query"
        )
    scores, tokens = _scores(engine, [req.query] * len(texts), texts, futures)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or None]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            doc = req.documents[i]
            result["document"] = {"text": doc} if isinstance(doc, str) else doc.model_dump()
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


def score_answer(req: ScoreRequest, engine: Any, name: str, futures: list) -> dict[str, Any]:
    first, second = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise RequestRejected(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2",
            param="text_2",
        )
    scores, tokens = _scores(engine, first, second, futures)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def pooling_routes(check_key: Any) -> dict[str, Any]:
    """Path -> endpoint of every pooling route: embeddings, rerank (three paths), score (two)."""
    from astrai_server.embeddings import embeddings_endpoint, pooling_endpoint

    both = ("score", "embed")
    routes = {"/v1/embeddings": embeddings_endpoint(check_key)}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        routes[path] = pooling_endpoint(check_key, path, RerankRequest, rerank_answer, both)
    for path in ("/v1/score", "/score"):
        routes[path] = pooling_endpoint(check_key, path, ScoreRequest, score_answer, both)
    return routes
