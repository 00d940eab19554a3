"""The KV tiers (``astrai.kvcache.tier``): pages the prefix cache evicts are served again from host RAM
and from disk, after a restart too, with the greedy answers of a recomputed prompt; a corrupt file
is skipped; unusable folders disable the disk tier, never the engine; the pool's invariants hold
through concurrent eviction and hits."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from astrai.kvcache import KVConfig, PagePool, check_pool_invariants
from astrai.kvcache.tier import MARKER, DiskTier, KVTier, page_keys

#: three prompts of 11 complete pages (181 tokens); a pool of 25 pages holds two of them at most
TEXTS = [
    "The history of the Roman empire " * 30,
    "A recipe for bread and butter " * 30,
    "Quantum physics explained simply " * 30,
]
POOL = {"n_tokens": 400, "max_seq_len": 400, "max_batch_size": 4}


def _on_loop(engine, fn=lambda: None) -> None:
    """``fn()`` on the scheduler thread between steps (after the last step's stats are published);
    an AssertionError it raises fails the test here."""
    done, failure = threading.Event(), []

    def run():
        try:
            fn()
        except AssertionError as err:
            failure.append(err)
        done.set()

    engine.scheduler.call_soon(run)
    assert done.wait(30)
    assert not failure, failure[0]


def _checked(engine) -> None:
    _on_loop(engine, lambda: check_pool_invariants(engine.pool))


def _ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=True)


def _serve(engine, texts, tokens=8):
    """Greedy answers of ``texts`` one after the other, and each one's prefix-cache hit in tokens."""
    answers, hits = [], []
    for text in texts:
        _on_loop(engine)
        before = engine.get_stats()["prefix_hit_tokens"]
        (result,) = _all(engine, [text], tokens)
        answers.append(result.output_ids)
        _on_loop(engine)
        hits.append(engine.get_stats()["prefix_hit_tokens"] - before)
    _checked(engine)
    return answers, hits


@pytest.fixture(scope="module")
def cold(real_model):
    """The answers without any tier: the first prompt, after the two others evicted its pages."""
    from astrai.engine import EngineConfig, InferenceEngine

    model, tokenizer = real_model
    with InferenceEngine(model, tokenizer, EngineConfig(**POOL)) as engine:
        answers, hits = _serve(engine, [*TEXTS, TEXTS[0]])
    assert hits[3] < 11 * 16  # some of its pages were gone, and recomputed
    return answers


def _engine(real_model, **config):
    from astrai.engine import EngineConfig, InferenceEngine

    model, tokenizer = real_model
    return InferenceEngine(model, tokenizer, EngineConfig(**POOL, **config))


def test_an_evicted_prefix_comes_back_from_host_ram(real_model, cold):
    with _engine(real_model, kv_cache_host_memory_bytes=64 * 2**20) as engine:
        answers, hits = _serve(engine, [*TEXTS, TEXTS[0]])
        stats = engine.get_stats()
    assert answers == cold
    assert hits[3] == 11 * 16  # every complete page, from the radix or the tier: nothing recomputed
    assert stats["kv_tier_host_hit_pages"] >= 1 and stats["kv_tier_spilled_pages"] >= 1
    assert stats["kv_tier_host_bytes"] == stats["kv_tier_host_pages"] * 30 * 16 * 2 * 3 * 64 * 4


def test_an_evicted_prefix_comes_back_from_disk_and_after_a_restart(real_model, cold, tmp_path):
    folder = tmp_path / "kv"
    with _engine(real_model, kv_cache_dir=str(folder)) as engine:
        answers, hits = _serve(engine, [*TEXTS, TEXTS[0]])
        engine.kv_tier.disk.flush()
        stats = engine.get_stats()
    assert answers == cold and hits[3] == 11 * 16
    assert stats["kv_tier_disk_hit_pages"] >= 1 and stats["kv_tier_host_pages"] == 0
    assert (folder / MARKER).exists()
    # the pages evicted, then at shutdown those still cached: every complete page of the three
    # prompts with their answers (189, 189 and 129 tokens)
    assert len(list(folder.glob("*/*.kv"))) == 11 + 11 + 8
    with _engine(real_model, kv_cache_dir=str(folder)) as engine:  # a restart: an empty pool
        answers, hits = _serve(engine, [TEXTS[1]])
        stats = engine.get_stats()
    assert answers == [cold[1]] and hits == [11 * 16]  # every page of it from the folder
    assert stats["kv_tier_disk_hit_pages"] == 11


def test_a_corrupt_or_truncated_file_is_skipped_never_served(real_model, cold, tmp_path, caplog):
    folder = tmp_path / "kv"
    with _engine(real_model, kv_cache_dir=str(folder)) as engine:
        _serve(engine, TEXTS)
        engine.kv_tier.disk.flush()
    model, tokenizer = real_model
    keys = page_keys(None, tokenizer.encode(TEXTS[0], add_special_tokens=True), 16, 11)
    (page_dir,) = [p for p in folder.iterdir() if p.is_dir()]
    third, fifth = page_dir / f"{keys[2].hex()}.kv", page_dir / f"{keys[4].hex()}.kv"
    data = bytearray(third.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern in its payload
    third.write_bytes(bytes(data))
    fifth.write_bytes(fifth.read_bytes()[:1000])  # cut short
    with (
        caplog.at_level(logging.WARNING, "astrai.kvcache.disk"),
        _engine(real_model, kv_cache_dir=str(folder)) as engine,
    ):
        answers, hits = _serve(engine, [TEXTS[0]])
    assert answers == [cold[0]] and hits == [2 * 16]  # the first two pages; the third is corrupt
    assert "is corrupt or truncated; removed, not served" in caplog.text
    assert third.read_bytes() != bytes(data)  # removed, then written again from the recomputed page


def test_an_unusable_folder_disables_the_disk_tier_and_serving_goes_on(real_model, cold, tmp_path, caplog):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "photo.jpg").write_bytes(b"not ours")
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where the folder should be")
    for path in (foreign, blocked / "kv"):
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, "astrai.kvcache.disk"),
            _engine(real_model, kv_cache_dir=str(path)) as engine,
        ):
            answers, _ = _serve(engine, [TEXTS[0]])
            assert not engine.kv_tier.disk.enabled and engine.get_stats()["kv_tier_disk_pages"] == 0
        assert answers == [cold[0]]
        assert [r.message for r in caplog.records if "disk tier disabled" in r.message] != []
    assert sorted(p.name for p in foreign.iterdir()) == ["photo.jpg"]  # nothing of ours written there


