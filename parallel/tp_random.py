"""Dropout randomness under tensor parallelism (what Megatron's model-parallel RNG tracker does).

Two kinds of activation need different random streams inside a tensor-parallel group:

- replicated activations (the residual stream without sequence parallelism): every TP rank holds
  the same tensor and must draw the same dropout mask, or the ranks' copies drift apart. The
  trainer seeds the default generators alike on the ranks of a TP group (`tp_seed_offset`) and
  these regions use them as they are;
- sharded activations (the attention probabilities of this rank's heads; with sequence
  parallelism, the residual stream's sequence shard): each rank holds different elements and
  needs masks of its own — one shared stream would repeat the same pattern on every shard.

`install_tp_rng_regions` hooks the sharded regions. On entry a region draws a seed from the
default generator (every TP rank draws the same one, and `torch.utils.checkpoint` restores that
generator before it recomputes, so a recompute draws it again), reseeds the CPU and device
generators with that seed plus the TP rank, and on exit restores them. Models stay free of
parallel code: the regions are forward hooks added from outside, and only where a dropout
probability is set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import device
from models.config import ModelConfig
from models.transformer import Attention, DecoderLayer

_SEED_RANGE = 2**62


def tp_seed_offset(rank: int, tp: int) -> int:
    """The seed offset of global `rank`: equal on the ranks of one TP group (tp is the innermost
    mesh axis), different across data, context, pipeline and expert-parallel coordinates."""
    return rank // tp


class _Region:
    """Forward hooks that run a module on a generator stream of this TP rank's own."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self.saved: list[device.TorchRngStates] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        if not module.training:
            return
        seed = int(torch.randint(0, _SEED_RANGE, (1,)).item())
        self.saved.append(device.reseed_torch_generators(seed + self.tp_rank))

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            device.restore_torch_generators(self.saved.pop())


def install_tp_rng_regions(
    model: nn.Module, config: ModelConfig, tp_rank: int, *, sequence_parallel: bool
) -> list[str]:
    """Hook the modules of `model` whose dropout acts on TP-sharded activations; return their names.

    Attention modules when `attention_dropout` > 0 (their heads are sharded); with sequence
    parallelism, whole decoder layers when `hidden_dropout` > 0 (their residual stream is a
    sequence shard). Without sequence parallelism the hidden dropout stays on the shared stream.
    """
    hooked: list[str] = []
    for name, module in model.named_modules():
        sharded_heads = isinstance(module, Attention) and config.attention_dropout > 0
        sharded_sequence = (
            isinstance(module, DecoderLayer) and sequence_parallel and config.hidden_dropout > 0
        )
        if sharded_heads or sharded_sequence:
            region = _Region(tp_rank)
            module.register_forward_pre_hook(region.enter)
            module.register_forward_hook(region.leave, always_call=True)
            hooked.append(name)
    return hooked
