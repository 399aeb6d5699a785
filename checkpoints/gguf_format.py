"""GGUF checkpoints (llama.cpp's single-file format) read as a conversion source.

`--load-dir` names the `.gguf` file or a directory holding exactly one. The `gguf` package's
`GGUFReader` memory-maps the file and parses its metadata and tensor table; Meshline's own
dequantizers (`gguf_quants.py`) turn each tensor's blocks into float32, one unit at a time (every
ggml type is exact in float32; `--dtype` picks the output's). Before any weight is read the reader checks that every tensor has
a supported type, a known name and a byte size that matches its shape, and refuses the file
naming the first offender otherwise.

llama.cpp stores the rows of each attention head's Q and K projections interleaved for its
rotary layout (`LlamaModel.permute` in convert_hf_to_gguf.py: the two halves of a head's rotary
pairs alternate); `unpermute` undoes that exactly (the inverse reshape/transpose, as transformers'
GGUF loader does), so the weights are the HF Llama layout Meshline's RoPE expects.

The config comes from the metadata through an HF config dict and the tokenizer is written as HF
files into a private temporary directory that lives as long as the source (`gguf_metadata.py`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from checkpoints.gguf_metadata import field_values, hf_config_dict, write_tokenizer
from checkpoints.gguf_quants import (
    NAMES,
    dequantize,
    require_gguf,
    row_bytes,
    supported_list,
    type_name,
)
from checkpoints.units import POST, PRE, Tensors, Unit, reconcile, units
from models.accounting import count_parameters
from models.config import ModelConfig
from models.hf_adapters import config_from_hf, from_hf

SUFFIX = ".gguf"
TOP_NAMES = {
    "token_embd.weight": (PRE, "model.embed_tokens.weight"),
    "output_norm.weight": (POST, "model.norm.weight"),
    "output.weight": (POST, "lm_head.weight"),
}
"""GGUF tensor name → (unit, HF Llama name) outside the decoder layers."""
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""`blk.N.<name>` → `model.layers.N.<HF name>` (weights and biases)."""
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def find_gguf(path: Path) -> Path:
    """The GGUF file `--load-dir` means: the file itself, or a directory's only `.gguf` file."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"--load-dir {path}: no such file or directory")
    found = sorted(p for p in path.iterdir() if p.suffix == SUFFIX and p.is_file())
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files"
        raise ValueError(
            f"--load-dir {path} holds {what}; point --load-dir at the .gguf file to convert"
        )
    return found[0]


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary row order of a Q/K projection (weight or bias) → HF's."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"a Q/K projection of {rows} rows does not split into {heads} heads")
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's row order of a Q/K projection → llama.cpp's (convert_hf_to_gguf.py's permute)."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"a Q/K projection of {rows} rows does not split into {heads} heads")
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def tensor_place(name: str) -> tuple[Unit, str]:
    """(unit, HF name) of a GGUF llama tensor name; ValueError for names Meshline cannot place."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = _BLOCK.match(name)
    if match and match.group(2) in LAYER_NAMES:
        layer = int(match.group(1))
        return layer, f"model.layers.{layer}.{LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    raise ValueError(
        f"GGUF tensor {name!r} is not part of a llama model Meshline reads (token_embd, "
        f"output_norm, output, blk.N.{{{','.join(LAYER_NAMES)}}}); nothing was converted"
    )


def torch_shape(ggml_shape: object) -> tuple[int, ...]:
    """Torch order (rows first) of a ggml shape (innermost dimension first)."""
    return tuple(int(d) for d in reversed(list(ggml_shape)))  # type: ignore[call-overload]


