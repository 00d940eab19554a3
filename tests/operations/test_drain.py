"""Graceful drain against a real ``astrai serve`` (issue 17).

SIGTERM during a stream: from that moment ``/health`` is 503 ``draining`` and new requests get
503 in their protocol's shape, the stream still completes with its terminator, and the process
exits 0. Past ``--shutdown-timeout`` the streams in flight are aborted: finish reason ``abort``
(OpenAI) and a complete Anthropic event sequence, then exit 0. A second signal exits at once.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real default model, in a subprocess

CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"


def chat(max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def message(max_tokens: int) -> dict:
    return {
        "model": "astrai",
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        # (vLLM's extension: the story would end in about 55 tokens, which a fast machine writes
        # before a 1 s shutdown timeout)
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }


class Stream(threading.Thread):
    """One streaming request on its own thread: its status and non-empty lines; ``started`` at its first
    event."""

    def __init__(self, url: str, path: str, payload: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.payload = url, path, payload
        self.started = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []

        self.error: httpx.TransportError | None = None  # the connection broke

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120) as client:
                with client.stream("POST", self.path, json=self.payload) as r:
                    self.status = r.status_code
                    for line in r.iter_lines():
                        if line:
                            self.lines.append(line)
                            if line.startswith("data: "):
                                self.started.set()
        except httpx.TransportError as exc:
            self.error = exc

    def events(self) -> list[dict]:
        return [
            json.loads(x.removeprefix("data: "))
            for x in self.lines
            if x.startswith("data: ") and x != "data: [DONE]"
        ]


@pytest.fixture(scope="module")
def private(start_servers) -> dict[str, object]:
    """One private server per test (each is signalled and exits), all started side by side up front."""
    names = ("drains", "times_out", "second_signal")
    flags = (("--shutdown-timeout", "120"), ("--shutdown-timeout", "1"), ("--shutdown-timeout", "120"))
    return dict(zip(names, start_servers(*flags), strict=True))


def _started(served, *streams: Stream) -> None:
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120), f"no event from {s.path}:\n{served.log()}"
    time.sleep(0.3)  # some tokens in


def test_sigterm_drains_new_requests_get_503_the_stream_completes_and_the_process_exits_0(private) -> None:
    served = private["drains"]
    stream = Stream(served.url, CHAT, chat(150))  # still running after the signal and two refusals
    _started(served, stream)
    served.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (health := httpx.get(served.url + "/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "/health never reported draining"
        time.sleep(0.01)
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    refused = httpx.post(served.url + CHAT, json={**chat(4), "stream": False}, timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "the server is shutting down: retry on another instance"
    refused = httpx.post(served.url + MESSAGES, json={**message(4), "stream": False}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded_error"
    stream.join(120)
    assert stream.error is None and stream.status == 200 and stream.lines[-1] == "data: [DONE]"
    reasons = [c["finish_reason"] for e in stream.events() for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["length"]  # it ran to its end: the drain waited for it
    assert served.proc.wait(60) == 0
    log = served.log()
    assert "SIGTERM: draining" in log and "drained: shutting down" in log and "aborting" not in log


def test_past_the_shutdown_timeout_streams_end_aborted_but_complete_and_the_process_exits_0(private) -> None:
    served = private["times_out"]
    openai_stream, anthropic_stream = (
        Stream(served.url, CHAT, chat(900)),
        Stream(served.url, MESSAGES, message(900)),
    )
    _started(served, openai_stream, anthropic_stream)
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    openai_stream.join(60)
    anthropic_stream.join(60)
    assert time.monotonic() - t0 < 30  # 900 tokens each would take far longer
    assert openai_stream.error is None and anthropic_stream.error is None
    assert openai_stream.status == 200 and openai_stream.lines[-1] == "data: [DONE]"
    reasons = [c["finish_reason"] for e in openai_stream.events() for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["abort"]
    kinds = [e["type"] for e in anthropic_stream.events()]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert served.proc.wait(60) == 0
    assert "shutdown timeout (1 s): aborting 2 requests" in served.log()


def test_a_second_signal_exits_at_once(private) -> None:
    served = private["second_signal"]
    stream = Stream(served.url, CHAT, chat(900))
    _started(served, stream)
    served.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(10) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 5
    assert "second SIGTERM: exiting now" in served.log()
    stream.join(30)
    assert (
        stream.error is not None and stream.lines[-1] != "data: [DONE]"
    )  # cut: that is what a second signal means
