"""CUDA graphs of the one-token decode step: the engine's default decode on a CUDA device.

Shapes: B active rows, S key slots the step reads (a bucket), V vocab.

A decode step of a ~1B model on a GPU is bound by the host, not the device: each layer launches
a few dozen kernels and every launch costs microseconds of Python and driver time, so the GPU
waits (measured on an H200: 8.6 ms per token for 1.2B parameters, whose weights stream in under
1 ms). A CUDA graph records the step's kernels once and replays them with one launch, as vLLM's
and SGLang's decoders do.

A graph replays fixed addresses and shapes. `DecodeStep.static` is the step written that way:
it reads each row's position from the cache's own `lengths_B` on the device, scatters the new
key/value there, attends over a fixed number of slots S under the key mask and commits in place.
So one graph serves every step with the same active row count B and slot bucket S: S is the
smallest power of two from 256 up (at most the cache's slots) that holds every row after the
step, so a short conversation does not attend over the whole context. Graphs are captured on
first use of their (B, S), after one eager warm-up run (which also compiles or autotunes any
kernel the step calls) whose writes are undone, and share one memory pool; at most
`max_graphs` are kept (least recently used first out).

The graphs read the pool's buffers in place, so rows must stay where `SlotPool` keeps them (its
`gather` copies in place; nothing rebinds the buffers). The host sets the token ids into a
static input and reads a copy of the logits. Rings (sliding windows) keep the eager step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from engine.config_support import FieldSupport, declined
from engine.decode_step import LEAN_SUPPORT, DecodeStep
from kernels.cuda import graphs
from models.kv_cache import KVCache

log = logging.getLogger(__name__)

GRAPH_SUPPORT: dict[str, FieldSupport] = dict(LEAN_SUPPORT)
"""The graphs' row for every ModelConfig field: they replay the lean step (`DecodeStep.static`),
so they implement what it implements (engine/config_support.py)."""

MIN_BUCKET = 256
"""The shortest slot bucket a graph attends over."""


def slot_bucket(key_len: int, slots: int) -> int:
    """Slots a graph reads for a step whose longest row has `key_len` keys after it: the
    smallest power of two >= key_len (at least MIN_BUCKET), at most the cache's `slots`."""
    if not 0 < key_len <= slots:
        raise ValueError(f"slot_bucket: key_len={key_len} must be in [1, slots={slots}]")
    bucket = MIN_BUCKET
    while bucket < key_len:
        bucket *= 2
    return min(bucket, slots)


class _Graph:
    """One captured (or, without CUDA, directly run) static step for B rows over S slots."""

    def __init__(
        self,
        run: Callable[[torch.Tensor], torch.Tensor],
        ids_B1: torch.Tensor,
        logits_BV: torch.Tensor,
        graph: graphs.Graph | None,
    ) -> None:
        self.run = run
        self.ids_B1 = ids_B1
        self.logits_BV = logits_BV
        self.graph = graph

    def __call__(self, ids_B1: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            return self.run(ids_B1)  # a fresh tensor each call
        self.ids_B1.copy_(ids_B1, non_blocking=True)
        self.graph.replay()
        # A copy: the next replay of any graph sharing the pool may reuse the output's memory.
        return self.logits_BV.clone()


class GraphedDecode:
    """Decode steps over the first B rows of one KV cache, replayed from CUDA graphs.

    `capture=False` runs the same static step without capturing it (on CPU: what the tests
    exercise beside the CUDA ones)."""

    def __init__(
        self,
        step: DecodeStep,
        cache: KVCache,
        *,
        capture: bool = True,
        max_graphs: int = 64,
    ) -> None:
        if cache.is_ring:
            raise ValueError("GraphedDecode: sliding-window rings keep the eager decode step")
        reason = declined(step.config, GRAPH_SUPPORT)
        if reason is not None:
            raise ValueError(f"GraphedDecode: {reason}")
        self.step = step
        self.cache = cache
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.captures = 0
        self._pool: Any = graphs.new_pool() if capture else None

    def __call__(self, ids_B1: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Logits [B, V] for rows [0, B) fed `ids_B1`, whose cached lengths are `lengths` (the
        host's copy, which picks the bucket); the cache advances by one token per row."""
        rows = ids_B1.shape[0]
        key = (rows, slot_bucket(max(lengths) + 1, self.cache.slots))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._build(ids_B1, *key)
            self.graphs[key] = graph
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        return graph(ids_B1)

    def _build(self, ids_B1: torch.Tensor, rows: int, slots: int) -> _Graph:
        cache = self.cache

        def run(ids: torch.Tensor) -> torch.Tensor:
            return self.step.static(ids, cache, rows, slots)

        if not self.capture:
            return _Graph(run, ids_B1, ids_B1, None)
        static_ids_B1 = ids_B1.clone()
        # Warm-up (lazy cuBLAS set-up, kernel compiles and autotuning happen here, not under
        # capture): its writes past each row's end are rewritten by the real step, and the mask
        # and lengths it advanced are put back. Capturing records kernels without running them,
        # so the cache is untouched.
        lengths_B = cache.lengths_B[:rows].clone()
        mask_BS = cache.key_mask_BS[:rows].clone()
        graphs.warm_up(lambda: run(static_ids_B1))
        cache.lengths_B[:rows].copy_(lengths_B)
        cache.key_mask_BS[:rows].copy_(mask_BS)
        graph, logits_BV = graphs.capture(lambda: run(static_ids_B1), self._pool)
        self.captures += 1
        log.info("decode: captured a CUDA graph for %d row(s) over %d slots", rows, slots)
        return _Graph(run, static_ids_B1, logits_BV, graph)
