"""Multi-process serving: tensor-parallel shards, pipeline stages or both; rank 0 serves gRPC.

This is the process side: rank 0 (the server) spawns ranks 1..N-1, every rank joins the process
group and builds its engine from the service config. The engines themselves — the leader /
follower step loop, the pipeline stage engine, the TP shard — live in `engine/`
(`engine.parallel_engine.build_parallel_engine`).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore

from checkpoints.registry import AUTO, SERVE_FORMATS, detect_format, get_format
from engine.build import build_engine
from engine.engine_thread import EngineThread
from engine.leader_follower import LeaderFollowerEngine
from kernels import device as devices
from models.parallel_plan import SERVE_FLAGS, check_model_split
from services.inference.config import InferenceServiceConfig
from services.inference.serving import ServingEngine

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
TIMEOUT_S = 7 * 24 * 3600.0
"""Collective timeout: followers wait in a broadcast for as long as the server sits idle."""


def build_rank_engine(config: InferenceServiceConfig) -> tuple[LeaderFollowerEngine, Any]:
    """Load the checkpoint, keep this rank's shard or stage, wrap it (needs the process group)."""
    loaded, engine = build_engine(
        config.load_spec(),
        config.engine_config(),
        device=devices.current().torch_device(),
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
    )
    assert isinstance(engine, LeaderFollowerEngine)
    return engine, loaded


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(
        {
            # Every rank joins the store rank 0's launcher hosts as a client (torchrun's agent
            # store), rather than rank 0 binding MASTER_PORT as it joins.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
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


def check_layout(config: InferenceServiceConfig) -> None:
    """ValueError naming --tensor-parallel-size / --pipeline-parallel-size when the checkpoint's
    own config (config.json, the native or Megatron model config: no weight is read) cannot be
    split that way; run before any rank is spawned."""
    assert config.load is not None
    directory = config.load
    fmt = detect_format(directory) if config.load_format == AUTO else config.load_format
    try:
        model = get_format(fmt, "--load-format", SERVE_FORMATS).open_source(directory, None, None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--load {directory} ({fmt}): {exc}") from exc
    check_model_split(
        model.config,
        tp=config.tensor_parallel_size,
        pp=config.pipeline_parallel_size,
        flags=SERVE_FLAGS,
    )


def launch_parallel(config: InferenceServiceConfig) -> Any:
    """Check the layout against the checkpoint's config, start ranks 1..N-1 as child processes,
    join as rank 0, return the serving engine."""

    check_layout(config)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    # The rendezvous store listens on a port the OS assigns as it binds. A port picked free and
    # handed to rank 0 to bind later could be taken meanwhile (another server starting, a
    # client's outgoing connection), and the group would never form.
    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
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
        worker=EngineThread(batch_wait_s=config.batch_wait_ms / 1e3),
        rendezvous=store,
    )
