"""Image-text checkpoints (Gemma 3 4B and up) serve their text model: HF's Gemma3ForConditionalGeneration
folder, its language model's tensors under ``language_model.``, its vision tower left unread."""

from __future__ import annotations

import json

import pytest
import torch
from families import SIZES, forward_all, load_astrai, prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gemma3_image_text(tmp_path_factory):
    """A tiny random Gemma3ForConditionalGeneration (six text layers, window 8, a one-layer SigLIP
    tower) saved as transformers saves it, and the model."""
    import transformers as tf

    text = tf.Gemma3TextConfig(**SIZES, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16)
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = tf.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name:  # Gemma's (1 + w) norms: small offsets; matrices of unit rows
                p.copy_(
                    0.2 * torch.randn(p.shape, generator=gen)
                    if p.dim() == 1
                    else torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
                )
    folder = tmp_path_factory.mktemp("gemma3-image-text")
    model.save_pretrained(folder)
    return folder, model


def test_the_text_model_of_an_image_text_checkpoint_gives_transformers_logits(gemma3_image_text):
    folder, hf = gemma3_image_text
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "gemma3" and "hidden_size" not in saved  # the layout this reads
    model = load_astrai(folder)
    assert model.config.architecture == "gemma3_text" and model.config.num_hidden_layers == 6
    assert sum(1 for w in model.config.windows if w) == 5  # five local layers to one global
    for ids in prompts(2, seed=4):
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0]
        got = forward_all(model, ids, [len(ids)])
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * want.abs().max())


def test_an_image_text_config_without_a_text_model_type_is_refused(tmp_path):
    from astrai.errors import ModelNotFound
    from astrai.model.hf_config import hf_config

    with pytest.raises(ModelNotFound, match="without a text model_type"):
        hf_config(tmp_path, {"model_type": "gemma3", "text_config": {"hidden_size": 64}})
