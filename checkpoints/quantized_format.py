"""Quantized native checkpoints: weight-only round-to-nearest int8 / int4 of the decoder's Linear
weights (`meshline convert --save-format quantized --quantize int8|int4`).

A directory holds:

- `quantization.json`: the scheme — `{"format": "meshline-quantized-1", "method": "rtn"|"gptq",
  "bits": 8|4, "group_size": N|null (null: one scale per output channel), "symmetric": bool,
  "dtype": the dtype of the kept tensors and of dequantized weights, "embedding": null or
  {"bits", "group_size", "symmetric"}}` (the last: how the token embedding and the output head
  are quantized; null or absent — checkpoints written before it existed — keeps them);
- `config.json`: the ModelConfig dict (as a native step's);
- `model.safetensors`: every 2-D weight of a decoder layer (`layers.N.*.weight`: attention and MLP
  projections, fused or not) as `<name>.codes` (int8 [out, in]) for int8 or `<name>.packed`
  (uint8 [out, in/2], two codes a byte) for int4, `<name>.scale` (float32 [out, groups]) and, when
  affine, `<name>.zero` (int8 [out, groups]); with an "embedding" scheme the token embedding
  (`embed_tokens.weight` [vocab, hidden]) and an untied output head (`lm_head.weight`) are stored
  the same way under that scheme (a tied head is the embedding's codes); every other tensor —
  norms, position tables, 3-D MoE expert stacks — as it is;
- `tokenizer/`: the source's tokenizer files.

Reading dequantizes ((codes − zero) · scale per group, `kernels.quantization`) into the recorded
dtype, so every stage that loads checkpoints through the format registry (convert, evaluate)
reads it as an ordinary float model; serving keeps the codes (`read_unit_quantized`,
engine/quantized_model.py: the engine computes on them, kernels/quant_linear.py).
Every expected tensor and part is checked against the config's shapes (and the header against
the file's size) before anything is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints.safetensors_stream import StreamingWriter, TensorSpec, read_header, read_tensors
from checkpoints.units import Tensors, Unit, expected_shapes, reconcile, unit_of, units
from kernels.quantization import (
    QuantizedWeight,
    WeightScheme,
    dequantize_weight,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from models.config import ModelConfig

FORMAT = "meshline-quantized-1"
METHODS = ("rtn", "gptq")
"""How the codes were chosen (recorded; both store the same layout): round to nearest, or GPTQ
(kernels/gptq.py, calibrated by `convert --quantize-method gptq`)."""
SCHEME_FILE = "quantization.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STORED = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
           torch.uint8: "U8"}  # fmt: skip


EMBEDDING_SCHEME = WeightScheme(8, None, True)
"""How `convert --quantize` stores the token embedding and output head unless
`--keep-embedding`: int8, one symmetric scale per row (per token), whatever the layers' bits.
On SmolLM2-135M it costs +0.11% perplexity alone, int4 group 32 affine rows +9% (bench/
RESULTS.md), and as the head it is the largest matrix a decode step reads."""

EMBEDDING_NAMES = ("embed_tokens.weight", "lm_head.weight")
"""The tensors an "embedding" scheme quantizes (the head only where it is not tied)."""


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a Meshline tensor is stored quantized: a 2-D weight inside a decoder layer."""
    return name.startswith("layers.") and name.endswith(".weight") and len(shape) == 2


def embedding_quantizable(config: ModelConfig) -> bool:
    """Whether the model's token embedding / output head can be stored quantized: a vocabulary
    head (not a reward model's scalar one) whose rows are used as they are (not normalised)."""
    return not config.value_head and not config.norm_head


@dataclass(frozen=True)
class Scheme:
    """A quantized checkpoint's `quantization.json`."""

    weights: WeightScheme
    """Bits, group size, symmetric or affine."""
    dtype: torch.dtype
    """Dtype of kept tensors and of dequantized weights."""
    embedding: WeightScheme | None = None
    """The token embedding's and output head's scheme; None: kept in `dtype`."""
    method: str = "rtn"
    """How the layers' codes were chosen (METHODS); the embedding is always rounded to nearest."""

    def of(self, name: str, shape: tuple[int, ...]) -> WeightScheme | None:
        """The scheme a Meshline tensor is stored under, None when it is kept as it is."""
        if quantized(name, shape):
            return self.weights
        if name in EMBEDDING_NAMES and len(shape) == 2:
            return self.embedding
        return None

    def to_json(self) -> dict[str, Any]:
        """The `quantization.json` object."""
        return {
            "format": FORMAT,
            "method": self.method,
            "bits": self.weights.bits,
            "group_size": self.weights.group_size,
            "symmetric": self.weights.symmetric,
            "dtype": str(self.dtype).removeprefix("torch."),
            "embedding": None
            if self.embedding is None
            else {
                "bits": self.embedding.bits,
                "group_size": self.embedding.group_size,
                "symmetric": self.embedding.symmetric,
            },
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> Scheme:
        """The scheme a `quantization.json` records (ValueError naming `where` otherwise)."""
        try:
            assert isinstance(data, dict)
            if data["format"] != FORMAT or data.get("method") not in METHODS:
                raise ValueError(f"format {data['format']!r} / method {data.get('method')!r}")
            embedding = data.get("embedding")
            if embedding is not None:
                assert isinstance(embedding, dict)
                embedding = _weight_scheme(embedding, "embedding.")
            return cls(_weight_scheme(data, ""), _DTYPES[data["dtype"]], embedding, data["method"])
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{where} is not a Meshline quantization scheme ({exc}); expected {FORMAT} with "
                f"method {'|'.join(METHODS)}, bits 8|4, group_size, symmetric, dtype one of "
                f"{list(_DTYPES)} and embedding null or {{bits, group_size, symmetric}}"
            ) from exc


