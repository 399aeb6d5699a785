"""Pipeline-parallel serving: each process holds a consecutive range of layers (one stage).

Shapes: B batch, S sequence, E hidden, V vocab.

Stage r runs its layers on the hidden states stage r-1 sent (stage 0 embeds the token ids) and
sends its output to stage r+1; the last stage applies the final norm and head, and broadcasts
the logits so every rank's replicated engine makes the same decisions (see leader_follower.py).
Each stage's KV cache holds only its layers; all stages see the same rows and lengths, so RoPE
positions and masks agree. Micro-batching is not done: one request batch flows through the
stages at a time, so this serves models too large for one process rather than adding throughput.
With tensor parallelism (tp × pp ranks, rank = stage · tp + tp rank) each stage is sharded over
its tp ranks, which all end with the same hidden states; each sends them to its peer in the next
stage, and the last stage's first rank broadcasts the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.engine import EngineConfig, head_logits, hidden_states
from engine.leader_follower import LeaderFollowerEngine
from engine.tokens import TokenizerInfo
from models.kv_cache import KVCache
from models.pipeline import StageRange, build_stage, split_stages
from models.transformer import CausalLM


def keep_stage(model: CausalLM, rank: int, pp_size: int) -> tuple[StageRange, int]:
    """Prune a full model in place to pipeline rank `rank`'s stage; (stage, number of stages)."""
    config = model.config
    if config.num_layers < pp_size:
        raise ValueError(
            f"--pipeline-parallel-size {pp_size} exceeds the model's {config.num_layers} layers"
        )
    stages = split_stages(config.num_layers, pp_size)
    build_stage(model, stages[rank])
    return stages[rank], len(stages)


class PipelineEngine(LeaderFollowerEngine):
    """The engine of one pipeline stage (rank 0 = first stage, leads)."""

    runs_own_forward = True

    def __init__(
        self,
        model: CausalLM,
        tokens: TokenizerInfo,
        config: EngineConfig,
        stage: StageRange,
        num_stages: int,
        tp_size: int = 1,
    ) -> None:
        super().__init__(model, tokens, config)
        self.stage = stage
        # With tensor parallelism every stage spans tp_size consecutive ranks; tp rank j of
        # one stage talks to tp rank j of the next (all of a stage hold the same hidden states).
        self.tp_size = tp_size
        self.last_rank = (num_stages - 1) * tp_size
        self.dtype = next(model.parameters()).dtype

    def _stage_forward(self, ids_BS: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
        """Run this stage; the last stage returns its (normed) hidden states, others None."""
        x: torch.Tensor = ids_BS
        if not self.stage.has_embedding:
            b, s = ids_BS.shape
            x = torch.empty(
                b, s, self.model.config.hidden_size, dtype=self.dtype, device=self.device
            )
            dist.recv(x, src=self.rank - self.tp_size)
        h_BSE = hidden_states(self.model, x, **kwargs)
        if self.stage.has_head:
            return h_BSE
        dist.send(h_BSE.contiguous(), dst=self.rank + self.tp_size)
        return None

    def _broadcast_logits(
        self, logits: torch.Tensor | None, shape: tuple[int, ...]
    ) -> torch.Tensor:
        if logits is None:
            logits = torch.empty(shape, dtype=self.dtype, device=self.device)
        logits = logits.contiguous()
        dist.broadcast(logits, src=self.last_rank)
        return logits

    def _last_logits(self, ids_BS: torch.Tensor, view: KVCache) -> torch.Tensor:
        h_BSE = self._stage_forward(ids_BS, kv_cache=view)
        logits = None if h_BSE is None else head_logits(self.model, h_BSE[:, -1])
        return self._broadcast_logits(logits, (ids_BS.shape[0], self.tokens.vocab_size))

    def _full_logits(
        self, ids_BS: torch.Tensor, mask_BS: torch.Tensor | None, kv_cache: KVCache | None
    ) -> torch.Tensor:
        h_BSE = self._stage_forward(ids_BS, key_padding_mask_BS=mask_BS, kv_cache=kv_cache)
        logits = None if h_BSE is None else head_logits(self.model, h_BSE)
        return self._broadcast_logits(logits, (*ids_BS.shape, self.tokens.vocab_size))
