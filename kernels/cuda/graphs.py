"""CUDA graph capture of a fixed-shape function (what engine/cuda_graphs.py replays).

The device layer's part of graphed decoding: a memory pool graphs can share; `warm_up`, which
runs the function once eagerly on a side stream (lazy cuBLAS set-up, kernel compiles and
autotuning happen there, never under capture); and `capture`, which records it into a graph.
Capture errors are thread-local: another thread's CUDA work does not invalidate a capture in
progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Graph = torch.cuda.CUDAGraph


def new_pool() -> Any:
    """A memory pool handle several graphs can share (they replay one at a time)."""
    return torch.cuda.graph_pool_handle()


def warm_up(fn: Callable[[], Any]) -> None:
    """Run `fn` once on a side stream, ordered after and before the current stream's work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)


def capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, torch.Tensor]:
    """Record `fn` into a new graph (its kernels are not run); the graph and `fn`'s output,
    which each replay rewrites in place."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
