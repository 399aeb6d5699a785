"""Serving a quantized checkpoint on its codes: the model's quantized linears become
`QuantLinear` layers (kernels/quant_linear.py) holding int8 / packed int4 codes and scales, never
a float copy of the weight.

`meshline serve` / `generate` / `evaluate` load a quantized checkpoint this way by default
(`engine.loading.load_checkpoint`, chosen from the checkpoint's `quantization.json`); a LoRA
adapter to merge (`--lora-load`) or a tensor-/pipeline-parallel server, which reshard float
weights, get the dequantized model instead. The layers are swapped on the meta device before
any memory is allocated, so the float weights of the quantized matrices never exist: the peak
and resident memory are the quantized model's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from checkpoints.quantized_format import QuantizedSource, quantized
from checkpoints.units import units
from kernels.quant_linear import QuantLinear
from kernels.quantization import QuantizedWeight, WeightScheme, pack_int4, quantize_weight
from models.config import ModelConfig

StateDict = dict[str, torch.Tensor]


def read_quantized_state(
    directory: Path,
) -> tuple[ModelConfig, StateDict, dict[str, QuantizedWeight], WeightScheme, torch.dtype, Path]:
    """(config, kept tensors, quantized weights by Meshline name, scheme, recorded dtype,
    directory of the tokenizer files) of a quantized checkpoint."""
    source = QuantizedSource(directory)
    kept: StateDict = {}
    weights: dict[str, QuantizedWeight] = {}
    for unit in units(source.config):
        unit_kept, unit_weights = source.read_unit_quantized(unit)
        kept.update(unit_kept)
        weights.update(unit_weights)
    tokenizer_dir = source.tokenizer_files[0].parent if source.tokenizer_files else directory
    scheme = source.scheme
    return source.config, kept, weights, scheme.weights, scheme.dtype, tokenizer_dir


def swap_in_quant_linears(
    model: nn.Module, weights: dict[str, QuantizedWeight], scheme: WeightScheme
) -> StateDict:
    """Replace each linear whose weight `weights` names by a `QuantLinear` on the meta device
    (call before `to_empty`); returns the state entries (codes or packed, scale, zero) that
    `load_state_dict` then fills them with."""
    state: StateDict = {}
    for name, q in weights.items():
        path = name.removesuffix(".weight")
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, leaf)
        if type(linear) is not nn.Linear or tuple(linear.weight.shape) != tuple(q.codes.shape):
            have = getattr(getattr(linear, "weight", None), "shape", None)
            raise ValueError(
                f"{name}: the checkpoint quantizes a {tuple(q.codes.shape)} weight where the "
                f"model has a {type(linear).__name__} with weight {have}"
            )
        out, columns = q.codes.shape
        layer = QuantLinear(
            columns,
            out,
            scheme.bits,
            q.scale.shape[1],
            q.zero_point is None,
            linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        setattr(parent, leaf, layer)
        if scheme.bits == 8:
            state[f"{path}.codes"] = q.codes
        else:
            state[f"{path}.packed"] = pack_int4(q.codes)
        state[f"{path}.scale"] = q.scale
        if q.zero_point is not None:
            state[f"{path}.zero"] = q.zero_point
    return state


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the QuantLinear layers' codes, scales and zero points, bytes every other
    parameter and buffer takes)."""
    quant = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantLinear))
    total = sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    )
    return quant, total - quant


def quantize_linears(model: nn.Module, scheme: WeightScheme) -> list[str]:
    """Round to nearest, in place, every linear a quantized checkpoint would store quantized (a
    2-D weight of a decoder layer: `checkpoints.quantized_format.quantized`) into a
    `QuantLinear` with the same bias; returns the weights' names. ValueError (naming the weight)
    where a layer's inputs do not split into the scheme's groups."""
    names = [
        name
        for name, param in model.named_parameters()
        if quantized(name, tuple(param.shape))
        and type(model.get_submodule(name.removesuffix(".weight"))) is nn.Linear
    ]
    for name in names:
        path = name.removesuffix(".weight")
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, leaf)
        try:
            q = quantize_weight(linear.weight.detach(), scheme)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(parent, leaf, QuantLinear.from_weight(q, scheme.bits, bias))
    return names
