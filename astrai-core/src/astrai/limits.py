"""``RequestLimits``: what one request may make the scheduler thread do for it, bounded at submit.

The scheduler thread serves every request in one loop, so a request's per-token work is everyone's
latency. Stop strings are matched per token (``astrai.stopping``: an automaton, linear in the text,
but built from the strings and held per request) and ``logit_bias`` entries are added per step:
both are bounded here, checked once when the request is submitted (``RequestRejected``, a 400
naming the field, before any grammar is compiled for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from astrai.errors import RequestRejected

if TYPE_CHECKING:
    from astrai.sampling.params import SamplingParams

__all__ = ["RequestLimits"]


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request's sampling parameters (``check``). The defaults take whatever OpenAI's
    and Anthropic's APIs accept (OpenAI: 4 stop strings, 300 ``logit_bias`` entries)."""

    max_stop_sequences: int = 64  # stop strings of one request
    max_stop_length: int = 256  # characters of one stop string
    max_logit_bias: int = 300  # entries of logit_bias

    def __post_init__(self) -> None:
        for name in ("max_stop_sequences", "max_stop_length", "max_logit_bias"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def check(self, params: SamplingParams) -> None:
        """RequestRejected (``param`` set) when ``params`` is past a bound."""
        if len(params.stop) > self.max_stop_sequences:
            raise RequestRejected(
                f"stop holds {len(params.stop)} strings; at most {self.max_stop_sequences} are accepted "
                "(--max-stop-sequences)",
                param="stop",
            )
        longest = max(map(len, params.stop), default=0)
        if longest > self.max_stop_length:
            raise RequestRejected(
                f"a stop string is {longest} characters long; at most {self.max_stop_length} are accepted "
                "(--max-stop-length)",
                param="stop",
            )
        if len(params.logit_bias) > self.max_logit_bias:
            raise RequestRejected(
                f"logit_bias holds {len(params.logit_bias)} entries; "
                f"at most {self.max_logit_bias} are accepted (--max-logit-bias)",
                param="logit_bias",
            )