def _weight_scheme(data: dict, prefix: str) -> WeightScheme:
    """bits / group_size / symmetric of a `quantization.json` object (ValueError, KeyError)."""
    group = data["group_size"]
    if group is not None and (type(group) is not int or group < 1):
        raise ValueError(f"{prefix}group_size {group!r}")
    if type(data["symmetric"]) is not bool:
        raise ValueError(f"{prefix}symmetric {data['symmetric']!r}")
    bits = data["bits"]
    if type(bits) is not int:
        raise ValueError(f"{prefix}bits {bits!r}")
    return WeightScheme(bits, group, data["symmetric"])


def part_specs(name: str, shape: tuple[int, ...], scheme: WeightScheme) -> list[TensorSpec]:
    """The stored parts of a quantized weight `name` of `shape` [out, in]."""
    out, columns = shape
    groups = scheme.groups(columns)
    if scheme.bits == 4:
        if columns % 2:
            raise ValueError(f"{name}: int4 packs two codes a byte; {columns} inputs is odd")
        specs = [TensorSpec(f"{name}.packed", torch.uint8, (out, columns // 2))]
    else:
        specs = [TensorSpec(f"{name}.codes", torch.int8, (out, columns))]
    specs.append(TensorSpec(f"{name}.scale", torch.float32, (out, groups)))
    if not scheme.symmetric:
        specs.append(TensorSpec(f"{name}.zero", torch.int8, (out, groups)))
    return specs


Planned = tuple[str, WeightScheme | None, list[TensorSpec]]
"""A Meshline tensor, the scheme it is stored under (None: kept) and its stored tensors."""


def plan(config: ModelConfig, scheme: Scheme) -> dict[Unit, list[Planned]]:
    """Per unit, each Meshline tensor with the stored tensors it becomes (ValueError when a
    weight's rows do not split into the scheme's groups, or the model's embedding cannot be
    quantized)."""
    if scheme.embedding is not None and not embedding_quantizable(config):
        raise ValueError(
            "the model's output head is a scalar value head or row-normalised: its embedding "
            "and head cannot be quantized"
        )
    out: dict[Unit, list[Planned]] = {u: [] for u in units(config)}
    for name, size in expected_shapes(config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = tuple(size)
        weights = scheme.of(name, shape)
        if weights is not None:
            specs = part_specs(name, shape, weights)
        else:
            specs = [TensorSpec(name, scheme.dtype, shape)]
        out[unit_of(name)].append((name, weights, specs))
    return out


def check_plan(config: ModelConfig, scheme: WeightScheme, embedding: WeightScheme | None) -> None:
    """Refuses (ValueError naming the flag) a scheme the model's weights cannot take."""
    try:
        plan(config, Scheme(scheme, torch.float32, embedding))
    except ValueError as exc:
        raise ValueError(f"--group-size {scheme.group_size}: {exc}") from exc


class QuantizedSource:
    """A quantized checkpoint directory, dequantized unit by unit."""

    def __init__(self, directory: Path, named: ModelConfig | None = None) -> None:
        self.directory = directory
        for name in (SCHEME_FILE, CONFIG, WEIGHTS):
            if not (directory / name).is_file():
                raise FileNotFoundError(
                    f"{directory} is not a quantized checkpoint: {name} is missing"
                )
        try:
            raw_scheme = json.loads((directory / SCHEME_FILE).read_text())
            own = ModelConfig.from_dict(json.loads((directory / CONFIG).read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{directory}: {SCHEME_FILE} / {CONFIG} are corrupted ({exc})"
            ) from exc
        self.scheme = Scheme.from_json(raw_scheme, str(directory / SCHEME_FILE))
        """What quantization.json records."""
        self.config = reconcile(own, named, str(directory / CONFIG))
        tokenizer = directory / "tokenizer"
        self.tokenizer_files = sorted(tokenizer.iterdir()) if tokenizer.is_dir() else []
        self.iteration = 0
        self._path = directory / WEIGHTS
        header, _ = read_header(self._path)
        self._plan = plan(self.config, self.scheme)
        for entries in self._plan.values():
            for _, _, specs in entries:
                for spec in specs:
                    entry = header.get(spec.name)
                    want = (_STORED[spec.dtype], list(spec.shape))
                    if entry is None or (entry["dtype"], list(entry["shape"])) != want:
                        have = "missing" if entry is None else f"{entry['dtype']} {entry['shape']}"
                        raise ValueError(
                            f"{self._path}: tensor {spec.name} is {have}; the model in {CONFIG} "
                            f"quantized as {SCHEME_FILE} says needs {want[0]} {want[1]}"
                        )

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors, quantized weights dequantized to the recorded dtype."""
        kept, weights = self.read_unit_quantized(unit)
        for name, weight in weights.items():
            kept[name] = dequantize_weight(weight, self.scheme.dtype)
        return kept

    def read_unit_quantized(self, unit: Unit) -> tuple[Tensors, dict[str, QuantizedWeight]]:
        """The unit's kept tensors (in the recorded dtype) and its quantized weights as stored
        (int4 codes unpacked), by Meshline name: what serving on the codes needs."""
        entries = self._plan[unit]
        raw = read_tensors(self._path, [s.name for _, _, specs in entries for s in specs])
        kept: Tensors = {}
        weights: dict[str, QuantizedWeight] = {}
        for name, scheme, _ in entries:
            if scheme is None:
                kept[name] = raw[name].to(self.scheme.dtype)
                continue
            codes = raw.get(f"{name}.codes")
            if codes is None:
                codes = unpack_int4(raw[f"{name}.packed"])
            weights[name] = QuantizedWeight(
                codes.to(torch.int8), raw[f"{name}.scale"].float(), raw.get(f"{name}.zero")
            )
        return kept, weights


class QuantizedSink:
    """Writes a quantized checkpoint into `directory` (a temporary one the job renames)."""

    def __init__(
        self,
        directory: Path,
        config: ModelConfig,
        dtype: torch.dtype,
        tokenizer: list[Path],
        weights: WeightScheme,
        embedding: WeightScheme | None = None,
        method: str = "rtn",
    ) -> None:
        self.directory = directory
        self.config = config
        self.tokenizer = tokenizer
        self.scheme = Scheme(weights, dtype, embedding, method)
        self._plan = plan(config, self.scheme)
        specs = [s for unit in units(config) for _, _, parts in self._plan[unit] for s in parts]
        self._writer = StreamingWriter(directory / WEIGHTS, specs, {"format": FORMAT})

    def layer_weights(self, unit: Unit) -> set[str]:
        """The unit's tensors stored under the layers' scheme (what GPTQ rounds)."""
        return {
            n for n, scheme, _ in self._plan[unit] if scheme is not None and n.startswith("layers.")
        }

    def write_unit(
        self, unit: Unit, tensors: Tensors, rounded: dict[str, QuantizedWeight] | None = None
    ) -> None:
        """Streams every stored tensor of the unit: the weights in `rounded` as given (GPTQ's
        codes, under this sink's scheme), the other quantized ones rounded to nearest here."""
        rounded = rounded or {}
        for name, scheme, specs in self._plan[unit]:
            tensor = tensors[name]
            if scheme is None:
                self._writer.write(name, tensor.to(self.scheme.dtype))
                continue
            q = rounded[name] if name in rounded else quantize_weight(tensor, scheme)
            codes = pack_int4(q.codes) if scheme.bits == 4 else q.codes
            self._writer.write(specs[0].name, codes)
            self._writer.write(f"{name}.scale", q.scale.float())
            if q.zero_point is not None:
                self._writer.write(f"{name}.zero", q.zero_point)

    def abort(self) -> None:
        """Closes the weights file (incomplete; the caller removes the directory)."""
        self._writer.abandon()

    def finish(self) -> list[str]:
        """Closes the weights, writes quantization.json, config.json and tokenizer/."""
        self._writer.close()
        (self.directory / SCHEME_FILE).write_text(json.dumps(self.scheme.to_json(), indent=2))
        (self.directory / CONFIG).write_text(json.dumps(self.config.to_dict(), indent=2))
        files = [WEIGHTS, SCHEME_FILE, CONFIG]
        if self.tokenizer:
            (self.directory / "tokenizer").mkdir()
            for path in self.tokenizer:
                (self.directory / "tokenizer" / path.name).write_bytes(path.read_bytes())
                files.append(f"tokenizer/{path.name}")
        return sorted(files)
