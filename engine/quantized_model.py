"""Serving a quantized checkpoint on its codes: the model's quantized linears become
`QuantLinear` layers (kernels/quant_linear.py) holding int8 / packed int4 codes and scales, never
a float copy of the weight.

A checkpoint that quantizes the token embedding too holds it as a `QuantEmbedding`
(kernels/quant_embedding.py: rows dequantized as they are looked up), and a tied output head as
a `QuantLinear` on the embedding's very tensors (`tie_quantized_head`).

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

from checkpoints.quantized_format import QuantizedSource, Scheme, quantized
from checkpoints.units import units
from kernels.quant_embedding import QuantEmbedding
from kernels.quant_linear import QuantLinear
from kernels.quantization import QuantizedWeight, WeightScheme, pack_int4, quantize_weight
from models.config import ModelConfig

StateDict = dict[str, torch.Tensor]


def read_quantized_state(
    directory: Path,
) -> tuple[ModelConfig, StateDict, dict[str, QuantizedWeight], Scheme, Path]:
    """(config, kept tensors, quantized weights by Meshline name, the recorded scheme (bits,
    groups, the embedding's, dtype), directory of the tokenizer files) of a quantized
    checkpoint."""
    source = QuantizedSource(directory)
    kept: StateDict = {}
    weights: dict[str, QuantizedWeight] = {}
    for unit in units(source.config):
        unit_kept, unit_weights = source.read_unit_quantized(unit)
        kept.update(unit_kept)
        weights.update(unit_weights)
    tokenizer_dir = source.tokenizer_files[0].parent if source.tokenizer_files else directory
    return source.config, kept, weights, source.scheme, tokenizer_dir


def swap_in_quant_linears(
    model: nn.Module,
    weights: dict[str, QuantizedWeight],
    scheme: WeightScheme,
    embedding: WeightScheme | None = None,
) -> StateDict:
    """Replace each linear whose weight `weights` names by a `QuantLinear`, and the token
    embedding, when named, by a `QuantEmbedding` (with a tied head: a `QuantLinear` that
    `tie_quantized_head` later points at the embedding's tensors), on the meta device (call
    before `to_empty`); returns the state entries (codes or packed, scale, zero) that
    `load_state_dict` then fills them with. Decoder weights are under `scheme`, the embedding
    and head under `embedding` (the checkpoint's)."""
    state: StateDict = {}
    for name, q in weights.items():
        path = name.removesuffix(".weight")
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        module = getattr(parent, leaf)
        own = scheme if name.startswith("layers.") else embedding
        if own is None:
            raise ValueError(f"{name}: quantized, but the checkpoint's scheme names no bits for it")
        bits = own.bits
        out, columns = q.codes.shape
        if name == "embed_tokens.weight":
            if type(module) is not nn.Embedding or tuple(module.weight.shape) != (out, columns):
                raise ValueError(
                    f"{name}: the checkpoint quantizes a {tuple(q.codes.shape)} table where the "
                    f"model has a {type(module).__name__}"
                )
            dtype = module.weight.dtype
            layer: nn.Module = QuantEmbedding(
                out, columns, bits, q.scale.shape[1], q.zero_point is None, dtype, device="meta"
            )
            if getattr(model.config, "tie_word_embeddings", False) and model.lm_head is not None:
                model.lm_head = layer.tied_linear()  # re-pointed after to_empty
        else:
            if type(module) is not nn.Linear or tuple(module.weight.shape) != (out, columns):
                have = getattr(getattr(module, "weight", None), "shape", None)
                raise ValueError(
                    f"{name}: the checkpoint quantizes a {tuple(q.codes.shape)} weight where the "
                    f"model has a {type(module).__name__} with weight {have}"
                )
            layer = QuantLinear(
                columns,
                out,
                bits,
                q.scale.shape[1],
                q.zero_point is None,
                module.bias is not None,
                device="meta",
                dtype=module.weight.dtype,
            )
        setattr(parent, leaf, layer)
        if bits == 8:
            state[f"{path}.codes"] = q.codes
        else:
            state[f"{path}.packed"] = pack_int4(q.codes)
        state[f"{path}.scale"] = q.scale
        if q.zero_point is not None:
            state[f"{path}.zero"] = q.zero_point
    return state


def tie_quantized_head(model: nn.Module) -> list[str]:
    """Point a tied head swapped in by `swap_in_quant_linears` at the embedding's codes, scales
    and zero points (after `to_empty`, which gave it storage of its own); returns the head's
    state names, which the checkpoint does not hold (the embedding's fill both)."""
    embedding = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(embedding, QuantEmbedding) or not isinstance(head, QuantLinear):
        return []
    if not model.config.tie_word_embeddings:
        return []
    model.lm_head = embedding.tied_linear()
    return [f"lm_head.{name}" for name, _ in model.lm_head.named_buffers()]


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the quantized layers' and embedding's codes, scales and zero points, bytes
    every other parameter and buffer takes), each tensor counted once (a tied head shares the
    embedding's)."""
    quantized = {
        id(t): t
        for m in model.modules()
        if isinstance(m, (QuantLinear, QuantEmbedding))
        for t in m.buffers()
    }
    every = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    quant = sum(t.numel() * t.element_size() for t in quantized.values())
    total = sum(t.numel() * t.element_size() for t in every.values())
    return quant, total - quant


def parameter_count(model: nn.Module) -> int:
    """Weights of `model` as a float model would count them, each stored tensor once: a
    quantized layer or embedding counts its out x in matrix (not its bytes of codes), a tied head
    sharing the embedding's codes counts once."""
    seen: set[int] = set()
    count = 0
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            codes = module.codes if module.bits == 8 else module.packed
            if codes.data_ptr() not in seen:
                seen.add(codes.data_ptr())
                rows, cols = codes.shape
                count += rows * cols * (1 if module.bits == 8 else 2)
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            count += param.numel()
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take in memory (parameters and buffers, each tensor once:
    a quantized model's codes, scales and zero points, not a float model's size)."""
    quant, other = quantized_bytes(model)
    return quant + other


def quantize_linears(
    model: nn.Module, scheme: WeightScheme, embedding: WeightScheme | None = None
) -> list[str]:
    """Round to nearest, in place, every linear a quantized checkpoint would store quantized (a
    2-D weight of a decoder layer: `checkpoints.quantized_format.quantized`) into a
    `QuantLinear` with the same bias, and with `embedding` the token embedding into a
    `QuantEmbedding` (a tied head onto its codes, an untied one into a QuantLinear), as a
    checkpoint with that embedding scheme is served; returns the weights' names. ValueError
    (naming the weight) where a layer's inputs do not split into the scheme's groups."""
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
    if embedding is not None:
        table = model.embed_tokens.weight.detach()
        tied = model.config.tie_word_embeddings
        model.embed_tokens = QuantEmbedding.from_weight(
            quantize_weight(table, embedding), embedding.bits, table.dtype
        )
        names.append("embed_tokens.weight")
        if tied:
            model.lm_head = model.embed_tokens.tied_linear()
        elif type(model.lm_head) is nn.Linear:
            head = model.lm_head
            q = quantize_weight(head.weight.detach(), embedding)
            bias = None if head.bias is None else head.bias.detach()
            model.lm_head = QuantLinear.from_weight(q, embedding.bits, bias)
            names.append("lm_head.weight")
    return names
