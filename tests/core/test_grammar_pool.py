"""Grammar compiles as bounded work (issue 29): worker processes that a time-out, a client that left or
a drain stop, a bounded queue, a size bound checked before anything compiles, a cache bounded in bytes."""

from __future__ import annotations

import threading
import time

import pytest

from astrai.errors import EngineNotReady, Overloaded, RequestRejected
from astrai.grammar import GrammarCache, GrammarConfig, GrammarSpec
from astrai.grammar.pool import Cancelled

#: An enum whose compile takes xgrammar minutes (45 s for 20,000 strings on a 2-core machine).
SLOW = GrammarSpec.of("json_schema", {"enum": [f"value number {i}" for i in range(20_000)]})
#: compact: a few tens of kB compiled (whitespace between tokens costs megabytes: the byte bound's test)
QUICK = GrammarSpec.of(
    "json_schema", {"type": "object", "properties": {"city": {"type": "string"}}}, compact=True
)


@pytest.fixture
def cache(real_model):
    model, tokenizer = real_model
    made: list[GrammarCache] = []

    def make(**bounds) -> GrammarCache:
        bounds.setdefault("max_bytes", 1 << 20)
        made.append(
            GrammarCache(
                tokenizer, model.config.vocab_size, tokenizer.eos_token_ids, config=GrammarConfig(**bounds)
            )
        )
        return made[-1]

    yield make
    for c in made:
        c.close()


def _pids(c: GrammarCache) -> set[int]:
    return {w.proc.pid for w in c._pool._idle}


def test_a_compile_past_its_time_out_is_stopped_and_the_worker_replaced(cache):
    c = cache(timeout=1.0)
    c.compile(QUICK)  # the worker is up
    before = _pids(c)
    started = time.monotonic()
    with pytest.raises(RequestRejected, match="took longer than 1 s and was stopped") as err:
        c.compile(SLOW)
    assert err.value.param == "grammar" and time.monotonic() - started < 3
    after = _pids(c)  # the worker that compiled it is gone; its replacement started at once
    assert len(before) == len(after) == 1 and not before & after
    c.compile(GrammarSpec.of("regex", "[a-z]+"))  # the replacement serves the next one
    assert _pids(c) == after


def test_a_cancelled_compile_ends_at_once_and_another_waiting_for_it_is_not_served_it(cache):
    c = cache(timeout=60.0)
    c.compile(QUICK)  # the worker is up
    before = _pids(c)
    cancel, errors = threading.Event(), []

    def slow() -> None:
        try:
            c.compile(SLOW, cancel)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    started = time.monotonic()
    cancel.set()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - started < 1.0
    assert len(errors) == 1 and isinstance(errors[0], Cancelled)
    assert len(_pids(c)) == 1 and not _pids(c) & before  # replaced
    assert c.compile(QUICK) is c.compile(QUICK)  # cached, compiled by a new worker


def test_compiles_beyond_the_workers_and_the_queue_are_refused_at_once(cache):
    c = cache(workers=1, max_pending=0, timeout=60.0)
    c.compile(QUICK)
    cancel = threading.Event()
    t = threading.Thread(target=lambda: pytest.raises(Cancelled, c.compile, SLOW, cancel))
    t.start()
    time.sleep(0.3)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="grammar compiles are under way"):
        c.compile(GrammarSpec.of("regex", "[a-z]+"))
    assert time.monotonic() - started < 0.5
    cancel.set()
    t.join(5)
    assert c.compile(GrammarSpec.of("regex", "[a-z]+")) is not None


def test_a_drain_stops_the_compiles_under_way(cache):
    c = cache(timeout=60.0)
    c.compile(QUICK)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(EngineNotReady, c.compile, SLOW).value))
    t.start()
    time.sleep(0.3)
    c.cancel_all()
    t.join(5)
    assert not t.is_alive() and "shutting down" in str(errors[0])
    assert c.compile(GrammarSpec.of("regex", "[0-9]+")) is not None  # later compiles run


def test_an_oversized_spec_is_refused_before_any_compile(cache):
    c = cache(max_bytes=1000)
    with pytest.raises(
        RequestRejected, match=r"the json_schema is \d+ bytes; at most 1000 are compiled"
    ) as err:
        c.compile(SLOW)
    assert err.value.param == "grammar"
    assert c._pool is None  # nothing was compiled, not even the backend made


def test_the_cache_keeps_compiled_grammars_within_its_byte_bound(cache):
    c = cache(cache_bytes=200_000)
    first = c.compile(QUICK)
    size = c.bytes_cached
    assert 0 < size <= 200_000 and c.compile(QUICK) is first
    for i in range(40):  # each a few tens of kB: the oldest go
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}}
        c.compile(GrammarSpec.of("json_schema", schema, compact=True))
        assert c.bytes_cached <= 200_000
    assert c.compile(QUICK) is not first  # evicted, compiled again


def test_a_worker_that_grew_past_the_bound_is_replaced_after_its_compile(cache):
    c = cache()
    c.compile(QUICK)
    before = _pids(c)
    c._pool.recycle_bytes = 1  # every worker is over it
    c.compile(GrammarSpec.of("regex", "[a-c]+"))
    assert before and not _pids(c) & before


def test_a_worker_killed_while_its_start_state_is_being_sent_ends_that_send_first() -> None:
    """The state goes to a new worker on a thread; a kill while it is still being written (a worker
    still importing reads none of it) ends that thread before the pipe closes: closing it under the
    thread's write raised a TypeError there (seen in CI)."""
    from astrai.grammar.pool import _Worker

    worker = _Worker("astrai.grammar.xgrammar_backend:XGrammarBackend", b"x" * (16 << 20))
    assert worker._starting.is_alive()  # 16 MiB: far more than a pipe holds
    worker.kill()
    assert not worker._starting.is_alive()
