"""Embedding models: encoders whose pooled token states are the vectors of ``/v1/embeddings``
(``EmbeddingEngine``, ``load_embedder``; pooling as the checkpoint's sentence-transformers files say)."""

from astrai.embedding.engine import EmbeddingEngine, Withdrawable
from astrai.embedding.loader import is_pooling_model, load_embedder
from astrai.embedding.pooling import Pooling, pool

__all__ = ["EmbeddingEngine", "Pooling", "Withdrawable", "is_pooling_model", "load_embedder", "pool"]
