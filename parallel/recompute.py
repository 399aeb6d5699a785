"""Activation recompute: full (whole decoder layers) or selective (all but the matmul outputs).

Megatron's flags: `--recompute-granularity full` with `--recompute-method uniform` recomputes
every layer (layers are the unit; `--recompute-num-layers` > 1 groups them in Megatron, here each
layer of a group is checkpointed on its own, which saves the same activations), `block`
recomputes only the first `--recompute-num-layers` layers of each pipeline stage.
`--recompute-granularity selective` is torch's selective activation checkpointing with a
per-op policy: the outputs of matrix multiplications (and of tensor-parallel collectives) are
saved, everything else is recomputed in backward — the attention core, as in Megatron's
selective recompute, and the cheap pointwise ops (norms, activations, rotary, residual adds).
Not "save all but attention": the policy's cache keeps every saved op's output, also those
autograd would have freed, so that variant held more memory than no recompute at all
(`bench/bench_parallel.py --recompute`: 1.57x; this policy: 0.63x, full recompute 0.31x).

The layer's `forward` is wrapped in place, so module and parameter names (checkpoint keys) are
unchanged; apply before FSDP, as DESIGN §1.5 orders.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def _saved_ops() -> set[Any]:
    """Ops whose outputs selective recompute keeps: matmuls (costly to redo) and tensor-parallel
    collectives (redoing them would repeat communication in backward)."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in (
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ):
        if hasattr(c10d, name):
            ops.add(getattr(c10d, name).default)
    return ops


def _selective_policy(saved: set[Any]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def wrap_layer(layer: nn.Module, granularity: str) -> None:
    """Make `layer.forward` recompute in backward: all of it (`full`) or all but the matmul
    outputs (`selective`)."""
    inner = layer.forward
    if granularity == "full":
        layer.forward = functools.partial(checkpoint, inner, use_reentrant=False)  # type: ignore[method-assign]
        return
    contexts = functools.partial(
        create_selective_checkpoint_contexts, _selective_policy(_saved_ops())
    )
    layer.forward = functools.partial(  # type: ignore[method-assign]
        checkpoint, inner, use_reentrant=False, context_fn=contexts
    )


def layers_to_recompute(
    layer_ids: list[int], granularity: str, method: str | None, num_layers: int | None
) -> list[int]:
    """Which of a stage's layers (global ids, in order) recompute under the Megatron flags."""
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"--recompute-granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )
    if granularity == "selective" or method in (None, "uniform"):
        return list(layer_ids)
    if method != "block":
        raise ValueError(f"--recompute-method must be one of {METHODS}, got {method!r}")
    count = len(layer_ids) if num_layers is None else num_layers
    if count < 0:
        raise ValueError(f"--recompute-num-layers must be >= 0, got {count}")
    return list(layer_ids)[:count]


def apply_recompute(
    model: nn.Module, granularity: str, method: str | None = None, num_layers: int | None = None
) -> list[int]:
    """Wrap the chosen decoder layers of `model` (its `layers` ModuleDict); returns their ids."""
    layers = cast(nn.ModuleDict, model.layers)
    ids = [int(key) for key in layers]
    chosen = layers_to_recompute(ids, granularity, method, num_layers)
    for layer_id in chosen:
        wrap_layer(layers[str(layer_id)], granularity)
    return chosen
