"""`--compile`: torch.compile each decoder layer, in place, as torchtitan applies it.

Per block rather than the whole model: every layer has the same code, so dynamo traces one
graph and the others reuse it (compile time does not grow with depth), and the embedding, head
and loss stay eager where their shapes vary. Applied after tensor parallelism and activation
recompute (the compiled graph contains the DTensor redistributions and the checkpointed region)
and before FSDP (DESIGN §1.5's order), with `nn.Module.compile`, which keeps module and
parameter names — and so checkpoint keys — unchanged.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from kernels import registry

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module) -> list[int]:
    """Compile every decoder layer of `model` (its `layers` ModuleDict); returns their ids."""
    layers = cast(nn.ModuleDict, model.layers)
    # A pipeline chunk's or CP/TP rank's layers share code and shapes: one cache entry each.
    torch._dynamo.config.cache_size_limit = max(
        torch._dynamo.config.cache_size_limit, 8 * max(len(layers), 1)
    )
    registry.preload()  # backend choices and imports happen here, not inside the traced graph
    ids = []
    for key, layer in layers.items():
        layer.compile()
        ids.append(int(key))
    log.info("torch.compile: %d decoder layers compiled per block", len(ids))
    return ids
