"""Run a function on N real processes joined in a gloo process group (no mocks).

    def _body(rank, world_size, scale):      # module level, so `spawn` can pickle it
        t = torch.ones(1) * rank * scale
        torch.distributed.all_reduce(t)
        return t.item()

    assert run_distributed(_body, 2, 3.0) == [3.0, 3.0]

Each child gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
joins through `kernels.device.init_distributed`, runs the body, and sends its return value back.
A child's exception fails the caller with the child's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessRaisedException


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    results: Any,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    from kernels import device

    device.init_distributed(timeout_s=120)
    try:
        # Plain pickle, not the queue's ForkingPickler: that one shares tensors through shared
        # memory, which vanishes when this child exits before the parent reads the result.
        results.put((rank, pickle.dumps(fn(rank, world_size, *args))))
    finally:
        device.destroy_distributed()
    # The result is in the pipe (SimpleQueue writes synchronously) and the group is gone: leave
    # without interpreter teardown. A native thread still joinable at static destruction aborted
    # ~1 child exit in 4 of test_datasets_dist ("terminate called without an active exception",
    # no Python frame) after the body had passed. A failing body raised above and is reported
    # by torch's spawn wrapper as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


LAUNCH_ATTEMPTS = 3


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, env: dict[str, str] | None = None
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo processes; return results by rank.

    `free_port`'s port can be taken (another process's outgoing connection gets it as its
    ephemeral port) before rank 0's store listens on it; that launch fails in rendezvous, before
    `fn` runs, and is retried on a new port.
    """
    for attempt in range(LAUNCH_ATTEMPTS):
        try:
            return _launch(fn, world_size, args, env)
        except ProcessRaisedException as error:
            if "EADDRINUSE" not in str(error) or attempt == LAUNCH_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _launch(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], env: dict[str, str] | None
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    child_env = {"MESHLINE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    context = mp.start_processes(
        _child,
        args=(fn, world_size, free_port(), results, args, child_env),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    collected: dict[int, Any] = {}
    # Drain results while the children run (a large result would block a child on a full pipe);
    # join() raises with the child's traceback as soon as one fails.
    while True:
        _drain(results, collected)
        if context.join(timeout=0.2):
            break
    _drain(results, collected)
    return [collected[rank] for rank in range(world_size)]


def _drain(results: Any, collected: dict[int, Any]) -> None:
    while not results.empty():
        rank, payload = results.get()
        collected[rank] = pickle.loads(payload)  # our own children's results, not outside data
