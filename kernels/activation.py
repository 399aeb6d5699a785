"""MLP activations: SwiGLU, GeGLU and GeLU, plus packed [gate | up] variants.

The packed forms take the output of one fused gate+up projection (ModelLink's
`--mlp-layer-fusion`): its last dim holds the gate half followed by the up half. Results are
computed in the input dtype, exactly as HF transformers' MLPs do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import registry

GELU_APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu approximate={approximate!r}; use one of {GELU_APPROXIMATIONS}")


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeLU; approximate="tanh" is the GPT-2/Bloom form, "none" the exact erf form."""
    _check_approximate(approximate)
    return F.gelu(x, approximate=approximate)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def swiglu_packed_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu on the [gate | up] halves of the last dim."""
    gate, up = _split_packed(gate_up)
    return F.silu(gate) * up


SWIGLU = registry.define("swiglu", swiglu_reference)
SWIGLU_PACKED = registry.define("swiglu_packed", swiglu_packed_reference)
SWIGLU_PACKED.register("npu", ("npu",), "kernels.npu.activation:swiglu_packed")
# On CUDA the compiled SwiGLU measured 2.7x slower than the eager reference fwd+bwd (H200, bf16,
# [2, 2048, 5632]: 0.85 vs 0.31 ms; bench/RESULTS.md), so the reference stays the default there.
SWIGLU_PACKED.register(
    "compiled", ("cuda",), "kernels.cuda.compiled:swiglu_packed", preferred=False
)
SWIGLU.register("compiled", ("cuda",), "kernels.cuda.compiled:swiglu", preferred=False)
# Fused C forward/backward while training in fp32 (the gradient of gate | up written as one
# tensor, not concatenated); the reference otherwise (kernels/cpu/fused.py).
SWIGLU_PACKED.register("fused", ("cpu",), "kernels.cpu.fused:swiglu_packed")


def trains_fused_swiglu(device_type: str, precision: str) -> bool:
    """Whether training's packed SwiGLU runs the fused CPU kernel, which saves only its
    [gate | up] input for backward (models.memory's `fused_swiglu`): CPU, fp32, built."""
    return device_type == "cpu" and precision == "fp32" and SWIGLU_PACKED.default() == "fused"


def _split_packed(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"packed gate/up input must have an even last dim (gate | up), got {gate_up.shape[-1]}"
        )
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up


def _check_pair(gate: torch.Tensor, up: torch.Tensor, name: str) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape"
        )


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up (LLaMA's MLP)."""
    _check_pair(gate, up, "swiglu")
    return SWIGLU(gate, up, backend=backend)


def swiglu_packed(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """swiglu of a fused projection's output [..., 2F] -> [..., F]."""
    _split_packed(gate_up)
    return SWIGLU_PACKED(gate_up, backend=backend)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up."""
    _check_pair(gate, up, "geglu")
    return gelu(gate, approximate) * up


def geglu_packed(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """geglu of a fused projection's output [..., 2F] -> [..., F]."""
    gate, up = _split_packed(gate_up)
    return gelu(gate, approximate) * up


@dataclass(frozen=True)
class Activation:
    """A registered MLP activation; gated ones take (gate, up), plain ones take (x)."""

    name: str
    gated: bool
    fn: Callable[..., torch.Tensor]
    packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


ACTIVATIONS: dict[str, Activation] = {
    "swiglu": Activation("swiglu", gated=True, fn=swiglu, packed=swiglu_packed),
    "geglu": Activation("geglu", gated=True, fn=geglu, packed=geglu_packed),
    "gelu": Activation("gelu", gated=False, fn=gelu),
}


def get_activation(name: str) -> Activation:
    """The activation called `name`; ValueError listing the choices (the --activation flag)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
