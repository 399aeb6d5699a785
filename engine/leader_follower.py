"""Multi-process serving, engine side: every rank runs the same `Engine`; rank 0 leads.

Rank 0 owns the request queue: at the start of each step it broadcasts the step's new requests
and cancellations (and score batches, resets, and the final stop) to the other ranks, which wait
for these commands in `follow()`. Every rank ends each forward with identical logits —
all-gathered under tensor parallelism (`engine.tensor_parallel`), broadcast from the last stage
under pipeline parallelism (`engine.pipeline_engine`) — and per-request generators are seeded
identically, so all ranks pick the same tokens and their caches stay in lock step without
sending tokens around.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.engine import Engine
from engine.requests import GenerationRequest, ScoreResult
from engine.tokens import TokenizerInfo
from models.transformer import CausalLM

STEP, SCORE, RESET, STOP = "step", "score", "reset", "stop"


class LeaderFollowerEngine(Engine):
    """An Engine on one serving rank; rank 0 leads, the others `follow()` its commands."""

    pages_kv = False  # every rank's rows must match; the paged cache is single-process for now

    def __init__(
        self,
        model: CausalLM,
        tokens: TokenizerInfo,
        config: EngineConfig,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0) if group is not None else 0
        self._received: tuple[list[GenerationRequest], set[int]] = ([], set())
        super().__init__(model, tokens, config)

    def _agree_rows(self, rows: int, device: torch.device) -> int:
        """The fewest rows any rank's budget allows (pipeline stages hold different layers, so
        their plans differ; every rank must run the same rows)."""
        agreed = torch.tensor([rows], dtype=torch.long)
        if device.type != "cpu":  # the accelerator's backend (NCCL, HCCL) reduces there
            agreed = agreed.to(device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return int(agreed.item())

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
