"""A DPO reference held in the policy's own layout: its weights swapped into the policy to score.

Under tensor or pipeline parallelism and with sharded weights (ZeRO-2/3) a rank holds only its
shards of the policy, so a frozen copy of "the model" is not at hand. The reference is kept
instead as a copy of exactly this rank's parameter shards (DTensors keep their placements; a
pipeline rank keeps its stages'), and scoring under it copies them into the policy's parameters,
runs the policy's own forward (the same TP, pipeline and FSDP2 machinery) without gradients and
in eval mode, and copies the policy's values back. It therefore costs the memory of one shard
per rank, as the policy does, and runs before any forward of the step whose graph would hold
the parameters (`DPOLoss.prepare_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor


class SwappedReference:
    """Reference values of `model`'s parameters, by global name."""

    def __init__(self, model: nn.Module, values: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.values = values

    @classmethod
    def snapshot(cls, model: nn.Module) -> SwappedReference:
        """The current values of this rank's parameters (the weights the run starts from)."""
        with torch.no_grad():
            values = {name: p.detach().clone() for name, p in model.named_parameters()}
        return cls(model, values)

    @classmethod
    def from_state(cls, model: nn.Module, state: dict[str, torch.Tensor]) -> SwappedReference:
        """This rank's shards of a whole reference's `state` (global names, plain tensors), laid
        out as `model`'s parameters are."""
        values = {}
        with torch.no_grad():
            for name, param in model.named_parameters():
                full = state[name].to(device=param.device, dtype=param.dtype)
                if isinstance(param, DTensor):
                    full = distribute_tensor(full, param.device_mesh, param.placements)
                values[name] = full
        return cls(model, values)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the block with the reference's weights in the policy, no gradients, eval mode."""
        params = dict(self.model.named_parameters())
        training = self.model.training
        _reshard(self.model)  # an unsharded FSDP2 copy would keep the policy's weights in use
        kept: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for name, value in self.values.items():
                    kept[name] = params[name].detach().clone()
                    params[name].copy_(value)
            for root in _roots(self.model):
                root.eval()
            with torch.no_grad():
                yield
        finally:
            _reshard(self.model)
            with torch.no_grad():
                for name, value in kept.items():
                    params[name].copy_(value)
            for root in _roots(self.model):
                root.train(training)


def _roots(model: nn.Module) -> list[nn.Module]:
    """`model`, or a pipeline rank's stage chunks (`PipelineRankModel.chunks`, which it does not
    register as children)."""
    return list(getattr(model, "chunks", None) or [model])


def _reshard(model: nn.Module) -> None:
    """Free FSDP2's gathered parameters, so the next forward gathers the shards anew."""
    for root in _roots(model):
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
