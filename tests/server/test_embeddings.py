"""``POST /v1/embeddings`` of a real ``astrai serve --embedding-model minilm-l6`` beside the default
chat model: the official ``openai`` SDK (float and base64), LangChain's ``OpenAIEmbeddings`` and
litellm against sentence-transformers on the same files; inputs as token ids; what is refused and
how (OpenAI's error shape); both models in ``/v1/models``; chat streams unchanged while embeddings run."""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai.model.resolve import resolve_model

pytestmark = pytest.mark.slow  # the real default model and the real MiniLM

EMB = "minilm-l6"
TEXTS = [
    "A man is eating food.",
    "hi",
    "Embeddings map text to vectors, and similar texts to nearby vectors.",
    "¿Dónde está la biblioteca?",
]


@pytest.fixture(scope="module")
def served(start_server):
    return start_server("--embedding-model", EMB)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def oracle():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(resolve_model(EMB)[1]), device="cpu")


def _close(got: list[list[float]], want: Any, least: float = 0.9999) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == tuple(want.shape)
    assert F.cosine_similarity(got_t, want).min() >= least


def test_the_sdk_gets_sentence_transformers_vectors_as_floats_and_as_base64(served, client, oracle) -> None:
    """Left to itself the SDK asks for base64 and decodes it; asked for floats, it gets JSON numbers;
    asked for base64 explicitly, it hands over the string (little-endian float32)."""
    want = oracle.encode(TEXTS, convert_to_tensor=True)
    r = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == EMB
    _close([d.embedding for d in r.data], want)
    ids = sum(map(len, oracle.tokenizer(TEXTS)["input_ids"]))
    assert r.usage.prompt_tokens == r.usage.total_tokens == ids
    # each number the shortest that reads back as the float32 (OpenAI's form): the base64 bytes' values
    floats = np.array([d.embedding for d in r.data], dtype=np.float32)
    sdk = np.array([d.embedding for d in client.embeddings.create(model=EMB, input=TEXTS).data], np.float32)
    assert np.array_equal(sdk, floats)
    raw = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="base64").data
    assert np.array_equal(
        np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw]), floats
    )
    body = {"model": EMB, "input": TEXTS[:1]}
    text = httpx.post(served.url + "/v1/embeddings", json=body, timeout=60).text
    numbers = text.split('"embedding":[')[1].split("]")[0].split(",")
    assert len(numbers) == 384 and max(map(len, numbers)) <= 15  # float32's 9 digits at most, not 17


def test_token_ids_are_inputs_too(client, oracle) -> None:
    ids = oracle.tokenizer(TEXTS[:2])["input_ids"]
    texts = client.embeddings.create(model=EMB, input=TEXTS[:2])
    many = client.embeddings.create(model=EMB, input=ids)
    one = client.embeddings.create(model=EMB, input=ids[0])
    torch.testing.assert_close(
        torch.tensor([d.embedding for d in many.data]), torch.tensor([d.embedding for d in texts.data])
    )
    assert len(one.data) == 1
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), torch.tensor(texts.data[0].embedding))


