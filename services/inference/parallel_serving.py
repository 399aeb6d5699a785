"""Multi-process serving: tensor-parallel shards, pipeline stages or both; rank 0 serves gRPC.

Every rank runs the same `Engine` on its part of the model. Rank 0 owns the request queue: at
the start of each step it broadcasts the step's new requests and cancellations (and score
batches, resets, and the final stop) to the other ranks, which wait for these commands in
`follow()`. Every rank ends each forward with identical logits — all-gathered under tensor
parallelism (`tensor_parallel.py`), broadcast from the last stage under pipeline parallelism
(`pipeline_serving.py`) — and per-request generators are seeded identically, so all ranks pick
the same tokens and their caches stay in lock step without sending tokens around.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
from typing import Any

import torch.distributed as dist

from engine.engine import Engine, EngineConfig
from engine.requests import GenerationRequest, ScoreResult
from engine.tensor_parallel import shard_for_serving
from engine.tokens import TokenizerInfo
from kernels import device as devices
from models.transformer import CausalLM
from services.inference.config import InferenceServiceConfig

log = logging.getLogger(__name__)
STEP, SCORE, RESET, STOP = "step", "score", "reset", "stop"
PR_SET_PDEATHSIG = 1
TIMEOUT_S = 7 * 24 * 3600.0
"""Collective timeout: followers wait in a broadcast for as long as the server sits idle."""


class LeaderFollowerEngine(Engine):
    """An Engine on one serving rank; rank 0 leads, the others `follow()` its commands."""

    def __init__(
        self,
        model: CausalLM,
        tokens: TokenizerInfo,
        config: EngineConfig,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(model, tokens, config)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0) if group is not None else 0
        self._received: tuple[list[GenerationRequest], set[int]] = ([], set())

    def _send(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=self._leader, group=self.group)

    def _sync_inbox(
        self, requests: list[GenerationRequest], cancelled: set[int]
    ) -> tuple[list[GenerationRequest], set[int]]:
        if self.rank == 0:
            self._send(STEP, requests, cancelled)
            return requests, cancelled
        return self._received

    def score(
        self, items: list[tuple[list[int], list[int]]], pad_id: int = 0, top_logprobs: int = 0
    ) -> list[ScoreResult]:
        """Scores on every rank (rank 0 tells the others what; only it picks the top tokens)."""
        if self.rank == 0:
            self._send(SCORE, items, pad_id)
        return super().score(items, pad_id, top_logprobs)

    def reset(self) -> set[int]:
        """Reset every rank's engine; returns the ids of the requests forgotten."""
        if self.rank == 0:
            self._send(RESET)
        return super().reset()

    def shutdown(self) -> None:
        """Rank 0: release the followers (they return from `follow()`)."""
        if self.rank == 0:
            self._send(STOP)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it stops."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self._leader, group=self.group)
            command, *args = box[0]
            if command == STEP:
                self._received = (args[0], args[1])
                self.step()
            elif command == SCORE:
                super().score(*args)
            elif command == RESET:
                super().reset()
            elif command == STOP:
                return


def build_rank_engine(config: InferenceServiceConfig) -> tuple[LeaderFollowerEngine, Any]:
    """Load the checkpoint, keep this rank's shard or stage, wrap it (needs the process group)."""
    from engine.loading import load_checkpoint

    assert config.load is not None
    loaded = load_checkpoint(
        config.load,
        load_format=config.load_format,
        dtype=config.dtype,
        tokenizer=config.tokenizer,
        lora=config.lora_load,
        device=devices.current().torch_device(),
    )
    world = dist.group.WORLD
    assert world is not None, "multi-process serving needs the default process group"
    tokens = TokenizerInfo.from_tokenizer(loaded.tokenizer, loaded.config.vocab_size)
    engine_config = EngineConfig(max_batch_rows=config.max_batch_rows, cpu_linear=config.cpu_linear)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp > 1:
        from services.inference.pipeline_serving import PipelineEngine, keep_stage

        # Rank = stage * tp + tp rank: a stage's TP group is tp consecutive ranks.
        stage, stages = keep_stage(loaded.model, dist.get_rank() // tp, pp)
        if tp > 1:
            shard_for_serving(loaded.model, _stage_groups(tp, pp))
        engine = PipelineEngine(loaded.model, tokens, engine_config, stage, stages, tp_size=tp)
        return engine, loaded
    shard_for_serving(loaded.model, world)
    return LeaderFollowerEngine(loaded.model, tokens, engine_config), loaded


def _stage_groups(tp: int, pp: int) -> dist.ProcessGroup:
    """This rank's tensor-parallel group within its pipeline stage (every rank creates every
    stage's group, in the same order, as `new_group` requires)."""
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    return groups[dist.get_rank() // tp]


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    devices.init_distributed(timeout_s=TIMEOUT_S)


def _follower_main(rank: int, world: int, port: int, config: InferenceServiceConfig) -> None:
    _stop_with_parent()
    _join(rank, world, port)
    engine, _ = build_rank_engine(config)
    try:
        engine.follow()
    finally:
        devices.destroy_distributed()


def _stop_with_parent() -> None:
    """On Linux, get SIGTERM when rank 0 dies, even by SIGKILL (no broadcast would ever come)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_parallel(config: InferenceServiceConfig) -> Any:
    """Start ranks 1..N-1 as child processes, join as rank 0, return the serving engine."""
    from services.inference.serving import ServingEngine

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    port = _free_port()
    ctx = mp.get_context("spawn")
    children = [
        ctx.Process(target=_follower_main, args=(rank, world, port, config), daemon=True)
        for rank in range(1, world)
    ]
    for child in children:
        child.start()
    _join(0, world, port)
    log.info(
        "serving over %d processes (tp=%d, pp=%d, %s)",
        world,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        dist.get_backend(),
    )
    engine, loaded = build_rank_engine(config)
    return ServingEngine(
        loaded,
        engine,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        children=children,
    )
