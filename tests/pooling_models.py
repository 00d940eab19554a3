"""The cross-encoder the rerank tests serve: no cross-encoder weights can be downloaded here, so the
real all-MiniLM-L6-v2 (``minilm-l6``) is the encoder under a random one-label head, written as a
``BertForSequenceClassification`` checkpoint with transformers (which is then the oracle)."""

from __future__ import annotations

from pathlib import Path


def write_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """The checkpoint folder (config, safetensors, tokenizer) of MiniLM with a random classifier
    and pooler; returns ``folder``."""
    import torch
    import transformers as tf

    from astrai.model.resolve import resolve_model

    source = resolve_model("minilm-l6")[1]
    config = tf.BertConfig.from_pretrained(source, num_labels=1)
    model = tf.BertForSequenceClassification.from_pretrained(source, config=config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=gen) * 0.5)
        model.classifier.bias.fill_(0.1)
        pooler = model.bert.pooler.dense.weight
        pooler.copy_(torch.randn(pooler.shape, generator=gen) * 0.05)
    model.save_pretrained(folder)
    tf.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def transformers_scores(folder: Path, first: list[str], second: list[str]) -> list[float]:
    """``AutoModelForSequenceClassification``'s sigmoid of each pair's logit (float32)."""
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = tokenizer(first, second, padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        return torch.sigmoid(model(**batch).logits[:, 0]).tolist()


#: the words of the tiny decoder poolers' tokenizer (ids after the four special tokens)
WORDS = (
    "the a of to and in is it that for on with as was by at be this are from or an which but not what "
    "all were when we there can more one their has if will each about how up out them then she many "
    "some so these would other into his her him time like could two see way been call who its now "
    "find long down day did get come made may part cat dog sat mat sun rain query passage document yes no"
).split()


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer (``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2, ``</s>`` 3) that ends every text
    with ``</s>``, and a pair as ``a </s> b </s>``: the end-of-text token that decoder embedders
    (Qwen3-Embedding) pool at."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)


def write_decoder_pooler(folder: Path, task: str, seed: int = 0) -> Path:
    """A tiny random Qwen3 pooling checkpoint: "embed" saves the bare ``Qwen3Model`` (no ``model.``
    prefix, as Qwen3-Embedding is saved) with sentence-transformers' last-token pooling and
    normalisation, Matryoshka sizes 16 and 32; "score" a one-label ``Qwen3ForSequenceClassification``. Returns ``folder``."""
    import json

    import torch
    import transformers as tf

    config = tf.Qwen3Config(
        vocab_size=4 + len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        num_labels=1,
    )
    torch.manual_seed(seed)
    cls = {"embed": tf.Qwen3Model, "score": tf.Qwen3ForSequenceClassification, "yes-no": tf.Qwen3ForCausalLM}[
        task
    ]
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    if task == "yes-no":  # Qwen3-Reranker's recipe, in vLLM's key: the logits of "no" and "yes"
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**saved, "classifier_from_token": ["no", "yes"]}))
    if task == "embed":  # a Matryoshka model: its vectors may be cut to 16 or 32 dimensions
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**saved, "matryoshka_dimensions": [16, 32]}))
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True})
        )
        (folder / "2_Normalize").mkdir()
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return folder
