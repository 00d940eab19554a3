"""How an encoder's passes are gathered (``astrai.embedding.gather``): the budgets, and regathering
the clients a pass has just answered; then eight real clients on the real MiniLM engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from astrai.embedding import load_embedder
from astrai.embedding.gather import Gatherer


@dataclass
class Item:
    ids: list[int]
    at: float
    opens: bool = True


def arrive(n: int, tokens: int = 10) -> list[Item]:
    return [Item([1] * tokens, time.perf_counter()) for _ in range(n)]


def put_later(gatherer: Gatherer, items_after: float, n: int) -> threading.Thread:
    """``n`` inputs put from another thread ``items_after`` seconds from now."""

    def later() -> None:
        time.sleep(items_after)
        for item in arrive(n):
            gatherer.put(item)

    thread = threading.Thread(target=later)
    thread.start()
    return thread


def test_a_first_pass_takes_what_waits_without_waiting_for_more() -> None:
    g = Gatherer(max_tokens=1000, max_inputs=100)
    for item in arrive(3):
        g.put(item)
    batch, stopped = g.next_pass()
    assert (len(batch), stopped) == (3, False)


def test_the_next_pass_waits_for_the_requests_the_last_one_answered() -> None:
    g = Gatherer(max_tokens=1000, max_inputs=100, regather=1.0, cap=30.0)
    waiting = arrive(1)  # queued while the pass ran: not one of those answered
    for item in waiting:
        g.put(item)
    g.ended(answered=3, started=time.perf_counter() - 30.0)  # a long pass: the wait may be long
    thread = put_later(g, 0.05, 3)  # the three clients come back
    batch, _ = g.next_pass()
    thread.join()
    assert len(batch) == 4 and batch[0] is waiting[0]


def test_a_lone_client_is_not_kept_waiting() -> None:
    g = Gatherer(max_tokens=1000, max_inputs=100, regather=1.0, cap=60.0)
    g.ended(answered=1, started=time.perf_counter() - 60.0)
    thread = put_later(g, 0.01, 1)
    start = time.perf_counter()
    batch, _ = g.next_pass()
    thread.join()
    assert len(batch) == 1
    assert time.perf_counter() - start < 30  # its own input ended the wait, not the minute allowed


def test_the_wait_ends_at_its_share_of_the_last_pass() -> None:
    g = Gatherer(max_tokens=1000, max_inputs=100, regather=0.25, cap=60.0)
    for item in arrive(2):
        g.put(item)
    g.ended(answered=5, started=time.perf_counter() - 0.2)  # at most 50 ms more
    start = time.perf_counter()
    batch, _ = g.next_pass()  # none of the five comes back
    assert len(batch) == 2
    assert time.perf_counter() - start < 30


def test_full_budgets_start_a_pass_at_once_and_hold_over_what_does_not_fit() -> None:
    g = Gatherer(max_tokens=25, max_inputs=100, regather=1.0, cap=60.0)
    g.ended(answered=8, started=time.perf_counter() - 60.0)
    for item in arrive(3):  # 30 tokens
        g.put(item)
    batch, _ = g.next_pass()
    assert len(batch) == 2  # 20 tokens; the third would pass 25
    g.ended(answered=0, started=time.perf_counter())
    long = Item([1] * 40, time.perf_counter())  # longer than the budget: alone
    g.put(long)
    assert [len(b.ids) for b in g.next_pass()[0]] == [10]  # the held one first, alone in its pass
    assert g.next_pass()[0] == [long]
    g = Gatherer(max_tokens=1000, max_inputs=2, regather=1.0, cap=60.0)
    g.ended(answered=8, started=time.perf_counter() - 60.0)
    for item in arrive(3):
        g.put(item)
    assert len(g.next_pass()[0]) == 2


def test_a_stop_ends_the_gathering_and_leaves_the_rest() -> None:
    g = Gatherer(max_tokens=15, max_inputs=100)
    items = arrive(2)
    for item in items:
        g.put(item)
    g.stop()
    g.put(arrive(1)[0])
    assert g.next_pass() == ([items[0]], False)  # the second is held over: 20 tokens > 15
    batch, stopped = g.next_pass()
    assert (batch, stopped) == ([items[1]], True)
    assert len(g.leftover()) == 1


@pytest.mark.slow
def test_eight_clients_one_request_after_another_share_passes_of_eight() -> None:
    """Without regathering they split into cohorts (passes of four on average, ``gather``'s doc)."""
    engine = load_embedder("minilm-l6", regather=1.0)
    try:
        ids = engine.encode(["a sentence of a few words to embed."])
        engine.embed(ids)
        go = threading.Barrier(8)

        def client() -> None:
            go.wait()
            for _ in range(6):
                engine.embed(ids)

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = engine.get_stats()
        passes = stats["passes"] - 1
        assert stats["inputs"] - 1 == 48
        assert passes <= 8, f"48 inputs took {passes} passes"  # six of eight, and the first's stragglers
    finally:
        engine.shutdown()
