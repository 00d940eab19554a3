"""GenerateResult: the caller's handle on one request, written by the scheduler thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.logprobs import TokenLogprob
    from astrai.request import FinishReason, Request

__all__ = ["GenerateResult"]


class GenerateResult:
    """The caller's handle on one request; written only by the scheduler thread.

    Non-streaming callers block in ``wait_completion()`` (a Condition); streaming
    callers wait on ``wait()`` (an Event set by every new piece and at the end) and
    read ``pieces()``. ``on_piece(piece)`` (a per-token callback) and
    ``on_done(result)`` run on the scheduler thread and must not block; an
    exception from ``on_piece`` fails this request only. After completion:
    ``text``, ``output_ids`` (EOS included when generated), ``prompt_tokens``,
    ``completion_tokens``, ``finish_reason``, ``stop_sequence``, ``error``, ``cached_tokens`` (prompt
    tokens its prefix cache namespace served at its first admission).

    Log-probs, when ``SamplingParams.logprobs`` / ``prompt_logprobs`` asked for them:
    ``logprobs`` (one ``TokenLogprob`` per generated token, growing as tokens are accepted,
    before the piece holding their text is delivered), ``prompt_logprobs`` (``None`` for the
    first prompt token, then one per prompt token; complete before the first piece) and
    ``piece_ends`` (for the k-th piece, how many generated tokens had been accepted when it
    was delivered: its log-probs are ``logprobs[piece_ends[k - 1]:piece_ends[k]]``).
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        on_piece: Callable[[str], None] | None = None,
        on_done: Callable[[GenerateResult], None] | None = None,
    ) -> None:
        self.request_id, self.prompt_tokens = request_id, prompt_tokens
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # the request's own list once bound (see bind)
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.piece_ends: list[int] = []
        self._request: Request | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_sequence: str | None = None
        self.error: BaseException | None = None
        self.cached_tokens = 0
        self.pooled: list[float] | None = None  # a pooling model's vector of the prompt (Request.pooled)
        self._on_piece, self._on_done = on_piece, on_done
        self._pieces: list[str] = []
        self._done = False
        self._cond = threading.Condition()
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        return self._done

    @property
    def text(self) -> str:
        with self._cond:
            return "".join(self._pieces)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def bind(self, request: Request) -> None:
        """Share ``request``'s log-prob lists (written on the scheduler thread, read after each piece)."""
        self._request = request
        self.logprobs = request.logprobs

    def deliver_piece(self, piece: str) -> None:
        with self._cond:
            self._pieces.append(piece)
            self.piece_ends.append(len(self.logprobs))
            self._prompt_logprobs()
            self._event.set()
        if self._on_piece is not None:
            self._on_piece(piece)

    def deliver_final(self, request: Request) -> None:
        with self._cond:
            self.output_ids = list(request.output_ids)
            self._prompt_logprobs()
            self.finish_reason, self.stop_sequence = request.finish_reason, request.stop_sequence
            self.error = request.error
            self.cached_tokens = max(request.cached_tokens, 0)
            self.pooled = request.pooled
            self._done = True
            self._cond.notify_all()
            self._event.set()
        if self._on_done is not None:
            self._on_done(self)

    def _prompt_logprobs(self) -> None:
        request = self._request
        if not self.prompt_logprobs and request is not None and request.params.prompt_logprobs is not None:
            if (
                len(request.prompt_logprobs) == len(request.prompt_ids) - 1
            ):  # complete (not an aborted prefill)
                self.prompt_logprobs = [None, *request.prompt_logprobs]

    def wait_completion(self, timeout: float | None = None) -> bool:
        """Block until the request is over (no timeout by default); False if ``timeout`` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a new piece arrives or the request ends; False if ``timeout`` passed."""
        return self._event.wait(timeout)

    def pieces(self) -> Iterator[str]:
        """Yield the text pieces as they arrive, until the request ends (one consumer)."""
        seen = 0
        while True:
            self._event.wait()
            with self._cond:
                self._event.clear()
                new, done = self._pieces[seen:], self._done
            seen += len(new)
            yield from new
            if done:
                return

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise self.error