class GGUFSource:
    """A GGUF file opened for per-unit reads (see the module doc)."""

    def __init__(self, path: Path, config: ModelConfig | None = None) -> None:
        require_gguf()
        from gguf import GGUFReader

        self.path = find_gguf(path)
        try:
            reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError/IndexError/... on a bad file
            raise ValueError(f"{self.path} is not a readable GGUF file ({exc})") from exc
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self._check_tensors()
        meta = field_values(reader)
        self.metadata = meta
        """The file's metadata, key → value."""
        self.hf_config = hf_config_dict(meta, set(self._tensors))
        """The HF config.json dict the metadata describes (an HF output starts from it)."""
        try:
            own = config_from_hf(self.hf_config)
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"{self.path}: GGUF metadata is not a complete llama config ({exc})"
            ) from exc
        self.config = reconcile(own, config, str(self.path))
        self._check_declared_size()
        self._by_unit: dict[Unit, list[str]] = {u: [] for u in units(self.config)}
        for name in self._tensors:
            unit, _ = tensor_place(name)
            if unit not in self._by_unit:
                raise ValueError(
                    f"{self.path}: tensor {name} belongs to no layer of the "
                    f"{self.config.num_layers}-layer model its metadata describes"
                )
            self._by_unit[unit].append(name)
        scratch = Path(tempfile.mkdtemp(prefix="meshline-gguf-tokenizer-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, scratch, True)
        self.tokenizer_files = (
            write_tokenizer(meta, scratch) if "tokenizer.ggml.model" in meta else []
        )
        self.iteration = 0

    def _check_tensors(self) -> None:
        """Refuses the file before any weight is read: unsupported types, misplaced names,
        byte counts that do not match the shape."""
        for tensor in self._tensors.values():
            type_id = int(tensor.tensor_type)
            if type_id not in NAMES:
                raise ValueError(
                    f"{self.path}: tensor {tensor.name} has ggml type {type_name(type_id)}, which "
                    f"Meshline does not read; supported types: {supported_list()}"
                )
            tensor_place(tensor.name)
            shape = torch_shape(tensor.shape)
            if not shape or min(shape) < 1:
                raise ValueError(f"{self.path}: tensor {tensor.name} has shape {shape}")
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            want = row_bytes(type_id, shape[-1]) * rows
            if int(tensor.n_bytes) != want or tensor.data.nbytes != want:
                raise ValueError(
                    f"{self.path}: tensor {tensor.name} ({NAMES[type_id]}, shape {shape}) holds "
                    f"{tensor.data.nbytes} bytes, not {want}; the file is truncated or corrupt"
                )

    def _check_declared_size(self) -> None:
        """The metadata's model must not need more values than the (size-checked) tensors hold:
        a hostile header could otherwise declare a model far larger than the file."""
        try:
            declared = count_parameters(self.config)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.path}: the model config is not valid ({exc})") from exc
        present = sum(int(np.prod(torch_shape(t.shape))) for t in self._tensors.values())
        if declared > present:
            raise ValueError(
                f"{self.path}: the metadata declares {declared:,} parameters but the tensors hold "
                f"{present:,} values; the file is corrupt or not a model of its metadata"
            )

    def read_tensor(self, name: str) -> torch.Tensor:
        """One tensor dequantized to float32 (exact for every type), in torch order, under its
        GGUF row order."""
        tensor = self._tensors[name]
        raw = np.array(tensor.data, copy=True).view(np.uint8)
        return dequantize(raw, int(tensor.tensor_type), torch_shape(tensor.shape))

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors under Meshline names, Q/K rows in HF order."""
        hf: Tensors = {}
        for name in self._by_unit[unit]:
            tensor = self.read_tensor(name)
            _, hf_name = tensor_place(name)
            if ".attn_q." in name:
                tensor = unpermute(tensor, self.config.num_attention_heads)
            elif ".attn_k." in name:
                tensor = unpermute(tensor, self.config.kv_heads)
            hf[hf_name] = tensor
        try:
            tensors = from_hf(hf, self.config)
        except (RuntimeError, KeyError) as exc:
            raise ValueError(f"{self.path}: {unit!r} tensors do not fit the model ({exc})") from exc
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return tensors