def test_another_model_or_cache_layout_ignores_the_folder(real_model, tmp_path, caplog):
    folder = tmp_path / "kv"
    with _engine(real_model, kv_cache_dir=str(folder)) as engine:
        _serve(engine, TEXTS[:2])
        engine.kv_tier.disk.flush()
    with (
        caplog.at_level(logging.INFO, "astrai.kvcache.disk"),
        _engine(real_model, kv_cache_dir=str(folder), kv_cache_dtype="int8") as engine,
    ):
        _, hits = _serve(engine, [TEXTS[0]])
    assert hits == [0]
    assert "ignoring 1 folder(s) of another model, checkpoint or cache layout" in caplog.text
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 2  # the other one left alone


def test_the_folder_keeps_within_its_bound_least_recently_used_first(tmp_path):
    disk = DiskTier(tmp_path, 3 * (1000 + 64), lambda: b"f" * 16)
    tier = KVTier(0, disk)
    for i in range(5):
        tier.put(bytes([i]) * 16, torch.full((1000,), i, dtype=torch.uint8))
        disk.flush()
        if i == 2:
            assert tier.get(bytes([0]) * 16) is not None  # used: it stays past the next ones
    names = sorted(p.stem for p in tmp_path.glob("*/*.kv"))
    assert names == sorted((bytes([i]) * 16).hex() for i in (0, 3, 4))
    assert torch.equal(tier.get(bytes([4]) * 16), torch.full((1000,), 4, dtype=torch.uint8))
    disk.close()


def test_concurrent_eviction_and_hits_under_load_lose_nothing(real_model, tmp_path):
    from astrai.engine import EngineConfig, InferenceEngine

    model, tokenizer = real_model
    prompts = [t + f" part {i}." for i in range(3) for t in TEXTS]  # shared prefixes, distinct ends
    config = {**POOL, "max_batch_size": 3}
    with InferenceEngine(model, tokenizer, EngineConfig(**config)) as engine:
        want = [r.output_ids for r in _all(engine, prompts)]
    tiers = {"kv_cache_host_memory_bytes": 16 * 2**20, "kv_cache_dir": str(tmp_path / "kv")}
    with InferenceEngine(model, tokenizer, EngineConfig(**config, **tiers)) as engine:
        got = [r.output_ids for r in _all(engine, prompts)]
        _checked(engine)
        stats = engine.get_stats()
    assert got == want
    assert (
        stats["kv_tier_spilled_pages"] > 0
        and stats["kv_tier_host_hit_pages"] + stats["kv_tier_disk_hit_pages"] > 0
    )


def _all(engine, prompts, tokens=6):
    """Greedy results of ``prompts``, all queued while the scheduler waits, so that every run steps
    the same batches (and a kernel whose rounding depends on the batch still gives the same ids)."""
    from astrai.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    held, go = threading.Event(), threading.Event()
    engine.scheduler.call_soon(lambda: (held.set(), go.wait(30)))
    assert held.wait(30)
    results = [engine.submit(_ids(engine, p), params) for p in prompts]
    go.set()
    for r in results:
        r.wait_completion()
        r.raise_for_error()
    return results


def test_tiers_need_a_prefix_cache_of_one_layer_group():
    pool = PagePool(2, 4, 2, 8, KVConfig(page_size=4, n_tokens=64, prefix_caching=False))
    with pytest.raises(ValueError, match="need a paged pool with prefix caching"):
        pool.attach_tier(KVTier(2**20))
