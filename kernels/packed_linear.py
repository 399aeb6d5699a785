"""Linear layers with weights repacked once for inference (oneDNN's blocked layout on CPU).

Shapes: x [..., I] (I input features), weight [O, I], out [..., O].

The reference is `F.linear`. On CPU, MKL's path for a [O, I] row-major weight is slow for the
few-row inputs of decoding (a batch of 2..32 new tokens); oneDNN with the weight reordered once
into its blocked format runs those shapes 1.3-1.8x faster and large prefills a little faster
too (the prepacking torch.compile's CPU freezing does). The packed tensor replaces the dense
weight, so memory stays the same, but the layer is inference-only: no autograd, no state dict.

A single input row (batch-1 decoding) is a matrix-vector product, faster (~1.25x here) through
MKL's gemv on a plain W than on oneDNN's packed weight; `gemv_copy=True` keeps the dense W beside
the packed one for those calls (and for the engine's decode step in C, engine/native_step.py),
at the price of a second copy of the weight.
Results match `F.linear` up to fp32 summation order (tested against the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32,)
"""Dtypes whose weights are repacked (bf16 oneDNN needs CPU support checked per machine)."""


def can_pack(linear: nn.Module) -> bool:
    """Whether `linear` is a plain CPU nn.Linear whose weight this module can repack."""
    if type(linear) is not nn.Linear:
        return False
    weight = linear.weight
    return (
        type(weight) is nn.Parameter
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        and _onednn_available()
    )


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (built from an nn.Linear)."""

    def __init__(self, linear: nn.Linear, gemv_copy: bool = False) -> None:
        super().__init__()
        if not can_pack(linear):
            raise ValueError(
                f"PackedLinear: {linear!r} is not a hook-free CPU nn.Linear in "
                f"{PACKED_DTYPES}; keep it as it is"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        """The packed [O, I] weight (an opaque oneDNN tensor: only its shape is readable)."""
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.gemv_weight = linear.weight.detach() if gemv_copy else None
        """W [O, I] as the layer held it (row-major), for single-row inputs (None without
        gemv_copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same result as the nn.Linear it came from."""
        if self.gemv_weight is not None and x.numel() == self.in_features:
            return F.linear(x, self.gemv_weight, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def _packed_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def _packed_linear_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed_weight.shape[0]))


# torch.compile calls this op as it is: inductor lowers oneDNN's own linear only for weights it
# packed itself, as constants of a frozen graph. A plain library op, not torch.library.custom_op,
# whose Python wrapping costs more per call.
_LIB = torch.library.Library("meshline", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("meshline::packed_linear", _packed_linear_fake, lib=_LIB)
packed_linear = torch.ops.meshline.packed_linear
"""x W^T + b with W packed by oneDNN (PackedLinear's op inside compiled graphs)."""


def pack_linears(
    model: nn.Module, skip: tuple[str, ...] = (), gemv_copy: bool = False
) -> list[str]:
    """Replace every packable nn.Linear of `model` (in place) by a PackedLinear; returns the
    names replaced. Modules named in `skip` (say a head tied to the embedding) stay."""
    replaced = []
    for name, module in list(model.named_modules()):
        if name in skip or not can_pack(module):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, PackedLinear(module, gemv_copy))
        replaced.append(name)
    return replaced