def test_truncate_prompt_tokens_cuts_a_long_input_as_sentence_transformers_does(client, oracle) -> None:
    long = "the model reads this sentence again and again " * 60  # ~480 tokens: past the 256 it takes
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=EMB, input=long)
    assert refused.value.body["param"] == "input"
    assert refused.value.body["message"].startswith("input 0 has 48")
    assert "takes at most 256 (truncate_prompt_tokens cuts inputs)" in refused.value.body["message"]
    r = client.embeddings.create(model=EMB, input=long, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 256
    _close([r.data[0].embedding], oracle.encode([long], convert_to_tensor=True))  # (it cuts at 256)


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (
            {"model": "astrai", "input": "x"},
            400,
            "model",
            "astrai is a generation model; /v1/embeddings needs one of: minilm-l6",
        ),
        (
            {"model": "nope", "input": "x"},
            404,
            None,
            "The model `nope` does not exist or you do not have access to it.",
        ),
        (
            {"model": EMB, "input": "x", "dimensions": 64},
            400,
            "dimensions",
            "minilm-l6 does not support dimensions 64: its vectors have 384 and cannot be shortened",
        ),
        ({"model": EMB, "input": []}, 400, "input", "input must not be empty"),
        ({"model": EMB, "input": ["a", ""]}, 400, "input", "input must not hold an empty string"),
        (
            {"model": EMB, "input": [[101, 40000, 102]]},
            400,
            "input",
            "input 0: token id 40000 is outside the vocabulary (0..30521)",
        ),
        ({"model": EMB, "input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
        ({"model": EMB, "input": "x", "pooling": "max"}, 400, "pooling", None),
        ({"model": EMB, "input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    ],
)
def test_what_it_refuses_and_how(served, body, status, param, message) -> None:
    r = httpx.post(served.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    if message is not None:
        assert error["message"] == message


def test_a_generation_request_naming_the_embedder_is_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert (
        refused.value.body["message"]
        == "minilm-l6 is a pooling model: it serves /v1/embeddings, /v1/rerank and /v1/score"
    )
    assert refused.value.body["param"] == "model"


def test_the_model_list_holds_both(client) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"astrai", EMB}
    card = client.models.retrieve(EMB).model_dump()
    assert (card["task"], card["dimensions"], card["max_model_len"]) == ("embed", 384, 256)


def test_langchain_and_litellm_embed_through_it(served, oracle, monkeypatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm
    from langchain_openai import OpenAIEmbeddings

    want = oracle.encode(TEXTS, convert_to_tensor=True)
    # a server that is not OpenAI's: LangChain's own switch to send texts, not tiktoken ids
    lc = OpenAIEmbeddings(
        model=EMB, base_url=served.url + "/v1", api_key="none", check_embedding_ctx_length=False
    )
    _close(lc.embed_documents(TEXTS), want)
    _close([lc.embed_query(TEXTS[0])], want[:1])
    r = litellm.embedding(model=f"openai/{EMB}", input=TEXTS, api_base=served.url + "/v1", api_key="none")
    _close([d["embedding"] for d in r.data], want)


def test_chat_streams_keep_their_text_while_embeddings_run(client) -> None:
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]

    def chat() -> str:
        stream = client.chat.completions.create(
            model="astrai", messages=messages, max_tokens=48, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    alone = chat()
    texts: list[str] = []
    stop = threading.Event()

    def embed() -> None:
        while not stop.is_set():
            client.embeddings.create(model=EMB, input=TEXTS * 8)

    workers = [threading.Thread(target=embed) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        chats = [threading.Thread(target=lambda: texts.append(chat())) for _ in range(3)]
        for c in chats:
            c.start()
        for c in chats:
            c.join()
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert texts == [alone] * 3


def test_the_route_asks_for_the_key_and_answers_503_while_the_models_load(fakes) -> None:
    """On an app whose engine has not loaded yet (no model needed): the API key first, then 503."""
    from astrai_server.app import create_app
    from astrai_server.config import ServerSettings

    app = create_app(ServerSettings(api_key=["k"], embedding_model=[EMB]), None)
    body = {"model": EMB, "input": "x"}
    with fakes.serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/embeddings", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/embeddings", json=body, headers={"authorization": "Bearer k"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "the models are still loading"


QUERY = "How do cats behave?"
DOCS = [
    "Cats purr when they are content.",
    "Paris is the capital of France.",
    "Kittens sleep most of the day.",
]


def _post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=60)


def test_rerank_with_an_embedder_sorts_by_the_cosine_of_the_vectors(served, oracle) -> None:
    q = oracle.encode([QUERY], convert_to_tensor=True)
    d = oracle.encode(DOCS, convert_to_tensor=True)
    want = F.cosine_similarity(q, d).tolist()
    r = _post(served, "/v1/rerank", {"model": EMB, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -want[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}
    top = _post(
        served,
        "/rerank",
        {"model": EMB, "query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False},
    )
    assert top.json()["results"] == [
        {"index": results[0]["index"], "relevance_score": results[0]["relevance_score"]}
    ]
    objects = [{"text": t, "id": i} for i, t in enumerate(DOCS)]
    v2 = _post(served, "/v2/rerank", {"model": EMB, "query": QUERY, "documents": objects})
    assert [x["document"]["id"] for x in v2.json()["results"]] == [x["index"] for x in results]


def test_score_one_against_many_and_pairwise(served, oracle) -> None:
    vectors = oracle.encode([QUERY, *DOCS], convert_to_tensor=True)
    one = _post(served, "/v1/score", {"model": EMB, "text_1": QUERY, "text_2": DOCS}).json()
    assert [x["index"] for x in one["data"]] == [0, 1, 2] and one["object"] == "list"
    want = F.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    assert [x["score"] for x in one["data"]] == pytest.approx(want, abs=1e-5)
    pairs = _post(served, "/score", {"model": EMB, "text_1": DOCS[:2], "text_2": DOCS[1:]}).json()
    want = F.cosine_similarity(vectors[1:3], vectors[2:4]).tolist()
    assert [x["score"] for x in pairs["data"]] == pytest.approx(want, abs=1e-5)
    bad = _post(served, "/v1/score", {"model": EMB, "text_1": DOCS[:2], "text_2": DOCS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    assert (
        bad.json()["error"]["message"]
        == "text_1 has 2 texts and text_2 3: give one text_1, or as many as text_2"
    )


@pytest.fixture(scope="module")
def reranker(start_server, tmp_path_factory):
    """A server with four pooling models beside the chat model: MiniLM as ``embed``, the
    cross-encoder as ``rerank``, and the tiny decoder embedder and reranker (``pooling_models``) as
    ``qembed`` and ``qrank``. Returns the server and the folders by served name."""
    from pooling_models import write_cross_encoder, write_decoder_pooler

    base = tmp_path_factory.mktemp("pooling")
    folders = {
        "rerank": write_cross_encoder(base / "cross-encoder"),
        "qembed": write_decoder_pooler(base / "qembed", "embed"),
        "qrank": write_decoder_pooler(base / "qrank", "score"),
    }
    models = ",".join([EMB, *map(str, folders.values())])
    flags = ["--embedding-model", models, "--served-embedding-model-name", "embed,rerank,qembed,qrank"]
    return start_server(*flags), folders


def test_a_cross_encoder_reranks_with_transformers_scores(reranker) -> None:
    from pooling_models import transformers_scores

    served, folders = reranker
    want = transformers_scores(folders["rerank"], [QUERY] * 3, DOCS)
    r = _post(served, "/v1/rerank", {"model": "rerank", "query": QUERY, "documents": DOCS})
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -want[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    score = _post(served, "/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": DOCS}).json()
    assert [x["score"] for x in score["data"]] == pytest.approx(want, abs=1e-5)
    card = httpx.get(served.url + "/v1/models/rerank", timeout=10).json()
    assert card["task"] == "score" and "dimensions" not in card
    refused = _post(served, "/v1/embeddings", {"model": "rerank", "input": "x"})
    assert refused.status_code == 400
    assert (
        refused.json()["error"]["message"]
        == "rerank serves /v1/rerank and /v1/score; /v1/embeddings needs one of: embed, qembed"
    )
    assert [m["id"] for m in httpx.get(served.url + "/v1/models", timeout=10).json()["data"]] == [
        "astrai",
        "embed",
        "rerank",
        "qembed",
        "qrank",
    ]
    embedded = _post(served, "/v1/embeddings", {"model": "embed", "input": DOCS})
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == 3


def test_decoders_embed_and_rerank_as_sentence_transformers_and_transformers(reranker) -> None:
    import transformers as tf
    from sentence_transformers import SentenceTransformer

    served, folders = reranker
    texts = ["the cat sat on the mat", "a dog", "what is the way to find the sun when it rain"]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    got = client.embeddings.create(model="qembed", input=texts, encoding_format="float")
    want = SentenceTransformer(str(folders["qembed"]), device="cpu").encode(texts, convert_to_tensor=True)
    _close([d.embedding for d in got.data], want)
    assert got.usage.prompt_tokens == sum(len(t.split()) + 1 for t in texts)  # each ends with </s>
    card = httpx.get(served.url + "/v1/models/qembed", timeout=10).json()
    assert (card["task"], card["dimensions"]) == ("embed", 64)
    short = client.embeddings.create(model="qembed", input=texts, dimensions=32, encoding_format="float")
    _close([d.embedding for d in short.data], F.normalize(want[:, :32], dim=1))
    odd = _post(served, "/v1/embeddings", {"model": "qembed", "input": "a", "dimensions": 20})
    assert odd.status_code == 400 and odd.json()["error"] == {
        "message": "qembed does not support dimensions 20: its vectors can be cut to 16, 32, 64",
        "type": "invalid_request_error",
        "param": "dimensions",
        "code": None,
    }
    query, docs = "the sun", ["the sun is up when the day is long", "a dog sat on the mat", "rain"]
    tokenizer = tf.AutoTokenizer.from_pretrained(folders["qrank"])
    model = tf.AutoModelForSequenceClassification.from_pretrained(folders["qrank"]).eval()
    with torch.no_grad():
        batch = tokenizer([query] * 3, docs, padding=True, return_tensors="pt")
        scores = torch.sigmoid(model(**batch).logits[:, 0]).tolist()
    r = _post(served, "/v1/rerank", {"model": "qrank", "query": query, "documents": docs, "top_n": 2})
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -scores[i])[:2]
    for x in results:
        assert x["relevance_score"] == pytest.approx(scores[x["index"]], abs=1e-5)
    refused = _post(served, "/v1/embeddings", {"model": "qrank", "input": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    too_long = _post(served, "/v1/embeddings", {"model": "qembed", "input": [[5] * 300]})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["message"].startswith("input 0 has 300 tokens; qembed takes at most 256")
    stats = httpx.get(served.url + "/stats", timeout=10).json()["pooling"]
    assert stats["qembed"]["inputs"] >= 3 and stats["qrank"]["inputs"] >= 3


def test_stats_and_metrics_count_the_pooling_requests_apart(served, client) -> None:
    before = httpx.get(served.url + "/stats", timeout=10).json()
    client.embeddings.create(model=EMB, input=TEXTS)
    _post(served, "/v1/rerank", {"model": EMB, "query": QUERY, "documents": DOCS})
    after = httpx.get(served.url + "/stats", timeout=10).json()
    pooled, was = after["pooling"][EMB], before["pooling"][EMB]
    assert pooled["requests"] - was["requests"] == 2
    assert pooled["inputs"] - was["inputs"] == len(TEXTS) + 1 + len(DOCS)
    assert pooled["passes"] > was["passes"] and pooled["tokens"] > was["tokens"]
    assert after["total_tasks"] == before["total_tasks"]  # the chat model's counters: untouched
    text = httpx.get(served.url + "/metrics", timeout=10).text
    for name, key in [
        ("requests", "requests"),
        ("inputs", "inputs"),
        ("prompt_tokens", "tokens"),
        ("passes", "passes"),
    ]:
        line = f'astrai:pooling_{name}_total{{model_name="{EMB}"}}'
        assert any(
            row.startswith(line) and float(row.split()[-1]) == pooled[key] for row in text.splitlines()
        ), name


def test_a_pooling_model_alone_serves_its_routes_and_refuses_generation(start_server, oracle) -> None:
    served = start_server("--model", EMB, "--served-model-name", "minilm")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["minilm"]
    r = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    _close([d.embedding for d in r.data], oracle.encode(TEXTS, convert_to_tensor=True))
    message = "minilm is a pooling model: this server answers /v1/embeddings, /v1/rerank and /v1/score"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert (
        refused.value.body["message"]
        == "minilm is a pooling model: it serves /v1/embeddings, /v1/rerank and /v1/score"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="other", prompt="hi")
    assert refused.value.body["message"] == message
    tokenize = httpx.post(served.url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert tokenize.status_code == 400 and tokenize.json()["error"]["message"] == message
    stats = httpx.get(served.url + "/stats", timeout=10).json()
    assert set(stats) == {"pooling"} and stats["pooling"]["minilm"]["inputs"] == len(TEXTS)


def test_dtype_sets_what_every_pooling_model_computes_in(start_server, served, oracle) -> None:
    """``--dtype bfloat16`` (the default where the CPU computes bf16 natively): the pooling model
    served alone and the one of ``--embedding-model`` both compute in bf16, as their start logs say;
    their vectors are not float32's (the ``served`` fixture's) but within a cosine of 0.9995 of
    sentence-transformers'."""
    bf16 = start_server(
        "--model", EMB, "--served-model-name", "solo", "--embedding-model", EMB, "--dtype", "bfloat16"
    )
    body = {"input": TEXTS, "encoding_format": "float"}
    vectors = {}
    for name, at in (("solo", bf16), (EMB, bf16), ("float32", served)):
        r = httpx.post(
            at.url + "/v1/embeddings", json={**body, "model": name if at is bf16 else EMB}, timeout=60
        )
        assert r.status_code == 200, r.text
        vectors[name] = [d["embedding"] for d in r.json()["data"]]
    assert vectors["solo"] == vectors[EMB] != vectors["float32"]
    _close(vectors["solo"], oracle.encode(TEXTS, convert_to_tensor=True), least=0.9995)
    log = bf16.log()
    assert "serving the pooling model minilm-l6 as 'solo' alone (embed, bfloat16)" in log
    assert "pooling model ready: minilm-l6 as 'minilm-l6' (embed, bfloat16;" in log


def test_task_embed_serves_a_causal_lm_as_an_embedder_alone(start_server, tmp_path) -> None:
    import shutil

    from pooling_models import write_decoder_pooler
    from sentence_transformers import SentenceTransformer

    folder = write_decoder_pooler(tmp_path / "qembed", "embed")
    plain = shutil.copytree(folder, tmp_path / "plain")  # the same weights, no pooling files
    for name in ("modules.json", "sentence_bert_config.json"):
        (plain / name).unlink()
    served = start_server("--model", str(plain), "--task", "embed", "--served-model-name", "q")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    texts = ["the cat sat on the mat", "a dog"]
    got = client.embeddings.create(model="q", input=texts, encoding_format="float")
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    _close([d.embedding for d in got.data], want)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="q", prompt="the")
    stats = httpx.get(served.url + "/stats", timeout=10).json()
    assert set(stats) == {"pooling"} and stats["pooling"]["q"]["inputs"] == 2


def test_a_client_that_leaves_withdraws_the_inputs_not_yet_encoded(served) -> None:
    """Hundreds of long inputs take many passes; the client gives up after a second (perhaps while
    they are still being tokenized):
    the passes stop short of them (the server logs the request as 499, abandoned)."""
    stats = lambda: httpx.get(served.url + "/stats", timeout=10).json()["pooling"][EMB]  # noqa: E731
    before = stats()
    texts = [f"sentence {i} " + "about many different things " * 40 for i in range(800)]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/embeddings", json={"model": EMB, "input": texts}, timeout=1.0)
    time.sleep(2)  # passes already running finish
    after = stats()
    assert after["requests"] - before["requests"] in (0, 1)  # (0: it left before its inputs went in)
    assert after["inputs"] - before["inputs"] < len(texts) // 2
    time.sleep(0.5)
    assert stats()["inputs"] == after["inputs"]  # nothing more is encoded for it


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--served-embedding-model-name", "a"],
            "--served-embedding-model-name gives 1 names for 0 --embedding-model",
        ),
        (["--embedding-model", "minilm-l6", "--served-embedding-model-name", "a,b"], "gives 2 names for 1"),
        (["--embedding-model", "minilm-l6", "--served-embedding-model-name", "astrai"], "a name of its own"),
        (["--embedding-model", "minilm-l6,minilm-l6"], "a name of its own"),
    ],
)
def test_pooling_model_names_that_do_not_fit_stop_serve_with_status_2(flags, message, capsys) -> None:
    from astrai_server.cli import serve_main

    assert serve_main(flags) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- hostile bodies

_junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_inputs = st.one_of(
    st.text(max_size=40),
    st.lists(st.text(max_size=20), max_size=5),
    st.lists(st.integers(-5, 40000), max_size=8),
    st.lists(st.lists(st.integers(-5, 40000), max_size=6), max_size=4),
    _junk,
)
_POOLING_BODIES = {
    "/v1/embeddings": (
        {"model": EMB, "input": "hello"},
        {
            "input": _inputs,
            "encoding_format": st.sampled_from(["float", "base64", "int8", ""]) | _junk,
            "dimensions": st.integers(-3, 2**40) | _junk,
            "truncate_prompt_tokens": st.integers(-3, 2**40) | _junk,
            "user": _junk,
            "model": st.sampled_from([EMB, "astrai", ""]) | _junk,
        },
    ),
    "/v1/rerank": (
        {"model": EMB, "query": "q", "documents": ["a", "b"]},
        {
            "query": st.text(max_size=20) | _junk,
            "documents": st.lists(
                st.text(max_size=20) | st.fixed_dictionaries({"text": st.text(max_size=9)}), max_size=4
            )
            | _junk,
            "top_n": st.integers(-3, 2**40) | _junk,
            "return_documents": _junk,
        },
    ),
    "/v1/score": (
        {"model": EMB, "text_1": "a", "text_2": ["b"]},
        {"text_1": _inputs, "text_2": _inputs},
    ),
}


@pytest.mark.parametrize("route", list(_POOLING_BODIES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_body_gets_a_server_error(served, route, data) -> None:
    """Bodies around each pooling route's valid one, some fields replaced by values near their type
    or by junk: a success or a 4xx in OpenAI's error shape, never a 5xx."""
    base, fields = _POOLING_BODIES[route]
    body = dict(base)
    for name in data.draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = data.draw(fields[name], label=name)
    raw = json.dumps(body, allow_nan=True)
    r = httpx.post(served.url + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error", r.text
