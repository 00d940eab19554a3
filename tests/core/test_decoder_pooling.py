"""Decoders as pooling models (``astrai.embedding.decoder``): a tiny random Qwen3 embedder saved as
Qwen3-Embedding is (a bare ``Qwen3Model``, last-token pooling, normalised) against
sentence-transformers, and a one-label ``Qwen3ForSequenceClassification`` reranker against
transformers, through the generation scheduler: chunked, preempted, aborted, with the pool's
invariants checked after each test."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from astrai.config import EngineConfig
from astrai.embedding import load_embedder
from astrai.errors import ModelFormatError, RequestRejected

TEXTS = [
    "the cat sat on the mat",
    "a dog",
    " ".join(["what is the way to find the sun when it rain and the day is long"] * 4),
    "query",
    "many of them come out when the sun is up and the day is long",
    "it",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pooling_models import write_decoder_pooler

    base = tmp_path_factory.mktemp("decoder-poolers")
    return {task: write_decoder_pooler(base / task, task) for task in ("embed", "score", "yes-no")}


@pytest.fixture(scope="module")
def oracle(folders):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folders["embed"]), device="cpu").encode(TEXTS, convert_to_tensor=True)


@pytest.fixture
def pooler(pool_guard):
    """``pooler(folder, **EngineConfig fields)``: shut down after the test, its pool checked."""
    made = []

    def make(folder, task=None, **config):
        p = load_embedder(str(folder), task=task, engine_config=EngineConfig(**config) if config else None)
        made.append(p)
        return p

    yield make
    for p in made:
        p.shutdown()
        pool_guard(p.engine.pool)


def _cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(got, want.float(), dim=1)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_prefill_tokens": 16, "page_size": 4},
        {"n_tokens": 80, "page_size": 4, "max_prefill_tokens": 24},
    ],
    ids=["one-pass", "chunked", "tight-pool"],
)
def test_embeddings_of_a_mixed_batch_are_sentence_transformers(folders, oracle, pooler, config) -> None:
    p = pooler(folders["embed"], **config)
    assert (p.task, p.dimensions, p.pooling.mode, p.pooling.normalize) == ("embed", 64, "last", True)
    ids = p.encode(TEXTS)
    assert all(i[-1] == 3 for i in ids)  # the tokenizer's end-of-text token: the one pooled
    vectors = p.embed(ids)
    assert vectors.shape == (len(TEXTS), 64)
    assert _cosines(vectors, oracle).min() >= 0.9999
    assert torch.linalg.vector_norm(vectors, dim=1) == pytest.approx([1.0] * len(TEXTS), abs=1e-5)
    stats = p.get_stats()
    assert (stats["requests"], stats["inputs"], stats["tokens"]) == (1, len(TEXTS), sum(map(len, ids)))
    engine = p.engine.get_stats()
    assert engine["kv_tokens_in_use"] == 0 and engine["kv_tokens_cached"] == 0  # nothing kept
    budget = config.get("max_prefill_tokens", 2048)  # the steps it took: chunks within the budget,
    assert p.engine.scheduler.iterations >= -(-sum(map(len, ids)) // budget)
    if "n_tokens" in config:  # and prompts that wait for the pages of others to come back
        assert sum(map(len, ids)) > config["n_tokens"] and engine["kv_tokens_total"] == config["n_tokens"]


def test_a_rerankers_scores_are_transformers(folders, pooler) -> None:
    import transformers as tf

    first = ["the cat", "what is the sun", "query", "the day"]
    second = ["a dog sat on the mat", "the sun is up when the day is long", "passage", "rain"]
    tokenizer = tf.AutoTokenizer.from_pretrained(folders["score"])
    model = tf.AutoModelForSequenceClassification.from_pretrained(folders["score"]).eval()
    with torch.no_grad():
        batch = tokenizer(first, second, padding=True, return_tensors="pt")
        want = torch.sigmoid(model(**batch).logits[:, 0])
    p = pooler(folders["score"])
    assert p.task == "score"
    ids, types = p.encode_pairs(first, second)
    assert types is None and ids == tokenizer(first, second)["input_ids"]  # the tokenizer's own pairs
    scores = p.embed(ids)
    assert scores.shape == (4,)
    assert scores.tolist() == pytest.approx(want.tolist(), abs=1e-5)


def test_a_causal_lm_scored_by_its_yes_and_no_logits_is_transformers(folders, pooler) -> None:
    import transformers as tf

    first = ["the cat", "what is the sun", "query"]
    second = ["a dog sat on the mat", "the sun is up when the day is long", "passage"]
    tokenizer = tf.AutoTokenizer.from_pretrained(folders["yes-no"])
    model = tf.AutoModelForCausalLM.from_pretrained(folders["yes-no"]).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    want = []
    with torch.no_grad():
        for a, b in zip(first, second, strict=True):
            logits = model(**tokenizer(a, b, return_tensors="pt")).logits[0, -1]
            want.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
    p = pooler(folders["yes-no"])
    assert p.task == "score"
    scores = p.embed(p.encode_pairs(first, second)[0])
    assert scores.tolist() == pytest.approx(want, abs=1e-5)


def test_what_the_task_and_checkpoint_allow(folders, pooler, tmp_path) -> None:
    import shutil

    with pytest.raises(ModelFormatError, match="encoder serves what its checkpoint is"):
        load_embedder("minilm-l6", task="score")
    with pytest.raises(ModelFormatError, match="one-label classifier head"):
        pooler(folders["embed"], task="score")
    mean = shutil.copytree(folders["embed"], tmp_path / "mean")
    (mean / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(
        ModelFormatError, match="mean pooling of a decoder; decoders are pooled at their last"
    ):
        pooler(mean)
    odd = shutil.copytree(folders["yes-no"], tmp_path / "odd")
    saved = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**saved, "classifier_from_token": ["no", "maybe"]}))
    with pytest.raises(ModelFormatError, match=r"classifier_from_token: \['maybe'\] not tokens of the model"):
        pooler(odd)
    plain = shutil.copytree(folders["embed"], tmp_path / "plain")
    for name in ("modules.json", "sentence_bert_config.json"):
        (plain / name).unlink()
    p = pooler(plain)  # a decoder named as an embedding model, no pooling files: last token, normalised
    assert (p.task, p.pooling.mode, p.pooling.normalize) == ("embed", "last", True)
    vector = p.embed(p.encode(TEXTS[:1]))
    assert torch.linalg.vector_norm(vector) == pytest.approx(1.0, abs=1e-5)


def test_bad_inputs_are_refused_whole(folders, pooler) -> None:
    p = pooler(folders["embed"], max_seq_len=64)
    assert p.context_limit == 64
    for inputs, message in [
        ([[5, 6], []], "input 1 is empty"),
        ([[5] * 65], "input 0 has 65 tokens; this model takes at most 64"),
        ([[5, 10**6]], "input 0: token id 1000000 is outside the vocabulary"),
    ]:
        with pytest.raises(RequestRejected, match=message):
            p.embed(inputs)
    assert p.get_stats()["requests"] == 0


def test_a_withdrawn_request_is_aborted_and_frees_its_pages(folders, pooler) -> None:
    from astrai.embedding import Withdrawable

    p = pooler(folders["embed"], max_prefill_tokens=8, page_size=4)
    futures = Withdrawable()
    failed: list[BaseException] = []
    long = [[5 + (i % 80) for i in range(200)]] * 8

    def run() -> None:
        try:
            p.embed(long, futures=futures)
        except BaseException as exc:  # noqa: BLE001 (the test reads it)
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while len(futures) < 8 and not failed:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    futures.withdraw()
    thread.join(30)
    assert failed and type(failed[0]).__name__ == "CancelledError"
    deadline = time.monotonic() + 10
    while p.engine.get_stats()["active_tasks"] or p.engine.get_stats()["waiting_queue"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert p.engine.get_stats()["kv_tokens_in_use"] == 0
    assert p.embed(p.encode(TEXTS[:2])).shape == (2, 64)  # and it serves on


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_gguf_embedder_pools_its_last_token_as_transformers(folders, pooler, tmp_path, qtype) -> None:
    import transformers as tf
    from families import hf_config
    from gguf import GGMLQuantizationType
    from gguf_families import write_gguf

    causal = tmp_path / "causal"  # the family tests' tiny Qwen3 (its GGUF vocabulary has 300 tokens)
    torch.manual_seed(3)
    tf.Qwen3ForCausalLM(hf_config("qwen3")).save_pretrained(causal)
    path = tmp_path / "embedder.gguf"
    kind = None if qtype is None else GGMLQuantizationType[qtype]
    held = write_gguf(causal, path, kind, metadata={"qwen3.pooling_type": 3})  # llama.cpp's LAST
    hf = tf.AutoModelForCausalLM.from_pretrained(causal).eval()
    loaded = hf.load_state_dict(held, strict=False)  # the file's values (dequantized)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}
    inputs = [[5, 17, 40, 3], [9, 3], [30 + (i % 40) for i in range(57)]]
    with torch.no_grad():
        want = torch.stack([hf.model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in inputs])
    p = pooler(path)
    assert (p.task, p.pooling.mode, p.pooling.normalize) == ("embed", "last", True)
    got = p.embed(inputs)
    assert _cosines(got, torch.nn.functional.normalize(want, dim=1)).min() >= 0.9999
    mean = tmp_path / "mean.gguf"
    write_gguf(causal, mean, metadata={"qwen3.pooling_type": 1})
    with pytest.raises(ModelFormatError, match="mean pooling of a decoder"):
        pooler(mean)
    with pytest.raises(ModelFormatError, match="a GGUF reranker is not served"):
        pooler(path, task="score")
