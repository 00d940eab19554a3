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
