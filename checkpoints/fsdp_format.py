"""FSDP checkpoints of Hugging Face models, as torch's FSDP (1 or 2) state-dict types save them:

- SHARDED_STATE_DICT: a `torch.distributed.checkpoint` directory (`.metadata` + `__<rank>_0.distcp`)
  of the sharded state dict, usually nested under a key (`dcp.save({"model": model.state_dict()})`,
  Accelerate's `pytorch_model_fsdp_0/`), optimizer state beside it;
- FULL_STATE_DICT: one `torch.save` file of the gathered state dict (Accelerate's
  `pytorch_model_fsdp.bin`, or any single `*.bin` / `*.pt` holding name → tensor).

Keys are HF names, possibly under a prefix (`model.`) and with wrapper infixes that some versions
leave (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`, `_orig_mod.`); the prefix is found
from the embedding's HF name. DCP reads fetch only a unit's items (the trainer's allow-listed
`SafeFileSystemReader` for the metadata); the single file is memory-mapped with
`torch.load(weights_only=True, mmap=True)` and reopened per unit. The architecture comes from a
`config.json` in the directory or its parent (where HF/Accelerate put it) or `--model`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoints.bounds import check_declared_size
from checkpoints.hf_format import hf_specs, hf_unit, tokenizer_files
from checkpoints.safe_reader import SafeFileSystemReader
from checkpoints.torch_files import load_weights_only
from checkpoints.units import Tensors, Unit, reconcile, units
from models.config import ModelConfig
from models.hf_adapters import config_from_hf, from_hf

_WRAPPERS = re.compile(r"(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_FULL_FILES = ("pytorch_model_fsdp.bin", "pytorch_model.bin", "model.pt", "model.bin")


def _config(directory: Path, named: ModelConfig | None) -> tuple[ModelConfig, dict | None, Path]:
    for root in (directory, directory.parent):
        path = root / "config.json"
        if path.is_file():
            try:
                hf = json.loads(path.read_text())
                own = config_from_hf(hf)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path} is not a readable HF config ({exc})") from exc
            return reconcile(own, named, str(path)), hf, root
    if named is None:
        raise FileNotFoundError(
            f"{directory}: no config.json here or in its parent; an FSDP checkpoint records no "
            "architecture, pass --model NAME"
        )
    return named, None, directory


class FSDPSource:
    """An FSDP SHARDED (DCP) or FULL (single torch file) state dict of an HF model."""

    def __init__(self, directory: Path, config: ModelConfig | None) -> None:
        self.directory = directory
        self.config, self.hf_config, root = _config(directory, config)
        self.tokenizer_files = tokenizer_files(root)
        self.iteration = 0
        self._dcp = (directory / ".metadata").is_file()
        if self._dcp:
            metadata = SafeFileSystemReader(directory).read_metadata()
            check_declared_size(
                self.config,
                {directory / info.relative_path for info in metadata.storage_data.values()},
                str(directory),
            )
            self._meta = {
                k: (tuple(item.size), item.properties.dtype)
                for k, item in metadata.state_dict_metadata.items()
                if isinstance(item, TensorStorageMetadata)
            }
            keys = list(self._meta)
        else:
            self._file = self._full_file()
            check_declared_size(self.config, [self._file], str(self._file))
            keys = list(self._load_full())
        self._keys = self._hf_names(keys)
        self._by_unit: dict[Unit, list[str]] = {u: [] for u in units(self.config)}
        for hf_name in self._keys:
            unit = hf_unit(hf_name)
            if unit is None:
                continue
            if unit not in self._by_unit:
                raise ValueError(
                    f"{directory}: tensor {hf_name!r} belongs to no layer of the "
                    f"{self.config.num_layers}-layer model (wrong --model or config.json?)"
                )
            self._by_unit[unit].append(hf_name)

    def _full_file(self) -> Path:
        for name in _FULL_FILES:
            if (self.directory / name).is_file():
                return self.directory / name
        candidates = sorted(self.directory.glob("*.bin")) + sorted(self.directory.glob("*.pt"))
        if len(candidates) == 1:
            return candidates[0]
        raise FileNotFoundError(
            f"{self.directory} is not an FSDP checkpoint: no DCP .metadata (SHARDED_STATE_DICT) "
            f"and not exactly one *.bin / *.pt state-dict file (FULL_STATE_DICT); found "
            f"{[p.name for p in candidates]}"
        )

    def _load_full(self) -> dict[str, torch.Tensor]:
        state = load_weights_only(
            self._file,
            [],
            "not a weights-only torch state dict: save the FSDP FULL_STATE_DICT of tensors only",
        )
        if not isinstance(state, dict):
            raise ValueError(f"{self._file} holds a {type(state).__name__}, not a state dict")
        nested = [k for k, v in state.items() if isinstance(v, dict)]
        if len(nested) == 1 and not any(isinstance(v, torch.Tensor) for v in state.values()):
            state = {f"{nested[0]}.{k}": v for k, v in state[nested[0]].items()}  # {"model": sd}
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def _hf_names(self, keys: list[str]) -> dict[str, str]:
        """HF name → stored key, for the keys under the model's prefix."""
        cleaned = {_WRAPPERS.sub("", k): k for k in keys}
        anchor = next(iter(hf_specs(self.config, torch.float32)[0])).name
        found = sorted(k for k in cleaned if k == anchor or k.endswith("." + anchor))
        if not found:
            raise ValueError(
                f"{self.directory}: no tensor named {anchor!r} (under any prefix); the checkpoint "
                f"does not hold this HF model (keys start {sorted(cleaned)[:3]})"
            )
        prefix = min(found, key=len).removesuffix(anchor)
        return {k.removeprefix(prefix): cleaned[k] for k in cleaned if k.startswith(prefix)}

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's tensors, gathered (DCP) or sliced from the mapped file, in Meshline names."""
        names = self._by_unit[unit]
        if self._dcp:
            state = {}
            for name in names:
                shape, dtype = self._meta[self._keys[name]]
                state[self._keys[name]] = torch.empty(shape, dtype=dtype)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                try:
                    dcp.load(
                        state, storage_reader=SafeFileSystemReader(self.directory), no_dist=True
                    )
                except (Exception, dcp.CheckpointException) as exc:
                    raise ValueError(f"{self.directory}: reading {unit!r} failed ({exc})") from exc
            hf = {n: state[self._keys[n]] for n in names}
        else:
            full = self._load_full()
            hf = {n: full[self._keys[n]].clone() for n in names}
            del full
        try:
            tensors = from_hf(hf, self.config)
        except (RuntimeError, KeyError) as exc:
            raise ValueError(
                f"{self.directory}: {unit!r} tensors do not fit the model config ({exc})"
            ) from exc
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return tensors
