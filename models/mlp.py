"""The dense feed-forward block of a decoder layer (also the MoE shared experts).

Shapes: B batch, S sequence, E hidden, F ffn. Architecture only; a leaf module of `models/` (it
imports no other model file), so `models/transformer.py` and `models/moe.py` both build on it.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import activation as act

GATED_ACTIVATIONS = ("swiglu", "geglu")
PLAIN_GELU = {"gelu": "tanh", "gelu_exact": "none"}
"""Ungated activations → torch's `approximate` argument of GeLU."""


class MLP(nn.Module):
    """Gated (SwiGLU / GeGLU) or plain GeLU (tanh or erf) feed-forward block of width `ffn`."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        fused_gate_up: bool = True,
    ) -> None:
        super().__init__()
        gated = activation in GATED_ACTIVATIONS
        self.activation = activation
        self.fused = gated and fused_gate_up
        if self.fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * ffn, bias=bias)
        else:
            if gated:
                self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
            self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x_BSE: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) for gated activations, down(gelu(up(x))) otherwise."""
        if self.fused:
            packed = act.swiglu_packed if self.activation == "swiglu" else act.geglu_packed
            return self.down_proj(packed(self.gate_up_proj(x_BSE)))
        if not self.fused and self.activation in PLAIN_GELU:
            approximate = PLAIN_GELU[self.activation]
            return self.down_proj(act.gelu(self.up_proj(x_BSE), approximate=approximate))
        gated = act.swiglu if self.activation == "swiglu" else act.geglu
        return self.down_proj(gated(self.gate_proj(x_BSE), self.up_proj(x_BSE)))
