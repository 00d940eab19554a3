"""Sampling parameters of one request, on the host: a contract importable without torch (the step's
batch of them as device tensors is ``astrai.sampling.batch.SamplingBatch``)."""

from __future__ import annotations

import math
import numbers
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from astrai.errors import RequestRejected
from astrai.grammar.base import GrammarSpec
from astrai.logprobs import MAX_LOGPROBS

__all__ = ["SamplingParams"]

MIN_TEMPERATURE = 0.01
"""Smallest non-zero temperature: a lower one is raised to it (vLLM's rule), since dividing logits by
less overflows float32 into inf/nan; use 0 for greedy."""

_FLOAT32_MAX = 3.4028234663852886e38


def _field(name: str) -> str:
    """The request field a message's ``name`` is about (``logit_bias[5]`` -> ``logit_bias``)."""
    return name.replace("[", " ").split()[0]


def brief_repr(value: Any) -> str:
    """``repr(value)`` for an error message, cut short (a huge int's repr may even raise)."""
    try:
        text = repr(value)
    except ValueError:  # holds an int beyond sys.get_int_max_str_digits()
        return (
            f"an integer of {value.bit_length()} bits"
            if isinstance(value, int)
            else f"a {type(value).__name__}"
        )
    return text if len(text) <= 60 else text[:57] + "..."


def finite(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool) that a float32 tensor holds as a finite value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value) and abs(float(value)) <= _FLOAT32_MAX
    except OverflowError:  # an int beyond float's range
        return False


def _real(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not finite(value):
        raise RequestRejected(f"{name} must be a finite number, got {brief_repr(value)}", param=_field(name))
    if value > hi or value < lo or (lo_open and value == lo):
        raise RequestRejected(
            f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {brief_repr(value)}",
            param=_field(name),
        )
    return float(value)


def _integer(name: str, value: Any, lo: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestRejected(f"{name} must be an integer, got {brief_repr(value)}", param=_field(name))
    if lo is not None and value < lo:
        raise RequestRejected(f"{name} must be >= {lo}, got {brief_repr(value)}", param=_field(name))
    return int(value)


def _token_id(key: Any) -> int:
    # JSON object keys are strings: OpenAI clients send {"50256": -100}.
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    return _integer("logit_bias token id", key, 0)


@dataclass
class SamplingParams:
    """How one request chooses its tokens. Validated on construction.

    ``None`` for a field with a non-``None`` default means that default (``stop``,
    ``logit_bias`` and ``extra`` become empty).

    Every value that reaches a tensor is bounded here or, where the bound is the model's, at
    submit (``SamplingPipeline.prepare`` with the vocabulary size), so a request's parameters
    can fail only that request, never a batched step: reals are finite and in range, a
    temperature in ``(0, MIN_TEMPERATURE)`` is raised to ``MIN_TEMPERATURE``, a seed of any
    size is taken modulo 2**64 (``SamplingBatch``), and at submit a ``top_k`` at or above the
    vocabulary size becomes 0 (off: it keeps every token, as vLLM treats it) while
    ``logit_bias`` and ``stop_token_ids`` ids outside the vocabulary are refused.

    Raises:
        RequestRejected: a value is out of range or of the wrong type (the message names it).
    """

    # the engine API's default (generate(), submit()); each protocol sends its own, its HTTP default
    max_tokens: int = 256  # 0: only the prompt is computed (its log-probs), nothing is generated
    temperature: float = 1.0  # 0 = greedy (argmax of the penalised logits)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off; >= the vocabulary size is off too (set to 0 at submit)
    min_p: float = 0.0  # 0 = off; drop tokens less likely than min_p times the most likely one
    stop: list[str] = field(default_factory=list)  # a single str is wrapped into a list
    stop_token_ids: list[int] = field(default_factory=list)  # end the request like EOS (even with ignore_eos)
    seed: int | None = None  # None: fresh randomness every step; any int (the noise takes it modulo 2**64)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; HF/vLLM: over prompt and output tokens, > 1 discourages
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None  # constrained decoding: the output must match it (astrai.grammar)
    logprobs: int | None = None  # None: off; k: each generated token's log-prob and the k best (k <= 20)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    # a thinking model's thinking ends after this many tokens (the engine writes its end-of-thinking
    # text, the answer follows); None: no budget but max_tokens
    thinking_budget: int | None = None
    strategy: str | None = None  # extra SamplingStrategy entry-point name (plugins, e.g. "min_p")
    extra: dict[str, Any] = field(default_factory=dict)  # parameters of plugin strategies

    def __post_init__(self) -> None:
        for f in fields(self):  # None (JSON null) means "use the default" for scalar fields
            if getattr(self, f.name) is None and f.default not in (MISSING, None):
                setattr(self, f.name, f.default)
        self.max_tokens = _integer("max_tokens", self.max_tokens, 0)
        self.temperature = _real("temperature", self.temperature, 0.0, 2.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = _integer("top_k", self.top_k, 0)
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.repetition_penalty = _real(
            "repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True
        )
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, None)
        self.stop = self._check_stop(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestRejected(
                f"stop_token_ids must be a list of token ids, got {brief_repr(self.stop_token_ids)}",
                param="stop_token_ids",
            )
        self.stop_token_ids = [_integer("stop_token_ids[]", t, 0) for t in self.stop_token_ids]
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise RequestRejected(
                f"grammar must be a GrammarSpec, got {brief_repr(self.grammar)}", param="grammar"
            )
        if self.grammar is not None and self.min_tokens:
            raise RequestRejected(
                "min_tokens cannot be combined with a grammar (it decides where the output ends)",
                param="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _integer(name, getattr(self, name), 0))
                if getattr(self, name) > MAX_LOGPROBS:
                    raise RequestRejected(
                        f"{name} must be <= {MAX_LOGPROBS}, got {getattr(self, name)}", param=_field(name)
                    )
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, dict):
            raise RequestRejected(
                f"logit_bias must be an object of token id -> bias, got {brief_repr(self.logit_bias)}",
                param="logit_bias",
            )
        self.logit_bias = {
            _token_id(k): _real(f"logit_bias[{brief_repr(k)}]", v, -100.0, 100.0)
            for k, v in self.logit_bias.items()
        }
        if not isinstance(self.ignore_eos, bool):
            raise RequestRejected(
                f"ignore_eos must be a boolean, got {brief_repr(self.ignore_eos)}", param="ignore_eos"
            )
        if self.strategy is not None and (not isinstance(self.strategy, str) or not self.strategy):
            raise RequestRejected(
                f"strategy must be a non-empty string or null, got {brief_repr(self.strategy)}",
                param="strategy",
            )
        if self.extra is None:
            self.extra = {}
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise RequestRejected(
                f"extra must be an object with string keys, got {brief_repr(self.extra)}", param="extra"
            )

    @staticmethod
    def _check_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestRejected(
                f"stop must be a non-empty string or a list of them, got {brief_repr(stop)}", param="stop"
            )
        return list(stop)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Some penalty reads the request's tokens (frequency, presence or repetition)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first (no penalty, no logit bias, no banned
        tokens, no plugin strategy): the token is the argmax of the model's logits."""
        return (
            self.temperature == 0.0
            and not (self.penalised or self.logit_bias or self.min_tokens)
            and self.strategy is None
            and self.grammar is None
        )
