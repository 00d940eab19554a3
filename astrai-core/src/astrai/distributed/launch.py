"""Starting a tensor-parallel engine: ``load_tensor_parallel`` (rank 0) and ``TensorParallelModel``.

On one machine, rank 0 (the process that serves) starts ranks 1..N-1 as ``python -m
astrai.distributed.worker`` subprocesses that meet it at a ``TCPStore`` on a free loopback port;
each loads the same checkpoint and keeps its shard (``sharding.shard_weights``) before fusing
projections. Under ``torchrun`` (several machines, or one), every process is started by torchrun
with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set: rank 0 serves and the others run
``worker_main`` (``astrai serve`` does this by itself), meeting through ``env://``.

Over 300 lines because both ways of starting the ranks (subprocesses meeting at a ``TCPStore``,
and torchrun) share the shard building, the wait until every rank is ready and the worker's
loop: one start-up protocol, read in one place.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from astrai.distributed.sharding import check_tp_size, shard_config, shard_weights
from astrai.distributed.tp import (
    NOOP,
    STOP,
    Groups,
    TPShard,
    WorkerLost,
    gather_logits,
    init_groups,
    lm_rows,
    send_signal,
    send_step,
    worker_loop,
)
from astrai.errors import AstraiError
from astrai.model.config import ModelConfig

__all__ = ["TensorParallelModel", "load_tensor_parallel", "torchrun_rank", "worker_main"]

logger = logging.getLogger(__name__)

#: Seconds a worker may take to load its shard and join.
STARTUP_TIMEOUT = 600.0


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (``RANK`` and ``WORLD_SIZE`` set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


def read_source(source: dict[str, Any], dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A checkpoint's configuration and weights (astrai's layout, unfused): ``{"model": name or path}``
    (the loaders of ``astrai.model``) or ``{"state_file": path}`` (``torch.save`` of
    ``{"config": ModelConfig fields, "weights": state dict}``). ``"max_seq_len"``, when set, caps the
    context the shards are built for (``astrai.model.served_config``: their rotary tables)."""
    from astrai.model import read_checkpoint, served_config

    if source.get("state_file"):
        saved = torch.load(source["state_file"], weights_only=True)
        config, weights = (
            ModelConfig(**saved["config"]),
            {k: v.to(dtype) for k, v in saved["weights"].items()},
        )
    else:
        config, weights, _kind, _path = read_checkpoint(source.get("model"), dtype)
    return served_config(config, source.get("max_seq_len")), weights


def build_shard(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    groups: Groups,
    dtype: torch.dtype,
    device: torch.device,
) -> TPShard:
    """Rank ``groups.rank``'s shard of the checkpoint, fused (and packed where the CPU can)."""
    from astrai.model import build_model
    from astrai.model.cpu_linear import prepack_linears, prepack_supported
    from astrai.model.layers import meta_parameters

    cfg = shard_config(config, groups.size)
    cfg.tie_word_embeddings = False  # the LM head is a vocabulary slice, the embeddings whole
    model = build_model(cfg, dtype, device, random_init=False)  # (parameters on meta until loaded)
    with meta_parameters():
        model.lm_head = nn.Linear(cfg.hidden_size, lm_rows(cfg.vocab_size, groups.size), bias=False).to(dtype)
    model.load_weights(
        {k: v.to(device) for k, v in shard_weights(weights, config, groups.size, groups.rank).items()}
    )
    model.fuse_projections()
    if prepack_supported(device, dtype):
        prepack_linears(model)
    return TPShard(model.eval(), groups)


def _threads(size: int, device: torch.device) -> None:
    """One rank's share of this machine's cores (ranks on one host would otherwise oversubscribe it)."""
    if device.type == "cpu" and torchrun_rank() is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


