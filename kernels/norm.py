"""RMSNorm and LayerNorm with fp32 accumulation; output in the input dtype.

Shapes: x [..., E] (E the normalised hidden size), weight/bias [E].
The references follow HF transformers' LlamaRMSNorm exactly: normalise in fp32, cast back to the
input dtype, then scale by the weight, so fp32 and same-dtype results are bit-identical to HF.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import registry


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, accumulated in fp32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias, accumulated in fp32."""
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    out = (x32 - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """torch's fused layer_norm kernel on an fp32 upcast."""
    return F.layer_norm(
        x.float(),
        (x.shape[-1],),
        None if weight is None else weight.float(),
        None if bias is None else bias.float(),
        eps,
    ).to(x.dtype)


RMS_NORM = registry.define("rms_norm", rms_norm_reference)
RMS_NORM.register("npu", ("npu",), "kernels.npu.norm:rms_norm")
RMS_NORM.register("compiled", ("cuda",), "kernels.cuda.compiled:rms_norm")
# Fused C forward/backward while training in fp32; the reference otherwise (kernels/cpu/fused.py).
RMS_NORM.register("fused", ("cpu",), "kernels.cpu.fused:rms_norm")

LAYER_NORM = registry.define("layer_norm", layer_norm_reference)
LAYER_NORM.register("torch", ("cpu", "cuda", "npu"), layer_norm_torch)


def _check(x: torch.Tensor, weight: torch.Tensor | None, eps: float, op: str) -> None:
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)} but x's last dim is {x.shape[-1]}; "
            "they must match"
        )
    if eps <= 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str | None = None
) -> torch.Tensor:
    """RMS normalisation over the last dim (fp32 accumulation, output in x's dtype)."""
    _check(x, weight, eps, "rms_norm")
    return RMS_NORM(x, weight, eps, backend=backend)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Layer normalisation over the last dim (fp32 accumulation, output in x's dtype)."""
    _check(x, weight, eps, "layer_norm")
    return LAYER_NORM(x, weight, bias, eps, backend=backend)


class RMSNorm(nn.Module):
    """RMSNorm with a learnable `weight` (initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """Weight back to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm with a learnable `weight` (ones) and optional `bias` (zeros)."""

    def __init__(
        self, dim: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def reset_parameters(self) -> None:
        """Weight to ones, bias to zeros."""
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
