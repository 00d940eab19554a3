"""A user's chat template (``--chat-template``) and a checkpoint's generation defaults
(``generation_config.json``), below the server."""

from __future__ import annotations

import json

import pytest

from astrai.errors import ChatTemplateError, ModelFormatError, RequestRejected
from astrai.model.chat_template import ChatTemplate, load_chat_template
from astrai.model.generation_config import generation_defaults, read_generation_config
from astrai.model.tokenizer import Tokenizer

TURNS = (
    "{% for m in messages %}{% if m['content'] == 'forbidden' %}{{ raise_exception('no forbidden words') }}"
    "{% endif %}{{ m['role'] + ' ' + m['content'] }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant ' }}{% endif %}"
)


def _word_tokenizer(chat_template: str | None) -> Tokenizer:
    """A tiny WordLevel tokenizer whose EOS is ``<|end_of_text|>``, with ``<|eot_id|>`` special."""
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
        eos_token="<|end_of_text|>",
        additional_special_tokens=["<|eot_id|>"],
    )
    hf.chat_template = chat_template
    return Tokenizer(hf)


def test_a_file_is_read_and_named_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "t.jinja").write_text(TURNS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    template = load_chat_template("t.jinja")
    assert template.text == TURNS
    assert template.source == f"file:{(tmp_path / 't.jinja').resolve()}"
    assert len(template.sha256) == 64 and template.sha256 == ChatTemplate(TURNS, "inline").sha256


def test_jinja_markup_that_is_no_file_is_the_template_itself():
    assert load_chat_template(TURNS) == ChatTemplate(TURNS, "inline")
    assert load_chat_template("{{ messages[0]['content'] }}").source == "inline"


def test_a_name_without_markup_is_a_missing_file():
    with pytest.raises(ChatTemplateError, match=r"chat template nowhere\.jinja: no such file"):
        load_chat_template("nowhere.jinja")


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", 2, "unexpected '}'"),
        ("text\n\n{% if %}", 3, "Expected an expression"),
        ("a\n{{ messages | no_such_filter }}", 2, "No filter named 'no_such_filter'"),
    ],
    ids=["brace", "empty-if", "unknown-filter"],
)
def test_a_template_that_does_not_compile_is_refused_naming_its_line(tmp_path, text, line, says):
    with pytest.raises(ChatTemplateError, match=rf"^chat template inline: line {line}: .*{says}"):
        load_chat_template(text)
    (tmp_path / "bad.jinja").write_text(text, encoding="utf-8")
    with pytest.raises(ChatTemplateError, match=rf"^chat template file:.*bad\.jinja: line {line}: "):
        load_chat_template(str(tmp_path / "bad.jinja"))


def test_a_users_template_replaces_the_checkpoints_and_its_end_of_turn_ends_generation():
    tok = _word_tokenizer(None)
    assert tok.template is None and tok.eos_token_ids == [2]
    with pytest.raises(RequestRejected, match="no chat template.*--chat-template"):
        tok.render_chat([{"role": "user", "content": "hi"}])
    tok.use_chat_template(load_chat_template(TURNS))
    assert tok.template.source == "inline" and tok.chat_template == TURNS
    assert tok.eos_token_ids == [2, 3]  # the template's <|eot_id|> ends a turn
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "user hi<|eot_id|>assistant "
    assert _word_tokenizer(TURNS).template == ChatTemplate(TURNS, "checkpoint")


def test_a_template_that_fails_on_a_request_is_a_rejection_naming_the_error():
    tok = _word_tokenizer(TURNS)
    with pytest.raises(RequestRejected, match="chat template failed .*TemplateError: no forbidden words"):
        tok.render_chat([{"role": "user", "content": "forbidden"}])


# ---------------------------------------------------------------- generation defaults


def _folder(tmp_path, generation_config):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_generation_config_gives_its_sampling_values(tmp_path):
    folder = _folder(
        tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}
    )
    assert read_generation_config(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(str(folder)) == (
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        str(folder / "generation_config.json"),
    )


def test_do_sample_false_is_greedy_and_bad_values_are_left_out(tmp_path, caplog):
    folder = _folder(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": 7, "min_p": None})
    assert read_generation_config(folder) == {"temperature": 0.0}
    assert "top_p=7 is left out" in caplog.text


def test_no_generation_config_no_defaults(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert generation_defaults(str(tmp_path)) == ({}, None)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelFormatError, match="generation_config.json: not a JSON object"):
        read_generation_config(tmp_path)


def test_the_default_model_is_greedy_by_default(default_model_path):
    expected = ({"temperature": 0.0}, "astrai's defaults for smollm2-135m")
    assert generation_defaults(None) == expected
    assert generation_defaults(str(default_model_path)) == expected  # its file, by path


def test_engine_calls_that_leave_a_value_out_take_the_default(tiny_engine):
    engine = tiny_engine(generation_defaults={"temperature": 0.0})
    greedy = engine.generate("ab", max_tokens=12, temperature=0.0)
    assert engine.generate("ab", max_tokens=12) == greedy
    sampled = {engine.generate("ab", max_tokens=12, temperature=2.0, seed=s) for s in range(4)}
    assert sampled != {greedy}  # an explicit value wins
