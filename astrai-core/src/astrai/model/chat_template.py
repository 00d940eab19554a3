"""A chat template given by the user (``--chat-template``): a file, or an inline Jinja string.

``load_chat_template(value)`` decides which, as vLLM's ``--chat-template`` does: an existing file is
read; anything else that holds ``{{`` or ``{%`` is the template itself; the rest is a file that is
not there. The template is compiled at once with transformers' own Jinja environment (the one that
renders it), so a syntax error stops the start with its line, not the first chat request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from astrai.errors import ChatTemplateError

__all__ = ["ChatTemplate", "check_template", "load_chat_template", "template_info"]


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja ``text`` and where it came from: ``"file:<absolute path>"``, ``"inline"``
    or ``"checkpoint"`` (the model's own)."""

    text: str
    source: str

    @property
    def sha256(self) -> str:
        """The SHA-256 of the template's UTF-8 text, in hex: which template, without showing it."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def _compile(text: str) -> None:
    try:  # the very environment apply_chat_template renders with (its filters, {% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: plain Jinja's parser, with the loop controls
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(text)
        return
    _compile_jinja_template(text)


def check_template(template: ChatTemplate) -> ChatTemplate:
    """``template`` once it compiles; ChatTemplateError naming its source and the line otherwise."""
    from jinja2 import TemplateSyntaxError

    try:
        _compile(template.text)
    except TemplateSyntaxError as e:  # undefined filters and tests too (TemplateAssertionError)
        raise ChatTemplateError(f"chat template {template.source}: line {e.lineno}: {e.message}") from e
    return template


def load_chat_template(value: str) -> ChatTemplate:
    """The template ``value`` names: an existing file's text, or ``value`` itself when it holds Jinja
    markup (``{{`` or ``{%``). Raises ChatTemplateError for a file that is not there or cannot be
    read, and for a template that does not compile (naming the line)."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is no valid file name
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"chat template {path}: cannot be read ({e})") from e
        return check_template(ChatTemplate(text, f"file:{path.resolve()}"))
    if "{{" in value or "{%" in value:
        return check_template(ChatTemplate(value, "inline"))
    raise ChatTemplateError(
        f"chat template {value}: no such file (an inline template holds Jinja markup: '{{{{' or '{{%')"
    )


def template_info(template: ChatTemplate | None) -> dict[str, str] | None:
    """What ``/v1/models`` shows of the active template: its ``source`` and ``sha256`` (None: none)."""
    return None if template is None else {"source": template.source, "sha256": template.sha256}
