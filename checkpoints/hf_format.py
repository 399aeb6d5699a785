"""Hugging Face checkpoints: `config.json`, safetensors (sharded with an index past a size),
tokenizer files (an output gets what AutoTokenizer and `generate` need: checkpoints/hf_export.py).

Reading pulls only the unit's tensors from each file (`safetensors_stream.read_tensors`). Writing plans every
output tensor on meta tensors first (names, shapes), assigns shards, and streams each tensor
into its shard as its unit arrives (`safetensors_stream`), so neither direction holds more than
a unit.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from checkpoints.bounds import check_declared_size, file_in_directory
from checkpoints.hf_export import hf_side_files
from checkpoints.safetensors_stream import (
    StreamingWriter,
    TensorSpec,
    read_header,
    read_tensors,
    shard,
)
from checkpoints.units import (
    POST,
    PRE,
    Tensors,
    Unit,
    expected_shapes,
    reconcile,
    unit_label,
    unit_of,
    units,
)
from models.config import ModelConfig
from models.hf_adapters import config_from_hf, from_hf, hf_config, to_hf
from models.hf_config import TOKEN_KEYS

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|"
    r".*\.model|.*\.tiktoken|generation_config\.json|chat_template\.j(inja|son)|"
    # remote-code models (Baichuan, InternLM) need their modules beside config.json's auto_map;
    # they are copied as files, never imported
    r"(configuration|modeling|tokenization)_\w+\.py)$"
)
_LAYER = re.compile(r"^(?:model\.layers|transformer\.h|h)\.(\d+)\.")
# GPT-2's token and position tables (saved with or without `transformer.`) sit with the embedding.
_PRE_PREFIXES = (
    "model.embed_tokens.",
    "transformer.word_embeddings",
    "transformer.wte.",
    "transformer.wpe.",
    "wte.",
    "wpe.",
)


def hf_unit(name: str) -> Unit | None:
    """The unit an HF tensor name belongs to (None for buffers no checkpoint needs)."""
    match = _LAYER.match(name)
    if match:
        return int(match.group(1))
    if name.startswith(_PRE_PREFIXES):
        return PRE
    if name.endswith(("rotary_emb.inv_freq", "attention.bias", "masked_bias")):
        return None
    return POST


def tokenizer_files(directory: Path) -> list[Path]:
    """Tokenizer (and generation-config) files in a checkpoint directory."""
    return sorted(p for p in directory.iterdir() if p.is_file() and _TOKENIZER_FILES.match(p.name))


class HFSource:
    """An HF checkpoint directory opened lazily."""

    def __init__(self, directory: Path, config: ModelConfig | None = None) -> None:
        self.directory = directory
        config_path = directory / "config.json"
        self.hf_config: dict | None = None
        """The source's config.json, whose other keys (token ids, auto_map) an HF output keeps."""
        if config_path.is_file():
            try:
                self.hf_config = json.loads(config_path.read_text())
                own = config_from_hf(self.hf_config)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{config_path} is not a readable HF config ({exc})") from exc
            except AttributeError as exc:
                raise ValueError(f"{config_path} is not a JSON object of HF config keys") from exc
            except ValueError as exc:
                raise ValueError(f"{config_path}: {exc}") from exc
            config = reconcile(own, config, str(config_path))
        elif config is None:
            raise FileNotFoundError(
                f"{config_path} is missing: an HF checkpoint needs its config.json "
                "(or pass --model NAME)"
            )
        self.config = config
        self.tokenizer_files = tokenizer_files(directory)
        self.iteration = 0
        self._files = self._weight_files()
        self._by_unit: dict[Unit, list[tuple[str, Path]]] = {u: [] for u in units(config)}
        for path in sorted(set(self._files.values())):
            for name in self._keys(path):
                unit = hf_unit(name)
                if unit is None:
                    continue
                if unit not in self._by_unit:
                    raise ValueError(
                        f"{path}: tensor {name!r} belongs to no layer of the {config.num_layers}-"
                        "layer model in config.json (wrong --model or config?)"
                    )
                self._by_unit[unit].append((name, path))
        check_declared_size(config, self._files.values(), str(directory))

    def _weight_files(self) -> dict[str, Path]:
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                entries = weight_map.items()
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a safetensors index ({exc})") from exc
            except AttributeError as exc:
                raise ValueError(f"{index}: weight_map is not a JSON object") from exc
            files = {
                name: file_in_directory(self.directory, file, f"{index} (tensor {name!r})")
                for name, file in entries
            }
            for path in set(files.values()):
                if not path.is_file():
                    raise FileNotFoundError(f"{index} names {path.name}, which is missing")
            return files
        single = self.directory / SINGLE
        if not single.is_file():
            raise FileNotFoundError(
                f"{self.directory} holds neither {SINGLE} nor {INDEX}; only safetensors HF "
                "checkpoints are read (re-save .bin checkpoints with save_pretrained)"
            )
        return {"": single}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        return list(read_header(path)[0])

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors, read from their files and mapped to Meshline names."""
        hf: Tensors = {}
        by_path: dict[Path, list[str]] = {}
        for name, path in self._by_unit[unit]:
            by_path.setdefault(path, []).append(name)
        for path, names in by_path.items():
            hf.update(read_tensors(path, names))
        try:
            tensors = from_hf(hf, self.config)
        except (RuntimeError, KeyError) as exc:
            raise ValueError(
                f"{self.directory}: {unit!r} tensors do not fit the model config ({exc})"
            ) from exc
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return tensors


def hf_specs(config: ModelConfig, dtype: torch.dtype) -> list[list[TensorSpec]]:
    """Per unit, the HF tensors (name, dtype, shape) a checkpoint of `config` holds, in order."""
    shapes = expected_shapes(config)
    per_unit: list[list[TensorSpec]] = []
    for unit in units(config):
        meta = {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, shape in shapes.items()
            if unit_of(name) == unit
            and not (name == "lm_head.weight" and config.tie_word_embeddings)
        }
        per_unit.append(
            [
                TensorSpec(n, t.dtype, tuple(t.shape))
                for n, t in to_hf(meta, config, per_expert=True).items()
            ]
        )
    return per_unit


class HFSink:
    """Writes an HF checkpoint into `directory` (a temporary one the job renames when done)."""

    def __init__(
        self,
        directory: Path,
        config: ModelConfig,
        dtype: torch.dtype,
        tokenizer: list[Path],
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        base_config: dict | None = None,
    ) -> None:
        self.directory = directory
        self.config = config
        self.tokenizer = tokenizer
        self.base_config = base_config or {}
        per_unit = hf_specs(config, dtype)
        self._unit_specs = dict(zip(units(config), per_unit, strict=True))
        specs = [spec for unit_specs in per_unit for spec in unit_specs]
        self._shards = shard(specs, max_shard_bytes)
        count = len(self._shards)
        self._names = (
            [SINGLE]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        self._total_bytes = sum(spec.nbytes for spec in specs)
        self._shard_index = -1
        self._writer: StreamingWriter | None = None

    def write_unit(self, unit: Unit, tensors: Tensors) -> None:
        """Streams the unit's tensors, in HF names, into the current shard file(s)."""
        hf = to_hf(tensors, self.config, per_expert=True)
        planned = self._unit_specs[unit]
        if set(hf) != {spec.name for spec in planned}:
            raise ValueError(f"{unit_label(unit)}: HF tensors {sorted(hf)} differ from the plan")
        for spec in planned:  # the plan's order, which the shard headers were written in
            if self._writer is None or self._writer.complete:
                self._next_shard()
            assert self._writer is not None
            self._writer.write(spec.name, hf[spec.name])

    def _next_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._shard_index += 1
        path = self.directory / self._names[self._shard_index]
        self._writer = StreamingWriter(path, self._shards[self._shard_index], {"format": "pt"})

    def abort(self) -> None:
        """Closes an open shard file (incomplete; the caller removes the directory)."""
        if self._writer is not None:
            self._writer.abandon()

    def finish(self) -> list[str]:
        """Closes the last shard, writes the index (when sharded), config.json and tokenizer."""
        if self._writer is not None:
            self._writer.close()
        files = list(self._names)
        if len(self._names) > 1:
            weight_map = {
                spec.name: file
                for file, specs in zip(self._names, self._shards, strict=True)
                for spec in specs
            }
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
            files.append(INDEX)
        hf = {**self.base_config, **hf_config(self.config)}
        model_tokens = {k: hf[k] for k in TOKEN_KEYS if hf.get(k) is not None}
        side = hf_side_files(self.tokenizer, model_tokens, self.config.max_position_embeddings)
        hf.update(side.token_ids)
        # transformers 5 reads "dtype", earlier versions "torch_dtype"
        hf["dtype"] = hf["torch_dtype"] = str(self._shards[0][0].dtype).removeprefix("torch.")
        (self.directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
        files.append("config.json")
        for name, path in side.copies.items():
            if name not in files:
                shutil.copy2(path, self.directory / name)
                files.append(name)
        for name, text in side.writes.items():
            (self.directory / name).write_text(text)
            files.append(name)
        return sorted(files)
