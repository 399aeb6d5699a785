"""Tensor-parallel serving: shard a full CausalLM by the model's TP plan, on a process group.

The plan is read and applied by `parallel.tensor_parallel.apply_tensor_parallel` in its "serve"
mode, the same applier training uses (see `parallel.tp_serving` for the plain-tensor layouts:
row/column slices, vocabulary-parallel embedding, all-gathered logits). Every rank ends with
identical logits, so replicated engines make identical decisions.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from models.transformer import CausalLM
from parallel.tensor_parallel import apply_tensor_parallel


def shard_for_serving(model: CausalLM, group: dist.ProcessGroup) -> CausalLM:
    """Shard a full CausalLM in place for this rank of `group`; returns it."""
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, model.config, mode="serve")
    return model
