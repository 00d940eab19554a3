"""Tensor parallelism (issue 18) on the tiny random model: worker processes over gloo on this machine.

Sharding is checked on its own (the shards put back together are the model; sizes the model
cannot take are refused with the valid ones), then a 2- and a 4-way model (4 ranks: one query
head each, the 2 KV heads replicated) against a single-process reference: logits step by step
through the same pool layout, in float32 and bfloat16, and greedy tokens through the engine.
A worker that dies makes the engine unhealthy and fails the requests in flight (no hang), and an
idle engine outlives its collective time-out (the scheduler's heartbeat). Gemma 3, Phi-3 and Qwen3
split two ways from their GGUF files give one process's logits.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from astrai.distributed.launch import load_tensor_parallel, save_state
from astrai.distributed.sharding import TPConfigError, check_tp_size, shard_weights, valid_tp_sizes
from astrai.engine import EngineConfig, InferenceEngine
from astrai.errors import EngineNotReady
from astrai.kvcache import KVConfig, PagePool
from astrai.model import ModelConfig, build_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 77], [8, 8, 120, 64, 31], list(range(40, 75))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model):
    """The tiny model saved for the worker processes (its unfused state dict and configuration)."""
    path = tmp_path_factory.mktemp("tp") / "tiny.pt"
    save_state(path, tiny_model.config, tiny_model.state_dict())
    return str(path)


def reference(tiny_model, dtype):
    model = build_model(tiny_model.config, dtype)
    model.load_weights({k: v.to(dtype) for k, v in tiny_model.state_dict().items()})
    model.fuse_projections()
    return model


def test_valid_sizes_and_the_refusal_that_names_them(tiny_model) -> None:
    config = tiny_model.config  # 4 query heads, 2 KV heads, 128 intermediate rows
    assert valid_tp_sizes(config) == [1, 2, 4]
    with pytest.raises(
        TPConfigError, match=r"3 ranks cannot share 2 KV heads|4 query heads do not divide into 3"
    ) as e:
        check_tp_size(config, 3)
    assert str(e.value).endswith("valid sizes: 1, 2, 4")
    smol = ModelConfig(  # the shape of SmolLM2-135M
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
    )
    assert valid_tp_sizes(smol) == [1, 3]
    with pytest.raises(TPConfigError, match="valid sizes: 1, 3"):
        check_tp_size(smol, 2)


@pytest.mark.parametrize("n", [2, 4])
def test_the_shards_put_back_together_are_the_model(tiny_model, n) -> None:
    weights, config = tiny_model.state_dict(), tiny_model.config
    shards = [shard_weights(weights, config, n, r) for r in range(n)]
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([s[q] for s in shards]), weights[q])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[down] for s in shards], dim=1), weights[down])
    k = "model.layers.0.self_attn.k_proj.weight"
    if n == 4:  # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1
        assert torch.equal(shards[0][k], shards[1][k]) and torch.equal(
            torch.cat([shards[0][k], shards[2][k]]), weights[k]
        )
    else:
        assert torch.equal(torch.cat([s[k] for s in shards]), weights[k])
    lm = torch.cat([s["lm_head.weight"] for s in shards])
    assert torch.equal(lm[: config.vocab_size], weights["lm_head.weight"])


def _steps(model, config, dtype, decoded=None):
    """Logits of a prefill of every prompt (one ragged step), then of 3 decode steps, on a pool of
    ``config``'s KV heads. The decode tokens are ``decoded`` (per step), else the argmax of each
    step; returns (the logits of each step, the decode tokens)."""
    pool = PagePool(
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        KVConfig(max_batch_size=4, max_seq_len=128, page_size=4, n_tokens=512),
        dtype,
    )
    rows = [pool.task_alloc() for _ in PROMPTS]
    for r, p in zip(rows, PROMPTS, strict=True):
        pool.extend(r, len(p) + 3)
    out, tokens, lens = [], [], [len(p) for p in PROMPTS]
    kv = pool.bind_tasks(rows, lens, lens)
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    out.append(model(ids, positions, kv, torch.tensor(lens).cumsum(0) - 1))
    for step in range(3):
        tokens.append(out[-1].argmax(-1) if decoded is None else decoded[step])
        kv = pool.bind_tasks(rows, [1] * len(rows), [n + step + 1 for n in lens])
        out.append(model(tokens[-1], torch.tensor([n + step for n in lens]), kv, torch.arange(len(rows))))
    return out, tokens


def _ids(result):
    assert result.wait_completion(120) and result.error is None, result.error
    return result.output_ids


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_tensor_parallel_model_gives_the_references_logits_and_greedy_tokens(
    tiny_model, tiny_tokenizer, checkpoint, n, dtype
):
    ref = reference(tiny_model, dtype)
    model, _ = load_tensor_parallel(None, dtype, "cpu", n, timeout=60, state_file=checkpoint)
    try:
        local = model.config
        assert (local.num_attention_heads, local.num_key_value_heads, local.vocab_size) == (
            4 // n,
            max(1, 2 // n),
            300,
        )
        exact, decoded = _steps(reference(tiny_model, torch.float32), ref.config, torch.float32)
        expected, _ = _steps(ref, ref.config, dtype, decoded)
        got, _ = _steps(model, local, dtype, decoded)
        for x, e, g in zip(exact, expected, got, strict=True):
            assert g.dtype == torch.float32 and g.shape == e.shape
            if dtype == torch.float32:  # the same sums in another order
                torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
            else:  # each rank's partial sums are rounded to bfloat16 before the all-reduce: about as
                # far from the float32 model as one process in bfloat16, within a bfloat16 ulp of the largest
                # logit
                alone, split = float((e - x).abs().max()), float((g - x).abs().max())
                assert split <= 1.5 * alone + 2.0**-7 * float(x.abs().max()), (split, alone)
        if dtype == torch.float32:
            greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            with InferenceEngine(ref, tiny_tokenizer, EngineConfig(max_seq_len=128)) as alone:
                want = [alone.submit(p, alone._params(greedy)) for p in PROMPTS]
                want = [_ids(r) for r in want]
            engine = InferenceEngine(model, tiny_tokenizer, EngineConfig(max_seq_len=128))
            try:
                results = [engine.submit(p, engine._params(greedy)) for p in PROMPTS]
                assert [_ids(r) for r in results] == want
                assert engine.get_stats()["kv_tokens_in_use"] == 0
            finally:
                engine.shutdown()
    finally:
        model.close()
    assert all(p.returncode == 0 for p in model.procs)  # every worker stopped on STOP


def test_a_dead_worker_makes_the_engine_unhealthy_and_fails_requests_without_a_hang(
    tiny_model, tiny_tokenizer, checkpoint
):
    model, _ = load_tensor_parallel(None, torch.float32, "cpu", 2, timeout=30, state_file=checkpoint)
    engine = InferenceEngine(model, tiny_tokenizer, EngineConfig(max_seq_len=128))
    try:
        assert engine.is_healthy()
        os.kill(model.procs[0].pid, signal.SIGKILL)
        model.procs[0].wait(10)
        assert not engine.is_healthy()
        t0 = time.monotonic()
        result = engine.submit(PROMPTS[0], engine._params({"max_tokens": 8, "temperature": 0.0}))
        result.wait_completion()
        assert isinstance(result.error, EngineNotReady) and time.monotonic() - t0 < 20
        with pytest.raises(EngineNotReady):
            engine.submit(PROMPTS[1], engine._params({"max_tokens": 8}))
    finally:
        engine.shutdown()


def test_an_idle_engine_outlives_its_collective_timeout(tiny_model, tiny_tokenizer, checkpoint):
    ref = reference(tiny_model, torch.float32)
    model, _ = load_tensor_parallel(None, torch.float32, "cpu", 2, timeout=2, state_file=checkpoint)
    engine = InferenceEngine(model, tiny_tokenizer, EngineConfig(max_seq_len=128))
    try:
        greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        time.sleep(5)  # idle for more than twice the time-out: only the heartbeat keeps the workers waiting
        result = engine.submit(PROMPTS[1], engine._params(greedy))
        result.wait_completion()
        assert result.error is None and engine.is_healthy()
        with InferenceEngine(ref, tiny_tokenizer, EngineConfig(max_seq_len=128)) as alone:
            want = alone.submit(PROMPTS[1], alone._params(greedy))
            want.wait_completion()
        assert result.output_ids == want.output_ids
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen3", "qwen2_moe"])
def test_a_two_way_split_of_a_family_gguf_gives_the_single_process_logits(family_gguf, family):
    """Each worker reads the family's GGUF file (``gguf_families``), rank 0 its tokenizer too: Gemma 3's
    per-head q/k norms, local RoPE base, windows and scaled embeddings, Phi-3's fused tensors cut apart
    before the split and its partial rotary, Qwen3's q/k norms, Qwen2-MoE's experts (each split in two,
    the router whole) and its shared expert (split as a dense MLP, its gate whole); float32 logits of a prefill and three decode steps equal one process's."""
    from families import load_astrai

    path, _ = family_gguf(family)
    alone = load_astrai(path)
    model, tokenizer = load_tensor_parallel(str(path), torch.float32, "cpu", 2, timeout=60)
    try:
        assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
        assert tokenizer.decode(tokenizer.encode("the heat")) == "the heat"
        expected, decoded = _steps(alone, alone.config, torch.float32)
        got, _ = _steps(model, model.config, torch.float32, decoded)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    finally:
        model.close()
    assert all(p.returncode == 0 for p in model.procs)