class TensorParallelModel(nn.Module):
    """Rank 0's model: ``forward`` sends the step to every rank, runs rank 0's shard and returns
    the gathered logits ``[B, vocab]`` (float32). ``config`` is the shard's (its heads: rank 0's KV
    pool holds its share of the KV heads; the vocabulary whole). See ``astrai.distributed.tp``."""

    def __init__(
        self, shard: TPShard, config: ModelConfig, procs: list[subprocess.Popen], timeout: float
    ) -> None:
        super().__init__()
        self.shard, self.config, self.procs, self.timeout = shard, config, procs, timeout
        self.groups = shard.groups
        self.attention_features = shard.attention_features  # (the runner's backend choice reads them)
        self.tensor_parallel_size = self.groups.size
        self.idle_interval = timeout / 4  # the scheduler calls idle() this often while it waits
        self.broken: str | None = None
        self._closed = False

    @property
    def healthy(self) -> bool:
        """False once a collective failed or a worker process exited."""
        if self.broken is None:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                self.broken = (
                    f"tensor-parallel worker (pid {dead[0].pid}) exited with status {dead[0].returncode}"
                )
                logger.error("%s: the engine cannot run", self.broken)
        return self.broken is None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        if not self.healthy:
            raise WorkerLost(self.broken)
        try:
            send_step(self.groups, input_ids, positions, kv_cache, logits_indices)
            local = self.shard(input_ids, positions, kv_cache, logits_indices)
            return gather_logits(self.groups, local, self.config.vocab_size)
        except Exception as exc:  # the ranks' collectives are out of step now: no step can run again
            self.broken = f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
            logger.error("%s", self.broken, exc_info=exc)
            raise WorkerLost(self.broken) from exc

    def idle(self) -> None:
        """A heartbeat while the scheduler waits: the workers' next wait starts over."""
        if self.healthy:
            try:
                send_signal(self.groups, NOOP)
            except Exception as exc:
                self.broken = f"tensor-parallel heartbeat failed: {type(exc).__name__}: {exc}"
                logger.error("%s", self.broken)

    def close(self) -> None:
        """Stop every rank (idempotent): ``STOP``, then wait for the workers (killed after 30 s; at
        once when a rank was lost, since the others can only wait for their time-out)."""
        if self._closed:
            return
        self._closed = True
        if self.healthy:
            try:
                send_signal(self.groups, STOP)
            except Exception:
                logger.warning("could not tell the tensor-parallel workers to stop", exc_info=True)
        if self.broken is not None:
            for p in self.procs:
                p.kill()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_tensor_parallel(
    name_or_path: str | None,
    dtype: torch.dtype,
    device: str | torch.device,
    size: int,
    timeout: float = 300.0,
    state_file: str | None = None,
    max_seq_len: int | None = None,
) -> tuple[TensorParallelModel, Any]:
    """Rank 0 of a ``size``-way tensor-parallel model (and the tokenizer; None with ``state_file``).

    Starts the other ranks (unless torchrun did), waits until each has loaded its shard, joins the
    process group (``timeout``: the collectives' time-out, seconds). Raises TPConfigError (the
    valid sizes) for a split the model cannot take, AstraiError when a worker fails to start.
    ``max_seq_len``: the longest context served (the shards' rotary tables; None: the model's)."""
    device = torch.device(device)
    source = {"model": name_or_path, "state_file": state_file, "max_seq_len": max_seq_len}
    config, weights = read_source(source, dtype)
    check_tp_size(config, size)
    _threads(size, device)
    procs: list[subprocess.Popen] = []
    if torchrun_rank() is None:
        port = _free_port()
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            size,
            is_master=True,
            wait_for_workers=False,
            timeout=__import__("datetime").timedelta(seconds=STARTUP_TIMEOUT),
        )
        for rank in range(1, size):
            spec = {
                "rank": rank,
                "size": size,
                "host": "127.0.0.1",
                "port": port,
                "source": source,
                "dtype": str(dtype).removeprefix("torch."),
                "device": _rank_device(device, rank),
                "timeout": timeout,
            }
            procs.append(
                subprocess.Popen([sys.executable, "-m", "astrai.distributed.worker", json.dumps(spec)])
            )
        _wait_ready(store, procs, size)
        groups = init_groups(0, size, "", device, timeout, store=store)
    else:
        groups = init_groups(0, size, "env://", device, timeout)
    shard = build_shard(config, weights, groups, dtype, device)
    del weights
    model = TensorParallelModel(shard, shard.model.config, procs, timeout)
    tokenizer = None
    if state_file is None:
        from astrai.model import load_tokenizer

        tokenizer = load_tokenizer(name_or_path, config)
    logger.info(
        "tensor parallel: %d ranks (%s, %s), shards of %d query / %d KV heads",
        size,
        device,
        dtype,
        shard.model.config.num_attention_heads,
        shard.model.config.num_key_value_heads,
    )
    return model, tokenizer


def _rank_device(device: torch.device, rank: int) -> str:
    if device.type == "cuda":
        return f"cuda:{(device.index or 0) + rank}"
    return str(device)


def _wait_ready(store: Any, procs: list[subprocess.Popen], size: int) -> None:
    """Until every worker has set ``ready/<rank>`` (it loaded its checkpoint); AstraiError if one
    exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    keys = [f"ready/{r}" for r in range(1, size)]
    while not store.check(keys):
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                for q in procs:
                    q.kill()
                raise AstraiError(
                    f"tensor-parallel worker {rank} exited with status {p.returncode} "
                    "while starting (see its log above)"
                )
        if time.monotonic() > deadline:
            for q in procs:
                q.kill()
            raise AstraiError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT:g} s")
        time.sleep(0.05)


def worker_main(spec: dict[str, Any]) -> int:
    """One worker rank: load the checkpoint, join, keep its shard, run steps until rank 0 stops it.

    ``spec``: rank, size, host and port of rank 0's store (absent under torchrun: ``env://``),
    source, dtype, device, timeout. 0 on ``STOP``; 1 when rank 0 went away."""
    import datetime

    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s tp-rank-{spec['rank']} %(name)s: %(message)s"
    )
    dtype, device = getattr(torch, spec["dtype"]), torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _threads(spec["size"], device)
    config, weights = read_source(spec["source"], dtype)
    if "port" in spec:
        store = dist.TCPStore(
            spec["host"],
            spec["port"],
            spec["size"],
            is_master=False,
            timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT),
        )
        store.set(f"ready/{spec['rank']}", "1")
        groups = init_groups(spec["rank"], spec["size"], "", device, spec["timeout"], store=store)
    else:
        groups = init_groups(spec["rank"], spec["size"], "env://", device, spec["timeout"])
    shard = build_shard(config, weights, groups, dtype, device)
    del weights
    try:
        worker_loop(shard, shard.model.config, dtype, device)
    except Exception as exc:  # rank 0 exited or a collective timed out: nothing to serve any more
        logging.getLogger(__name__).error("tensor-parallel worker %d stops: %s", spec["rank"], exc)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def save_state(path: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write ``{"config", "weights"}`` for ``load_tensor_parallel(state_file=...)`` (a model built
    in memory)."""
    import dataclasses

    torch.save(
        {"config": dataclasses.asdict(config), "weights": {k: v.detach().cpu() for k, v in weights.items()}},
        path,
    )
