"""Tokenizer and chat template (a thin wrapper over a transformers fast tokenizer); the incremental
detokenizer that streams text token by token is ``astrai.model.detokenizer``.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.errors import ModelNotFound, RequestRejected
from astrai.model.byte_level import is_byte_level, max_piece_bytes, piece_bytes
from astrai.model.chat_template import ChatTemplate
from astrai.model.control_tokens import ContentMarks, control_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_PROBE = "ASTRAIPROBE7319"  # an assistant message body the chat template cannot alter
NO_TEMPLATE = "this model has no chat template (a base model?): start the server with --chat-template \
(a Jinja file or string), or send the prompt as written to /v1/completions"


def _flatten(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy OpenAI-style messages with list content joined into one string.

    Text parts are joined with "\\n" (vLLM's "string" content format); ``None``
    content (an assistant turn that only calls tools) becomes "". Raises
    RequestRejected for a non-text part.
    """
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestRejected(f"content part of type {kind!r} is not supported (text only)")
                texts.append(part.get("text", ""))
            content = "\n".join(texts)
        out.append({**message, "content": "" if content is None else content})
    return out


class Tokenizer:
    """Encode, decode and chat-template a model's text; ``hf`` is the wrapped transformers tokenizer."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase):
        self.hf = hf_tokenizer  # the wrapped transformers tokenizer
        text = hf_tokenizer.chat_template
        # the template in use (None: the model has none), until use_chat_template replaces it
        self.template = ChatTemplate(str(text), "checkpoint") if text else None
        self._eos_token_ids = self._find_eos_token_ids()
        self._bytes: dict[int, bytes] = {}  # token_bytes, per id
        self._controls: tuple[str, ...] | None = None  # control_tokens(hf), once asked
        self._pieces: tuple[frozenset[int], bool] | None = None  # added ids, byte-level: once asked

    @classmethod
    def from_gguf(cls, path: str | Path, reader: Any = None) -> Tokenizer:
        """Build the tokenizer (and chat template) from a GGUF file's ``tokenizer.*`` metadata;
        ``reader``: the file's open ``GGUFReader`` where the caller has one (not parsed again)."""
        from astrai.model.tokenizer_cache import gguf_tokenizer

        path = Path(path)
        if not path.is_file():
            raise ModelNotFound(f"{path}: no such GGUF file")
        return cls(gguf_tokenizer(path, reader))  # converted once per file (astrai.model.tokenizer_cache)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` / ``tokenizer_config.json`` from a local folder (never the hub)."""
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
        except (OSError, ValueError) as e:
            raise ModelNotFound(f"{folder}: no loadable tokenizer ({e})") from e

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it are matched as special tokens
        (a raw prompt is the client's whole model input). :meth:`encode_plain` for content."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with every added-token string in it (``<|im_end|>``) as plain text.

        Runs the backend's normalizer, pre-tokenizer and model without its added-token
        matching, leaving the shared tokenizer's state alone (transformers' own
        ``split_special_tokens`` flips a flag on it: unsafe with several threads). Text that
        holds no added-token string gets the ids :meth:`encode` gives it.
        """
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer: its split flag is per call
            return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = (
            [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        )
        return [token.id for split in splits for token in backend.model.tokenize(split)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, byte-exact: no clean-up of spaces before punctuation.

        Bytes that do not form complete UTF-8 characters decode to U+FFFD.
        """
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat template makes of OpenAI-style ``messages``; ``template_kwargs``
        are more variables for the template (``enable_thinking``), never transformers' own options.

        Raises RequestRejected when the model has no chat template (``NO_TEMPLATE``), the template
        fails on the conversation (the message names the template's error), a content part is
        not text, or a ``template_kwargs`` key names an option of ``apply_chat_template`` (a client
        must not swap the template or tokenize differently).
        """
        if not self.hf.chat_template:
            raise RequestRejected(NO_TEMPLATE)
        extra = dict(template_kwargs or {})
        reserved = set(inspect.signature(self.hf.apply_chat_template).parameters) | {"messages"}
        for key in extra:
            if key in reserved:
                raise RequestRejected(
                    f"chat_template_kwargs.{key} is an option of the template renderer, not a template variable",
                    param=f"chat_template_kwargs.{key}",
                )
        try:
            return self.hf.apply_chat_template(
                _flatten(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **extra,
            )
        except Exception as e:  # jinja2 errors, including the template's own raise_exception()
            raise RequestRejected(f"the chat template failed on this request: {type(e).__name__}: {e}") from e

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`; the template writes BOS/special tokens itself.

        The template's own special tokens are the only control tokens: a special-token string
        anywhere in ``messages`` or ``tools`` (``<|im_end|>`` typed in a user message, a tool
        result, a role) is encoded as plain text (``astrai.model.control_tokens``). Raises
        RequestRejected as :meth:`render_chat` does, and for such a string this vocabulary
        cannot spell as plain text.
        """
        marks = ContentMarks(self._control_tokens())
        marked_messages, marked_tools = marks.wrap(messages), marks.wrap(tools)
        if not marks.count:  # nothing to neutralise: one piece, the ids of the plain rendering
            return self.encode(self.render_chat(messages, tools, add_generation_prompt, template_kwargs))
        rendered = self.render_chat(marked_messages, marked_tools, add_generation_prompt, template_kwargs)
        return marks.encode(self, rendered)

    def _control_tokens(self) -> tuple[str, ...]:
        if self._controls is None:
            self._controls = control_tokens(self.hf)
        return self._controls

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a byte-level BPE token may hold part of a character).

        Special tokens give their text's UTF-8; ids the tokenizer does not know give b"".
        Memoised per id (log-probs ask for a handful of tokens per generated one).
        """
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._token_bytes(int(token_id))
        return found

    def _token_bytes(self, token_id: int) -> bytes:
        found = piece_bytes(self.hf.convert_ids_to_tokens(token_id), self._byte_level(token_id))
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8") if found is None else found

    def _byte_level(self, token_id: int) -> bool:
        """Whether ``token_id``'s piece is written in the byte-level alphabet (an added token's is not;
        transformers builds ``added_tokens_decoder`` anew per call: 10 ms for Gemma 3's 6,384)."""
        if self._pieces is None:
            self._pieces = frozenset(self.hf.added_tokens_decoder), is_byte_level(self.hf)
        return self._pieces[1] and token_id not in self._pieces[0]

    def max_token_bytes(self) -> int:
        """The most bytes one token stands for: ``token_bytes`` over the whole vocabulary, in bulk
        (``max_piece_bytes``; one call per id would take seconds on Gemma 3's 262,144). Not memoised."""
        return max_piece_bytes(self.hf, self._byte_level)

    def token_text(self, token_id: int) -> str:
        """Token ``token_id`` as text, as OpenAI log-probs show it (partial UTF-8 bytes as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: the tokenizer's EOS and the template's end-of-turn token."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def use_chat_template(self, template: ChatTemplate) -> None:
        """Render chats with ``template`` instead of the checkpoint's (``--chat-template``).

        Its end-of-turn token joins ``eos_token_ids`` (an engine built on this tokenizer stops there).
        """
        self.hf.chat_template = template.text
        self.template = template
        self._controls = None
        self._eos_token_ids = self._find_eos_token_ids()

    def _find_eos_token_ids(self) -> list[int]:
        ids = [] if self.hf.eos_token_id is None else [self.hf.eos_token_id]
        end = self._end_of_turn_token()
        if end is not None:
            end_id = self.hf.convert_tokens_to_ids(end)
            if end_id not in ids:
                ids.append(end_id)
        return ids

    def _end_of_turn_token(self) -> str | None:
        """The special token the chat template writes right after an assistant message, if any.

        Found by rendering a probe conversation: templates spell it differently
        (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``) and it need not be EOS.
        """
        if not self.hf.chat_template:
            return None
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.hf.apply_chat_template(probe, add_generation_prompt=False, tokenize=False)
        except Exception:  # a template that refuses the probe: no end-of-turn token to add
            logger.debug("chat template rejected the end-of-turn probe", exc_info=True)
            return None
        tail = text[text.rfind(_PROBE) + len(_PROBE) :].lstrip()
        specials = [t.content for t in self.hf.added_tokens_decoder.values() if t.special]
        for token in sorted(specials, key=len, reverse=True):
            if tail.startswith(token):
                return token
        return None
