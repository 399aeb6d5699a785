"""DeepSpeed universal checkpoints (`python -m deepspeed.checkpoint.ds_to_universal`): one folder of
fp32 master weights per parameter, independent of the ZeRO stage and DP size that saved them.

Layout (deepspeed 0.19.8, checked against files its tool writes, tests/services/converter/
test_deepspeed.py):

    <dir>/latest_universal                       "global_step1000" (the tool's output folder name)
    <dir>/config.json, tokenizer files           (beside it, as for a ZeRO checkpoint)
    <dir>/global_step1000/
        mp_rank_00_model_states.pt | zero_pp_rank_<r>_mp_rank_00_model_states.pt   (copied over)
        zero/optimizer_state.pt
        zero/<parameter name>/fp32.pt            ZeRO-1/2: {"param": full tensor, "cat_dim": ...};
                                                 ZeRO-3: the flat tensor (numel of the shape)
        zero/<parameter name>/exp_avg.pt, exp_avg_sq.pt, step.pt   (optimizer state, not read)

Names, shapes, tied aliases (`shared_params`) and buffers come from the copied model-states file,
as for a ZeRO checkpoint; a parameter's name becomes a path component only after it is checked
to be one plain file name. Parameters the optimizer did not own (frozen) have no folder and are
refused by name, as are tensor-parallel universal checkpoints (`cat_dim` merges are not done).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from checkpoints.bounds import check_declared_size
from checkpoints.deepspeed_format import (
    load_file,
    names_by_unit,
    read_config,
    safe_globals,
    unit_from_hf,
)
from checkpoints.hf_format import tokenizer_files
from checkpoints.torch_files import load_weights_only
from checkpoints.units import Tensors, Unit
from models.config import ModelConfig

TAG_FILE = "latest_universal"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_TAG_STEP = re.compile(r"global_step(\d+)$")


def universal_tag(directory: Path, iteration: int | None = None) -> Path | None:
    """The universal tag directory `directory` means (it, its global_step<iteration>, or what
    `latest_universal` names), or None when it is not a universal checkpoint."""
    if (directory / "zero").is_dir():
        return directory
    if iteration is not None:
        tag = directory / f"global_step{iteration}"
        return tag if (tag / "zero").is_dir() else None
    pointer = directory / TAG_FILE
    if not pointer.is_file() or (directory / "latest").is_file():
        return None  # a ZeRO checkpoint's `latest` wins: the tool writes beside it only by hand
    name = pointer.read_text().strip()
    tag = directory / name
    if not _NAME.match(name) or not (tag / "zero").is_dir():
        raise FileNotFoundError(
            f"{pointer} names {name[:60]!r}, which is not a universal checkpoint folder there"
        )
    return tag


class UniversalSource:
    """A DeepSpeed universal checkpoint, read per unit as fp32 tensors."""

    def __init__(self, tag_dir: Path, config: ModelConfig | None) -> None:
        self.tag_dir = tag_dir
        root = tag_dir.parent
        self.config, self.hf_config = read_config(root, config)
        self.tokenizer_files = tokenizer_files(root)
        matches = {p: _MODEL_FILE.match(p.name) for p in tag_dir.iterdir()}
        models = sorted(p for p, m in matches.items() if m)
        if not models:
            raise FileNotFoundError(f"{tag_dir} holds no *_model_states.pt file")
        if any(m and m.group(2) != "00" for m in matches.values()):
            raise ValueError(
                f"{tag_dir}: model-parallel rank > 0 files (mp_rank_01...): tensor-parallel "
                "universal checkpoints are not read"
            )
        state = load_file(models[0])
        shapes = state.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise ValueError(f"{models[0]} lacks param_shapes: not a DeepSpeed model_states file")
        self.shapes: dict[str, tuple[int, ...]] = {
            name: tuple(int(d) for d in shape) for group in shapes for name, shape in group.items()
        }
        frozen = sorted(state.get("frozen_param_shapes") or {})
        if frozen:
            raise ValueError(
                f"{tag_dir}: frozen parameters {frozen[:4]} have no universal folder; convert "
                "the ZeRO checkpoint the tool read instead"
            )
        for name in self.shapes:
            if not _NAME.match(name) or not (tag_dir / "zero" / name / "fp32.pt").is_file():
                raise FileNotFoundError(f"{tag_dir}/zero holds no fp32.pt for {name[:80]!r}")
        module = state.get("module") or {}
        self.buffers = {
            n: module[n].clone() for n in state.get("buffer_names") or [] if n in module
        }
        self.aliases = {
            a: t for a, t in (state.get("shared_params") or {}).items() if t in self.shapes
        }
        steps = _TAG_STEP.search(tag_dir.name)
        self.iteration = int(steps.group(1)) if steps else int(state.get("global_steps", 0))
        files = [tag_dir / "zero" / n / "fp32.pt" for n in self.shapes]
        check_declared_size(self.config, files, str(tag_dir))
        names = [*self.shapes, *self.aliases, *self.buffers]
        self._by_unit = names_by_unit(self.config, names, tag_dir)

    def _fp32(self, name: str) -> torch.Tensor:
        path = self.tag_dir / "zero" / name / "fp32.pt"
        saved: Any = load_weights_only(path, safe_globals(), "convert the ZeRO checkpoint instead")
        tensor = saved.get("param") if isinstance(saved, dict) else saved
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path} holds no tensor (a dict with 'param', or a tensor)")
        shape = self.shapes[name]
        if tensor.numel() != math.prod(shape):
            raise ValueError(
                f"{path}: {tensor.numel()} elements, its shape {shape} in param_shapes needs "
                f"{math.prod(shape)}"
            )
        return tensor.detach().reshape(shape).to(torch.float32, copy=True)

    def _assemble(self, names: list[str]) -> Tensors:
        out: Tensors = {}
        for name in names:
            if name in self.buffers:
                out[name] = self.buffers[name]
            else:
                out[name] = self._fp32(self.aliases.get(name, name))
        return out

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's fp32 tensors, mapped from HF to Meshline names."""
        return unit_from_hf(self._assemble(self._by_unit[unit]), unit, self.config, self.tag_dir)

    def full_state_dict(self) -> Tensors:
        """Every parameter (and buffer) under its saved (HF) name, in fp32."""
        return self._assemble([*self.shapes, *self.aliases, *self.buffers])
