"""Run a function on N real processes joined in a gloo process group (no mocks).

    def _body(rank, world_size, scale):      # module level, so `spawn` can pickle it
        t = torch.ones(1) * rank * scale
        torch.distributed.all_reduce(t)
        return t.item()

    assert run_distributed(_body, 2, 3.0) == [3.0, 3.0]

Each child gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
joins through `kernels.device.init_distributed`, runs the body, and sends its return value back.
A child's exception fails the caller with the child's traceback.

As under torchrun, the rendezvous store is the launcher's: this process hosts a TCPStore on a
port the OS assigns as it binds, and every rank joins it as a client
(TORCHELASTIC_USE_AGENT_STORE). A port picked free and handed to rank 0 to bind later could be
taken meanwhile. Under pytest-xdist, another worker's launch could even get the same port. Its
ranks then met this launch's store: one CI run failed with a rank timing out on a port whose
store had already finished with somebody else's rank 1.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore


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


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, env: dict[str, str] | None = None
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo processes; return results by rank."""
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    child_env = {
        "MESHLINE_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **(env or {}),
    }
    context = mp.start_processes(
        _child,
        args=(fn, world_size, store.port, results, args, child_env),
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
    del store  # the children are gone; the store's server stops with its last reference
    return [collected[rank] for rank in range(world_size)]


def _drain(results: Any, collected: dict[int, Any]) -> None:
    while not results.empty():
        rank, payload = results.get()
        collected[rank] = pickle.loads(payload)  # our own children's results, not outside data
