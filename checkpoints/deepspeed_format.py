"""DeepSpeed ZeRO checkpoints: the fp32 master weights DeepSpeed partitions over data-parallel
ranks, consolidated one unit at a time (what DeepSpeed's `zero_to_fp32.py` does for the whole
model at once).

Layout (`engine.save_checkpoint`; `latest` names the tag):

    <dir>/latest                                   "global_step1000"
    <dir>/config.json, tokenizer files             (HF Trainer's checkpoint-N/ directory)
    <dir>/global_step1000/
        mp_rank_00_model_states.pt                 ZeRO-1/2
        zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO-3, one per DP rank
        [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per DP rank

A model-states file holds `module` (the low-precision module state; ZeRO-3 keeps empty
placeholders), `buffer_names`, `param_shapes` (per optimizer group, name → shape, in the order the
flat buffers hold them), `shared_params` (tied name → the name holding the data),
`frozen_param_shapes` / `frozen_param_fragments` (parameters the optimizer does not own),
`ds_config`, `ds_version`. An optim-states file holds `optimizer_state_dict` with `zero_stage`,
`partition_count` and the flat fp32 partitions:

- ZeRO-1/2, `single_partition_of_fp32_groups` (one tensor per group): the group's parameters in
  `param_shapes` order, each followed by `param_alignment_paddings[g][i]` zeros when that key is
  present, form one flat vector zero-padded to a multiple of 2·DP and cut into DP equal
  partitions; rank r saves partition r without the tail padding. The ranks' partitions
  concatenated give the flat vector back. DeepSpeed's bf16 optimizer (`bf16_` files, no
  `zero_stage` key) saves the same layout with the padding kept.
- ZeRO-3, `fp32_flat_groups` (one tensor per sub-group): each parameter is zero-padded to a
  multiple of DP and cut into DP equal pieces; rank r's sub-groups hold piece r of every
  parameter in `param_shapes` order. A parameter is piece 0..DP-1 concatenated and trimmed.
  Frozen parameters are per-rank pieces in each rank's model-states file, cut the same way.

Files are read with `torch_files.load_weights_only` (every global checked statically first, then
`torch.load(weights_only=True, mmap=True)`) and an allow-list: DeepSpeed's
loss scalers, `ZeroStageEnum` and `fragment_address` are rebuilt as inert stand-ins registered
under DeepSpeed's names (their attributes are kept, no DeepSpeed code exists or runs), plus the
Megatron allow-list (`argparse.Namespace` from Megatron-DeepSpeed client state). Each unit
reopens the files it needs and copies out only its parameters' slices.

Parameter names are those of the module DeepSpeed wrapped: Hugging Face names (HF Trainer,
Accelerate), mapped to Meshline names per unit like an HF checkpoint. Tensor-parallel
(`mp_rank_01`...) and pipeline (`layer_XX-model_...`) DeepSpeed checkpoints are refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch

from checkpoints.bounds import check_declared_size
from checkpoints.hf_format import hf_unit, tokenizer_files
from checkpoints.megatron_format import safe_globals as megatron_safe_globals
from checkpoints.torch_files import load_weights_only
from checkpoints.units import Tensors, Unit, reconcile, units
from models.config import ModelConfig
from models.hf_adapters import config_from_hf, from_hf

TAG_FILE = "latest"
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_TAG_STEP = re.compile(r"global_step(\d+)$")


class _InertObject:
    """Stand-in for a DeepSpeed object in a checkpoint: holds its attributes, has no behaviour."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _LossScaler(_InertObject):
    """DeepSpeed's `LossScaler` / `DynamicLossScaler` (`cur_scale`, `cur_iter`, ...)."""


class _FragmentAddress(_InertObject):
    """DeepSpeed's `fragment_address` (`numel`, `start`) from `param_slice_mappings`."""


class _ZeroStage(IntEnum):
    """DeepSpeed's `ZeroStageEnum` (pickled by value)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


_DEEPSPEED_TYPES: tuple[tuple[type, str], ...] = (
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)


def safe_globals() -> list[Any]:
    """What a DeepSpeed checkpoint file may hold besides tensors and plain values."""
    return [*megatron_safe_globals(), *_DEEPSPEED_TYPES]


def names_by_unit(config: ModelConfig, names: Iterable[str], where: Path) -> dict[Unit, list[str]]:
    """The checkpoint's HF parameter names grouped by the conversion unit (layer) they belong
    to; a name of no layer of `config` is an error naming `where` (a wrong --model or config)."""
    by_unit: dict[Unit, list[str]] = {u: [] for u in units(config)}
    for name in names:
        unit = hf_unit(name)
        if unit is None:
            continue
        if unit not in by_unit:
            raise ValueError(
                f"{where}: parameter {name!r} belongs to no layer of the "
                f"{config.num_layers}-layer model (wrong --model or config.json?)"
            )
        by_unit[unit].append(name)
    return by_unit


def unit_from_hf(hf: Tensors, unit: Unit, config: ModelConfig, where: Path) -> Tensors:
    """One unit's HF-named tensors as Meshline's (a tied head dropped); an error naming `where`
    when they do not fit `config`."""
    try:
        tensors = from_hf(hf, config)
    except (RuntimeError, KeyError) as exc:
        raise ValueError(f"{where}: {unit!r} tensors do not fit the model config ({exc})") from exc
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed `.pt` file, memory-mapped, through the allow-list (clear errors otherwise)."""
    state = load_weights_only(
        path,
        safe_globals(),
        "a trusted file with other objects must be consolidated with DeepSpeed's own "
        "zero_to_fp32.py and read as --load-format hf",
    )
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a DeepSpeed state dict")
    return state


@dataclass(frozen=True)
class _Slice:
    """`length` elements from `start` of flat tensor `group` of DP rank `rank`'s file."""

    rank: int
    group: int
    start: int
    length: int


@dataclass(frozen=True)
class _Recipe:
    """How to rebuild one full parameter: concatenate the slices, trim to the shape's numel."""

    shape: tuple[int, ...]
    slices: tuple[_Slice, ...]
    source: str
    """"optim": slices of the flat fp32 groups; "frozen": of per-rank frozen fragments (ZeRO-3,
    `group` unused); "module_frozen" (ZeRO-1/2 frozen parameters) and "module" (buffers): the
    whole tensor from the first model-states file."""


def _pieces(lengths: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """(piece index, start in piece, length) covering [start, start+length) of the
    concatenation of pieces with `lengths`; ValueError when it runs past the end."""
    out: list[tuple[int, int, int]] = []
    base = 0
    for index, size in enumerate(lengths):
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            out.append((index, lo - base, hi - lo))
        base += size
    if sum(p[2] for p in out) != length:
        raise ValueError(f"range [{start}, {start + length}) exceeds the {base} saved elements")
    return out


def _natural_rank(path: Path, pattern: re.Pattern[str], group: int) -> int:
    match = pattern.match(path.name)
    assert match is not None
    return int(match.group(group))


def find_tag(directory: Path, iteration: int | None = None) -> Path:
    """The tag directory (`global_stepN`) a DeepSpeed checkpoint path means."""
    if any(_OPTIM_FILE.match(p.name) for p in directory.iterdir()):
        return directory
    if iteration is not None:
        tag = directory / f"global_step{iteration}"
        if not tag.is_dir():
            raise FileNotFoundError(f"{tag} does not exist (--load-iteration {iteration})")
        return tag
    pointer = directory / TAG_FILE
    if not pointer.is_file():
        raise FileNotFoundError(
            f"{directory} is not a DeepSpeed checkpoint: it has neither *_optim_states.pt files "
            f"nor a `{TAG_FILE}` file (point --load-dir at the directory save_checkpoint wrote "
            "into, or at its global_stepN)"
        )
    name = pointer.read_text().strip()
    tag = directory / name
    if not name or "/" in name or not tag.is_dir():
        raise FileNotFoundError(f"{pointer} names {name[:60]!r}, which is not a directory there")
    return tag


def read_config(root: Path, named: ModelConfig | None) -> tuple[ModelConfig, dict | None]:
    """The model a DeepSpeed checkpoint under `root` holds: its HF `config.json` (reconciled with
    --model when given), else the named config; DeepSpeed itself records no architecture."""
    path = root / "config.json"
    if not path.is_file():
        if named is None:
            raise FileNotFoundError(
                f"{path} is missing: a DeepSpeed checkpoint records no architecture; pass "
                "--model NAME or put the model's HF config.json beside `latest`"
            )
        return named, None
    try:
        hf = json.loads(path.read_text())
        own = config_from_hf(hf)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a readable HF config ({exc})") from exc
    return reconcile(own, named, str(path)), hf


class DeepSpeedSource:
    """A DeepSpeed ZeRO-1/2/3 checkpoint of DP ranks, consolidated per unit to fp32."""

    def __init__(
        self, directory: Path, config: ModelConfig | None, iteration: int | None = None
    ) -> None:
        self.tag_dir = find_tag(directory, iteration)
        root = directory if self.tag_dir != directory else directory.parent
        self.config, self.hf_config = read_config(root, config)
        self.tokenizer_files = tokenizer_files(root)
        if any(self.tag_dir.glob("layer_*-model_*")):
            raise ValueError(
                f"{self.tag_dir} holds layer_*-model_* files: a DeepSpeed pipeline-parallel "
                "checkpoint, which is not read (only data-parallel ZeRO-1/2/3)"
            )
        self._optim_files = self._rank_files(_OPTIM_FILE, 2, 3, "*_optim_states.pt")
        world = len(self._optim_files)
        first = self._optimizer_state(self._optim_files[0])
        stage = first.get("zero_stage")
        if stage is None and "single_partition_of_fp32_groups" in first:
            stage = 1  # DeepSpeed's bf16 optimizer: ZeRO-1 partitions, no zero_stage key
        if stage not in (1, 2, 3):
            raise ValueError(
                f"{self._optim_files[0]}: optimizer_state_dict has zero_stage {stage!r}; only "
                "ZeRO stage 1, 2 and 3 checkpoints hold partitioned fp32 weights"
            )
        self.zero_stage = int(stage)
        counts = first.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(c != world for c in counts):
            raise ValueError(
                f"{self.tag_dir}: partition_count {counts} but {world} optim_states files; a rank "
                "is missing (or the checkpoint mixes expert-parallel groups, which is not read)"
            )
        model_pattern = "zero_pp_rank_*_mp_rank_*_model_states.pt"
        if self.zero_stage == 3:
            self._model_files = self._rank_files(_MODEL_FILE, 1, 2, model_pattern)
            if len(self._model_files) != world:
                raise FileNotFoundError(
                    f"{self.tag_dir}: {len(self._model_files)} ZeRO-3 model_states files for "
                    f"{world} optim_states files; every DP rank saves one of each"
                )
        else:
            single = self.tag_dir / "mp_rank_00_model_states.pt"
            if not single.is_file():
                raise FileNotFoundError(f"{single} is missing (ZeRO-{self.zero_stage} saves it)")
            self._model_files = [single]
        model_state = load_file(self._model_files[0])
        for key in ("param_shapes", "buffer_names", "module"):
            if key not in model_state:
                raise ValueError(
                    f"{self._model_files[0]} lacks {key!r}: not a DeepSpeed ZeRO model_states file"
                )
        self.ds_version = str(model_state.get("ds_version", "unknown"))
        steps = _TAG_STEP.search(self.tag_dir.name)
        self.iteration = int(steps.group(1)) if steps else int(model_state.get("global_steps", 0))
        check_declared_size(
            self.config, [*self._optim_files, *self._model_files], str(self.tag_dir)
        )
        self._recipes = self._plan(model_state, world)
        del model_state
        self._by_unit = names_by_unit(self.config, self._recipes, self.tag_dir)

    def _rank_files(self, pattern: re.Pattern[str], rank: int, mp: int, glob: str) -> list[Path]:
        found = [p for p in self.tag_dir.iterdir() if pattern.match(p.name)]
        if not found:
            raise FileNotFoundError(f"{self.tag_dir} holds no {glob} files")
        if any(_natural_rank(p, pattern, mp) != 0 for p in found):
            raise ValueError(
                f"{self.tag_dir}: files of model-parallel rank > 0 (mp_rank_01...) present; "
                "tensor-parallel DeepSpeed checkpoints are not read (consolidate with DeepSpeed "
                "first)"
            )
        kinds = {p.name.split("zero_pp_rank_")[0] for p in found}
        if len(kinds) > 1:
            raise ValueError(f"{self.tag_dir}: {glob} files of two optimizers ({sorted(kinds)})")
        ranked = sorted(found, key=lambda p: _natural_rank(p, pattern, rank))
        ranks = [_natural_rank(p, pattern, rank) for p in ranked]
        if ranks != list(range(len(ranked))):
            raise FileNotFoundError(
                f"{self.tag_dir}: {glob} files for DP ranks {ranks}; expected 0..{len(ranks) - 1} "
                "with none missing"
            )
        return ranked

    def _optimizer_state(self, path: Path) -> dict[str, Any]:
        state = load_file(path).get("optimizer_state_dict")
        if not isinstance(state, dict):
            raise ValueError(
                f"{path} lacks optimizer_state_dict: not a DeepSpeed optim_states file"
            )
        return state

    def _flat_groups(self, path: Path) -> list[torch.Tensor]:
        key = "fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"
        groups = self._optimizer_state(path).get(key)
        if not isinstance(groups, list) or not all(isinstance(t, torch.Tensor) for t in groups):
            raise ValueError(f"{path}: optimizer_state_dict[{key!r}] is not a list of tensors")
        return groups

    def _plan(self, model_state: dict[str, Any], world: int) -> dict[str, _Recipe]:
        """Where every parameter's bytes are: the reconstruction protocol of the module doc."""
        shapes: list[dict[str, Any]] = list(model_state["param_shapes"] or [])
        lengths = [[t.numel() for t in self._flat_groups(p)] for p in self._optim_files]
        recipes: dict[str, _Recipe] = {}
        where = str(self.tag_dir)
        if self.zero_stage == 3:
            offset = 0
            for name, shape in ((n, s) for group in shapes for n, s in group.items()):
                part = -(-math.prod(shape) // world)
                slices = [
                    _Slice(rank, group, start, length)
                    for rank in range(world)
                    for group, start, length in _pieces(lengths[rank], offset, part)
                ]
                recipes[name] = _Recipe(tuple(shape), tuple(slices), "optim")
                offset += part
            if offset != sum(lengths[0]):
                raise ValueError(
                    f"{where}: param_shapes account for {offset} of the {sum(lengths[0])} "
                    "elements per rank; the model_states and optim_states files do not match"
                )
        else:
            paddings = self._optimizer_state(self._optim_files[0]).get("param_alignment_paddings")
            if len(shapes) != len(lengths[0]):
                raise ValueError(
                    f"{where}: {len(shapes)} param groups in param_shapes but "
                    f"{len(lengths[0])} fp32 partitions per rank"
                )
            align = 2 * world
            for group, group_shapes in enumerate(shapes):
                per_rank = [lengths[rank][group] for rank in range(world)]
                pads = paddings[group] if paddings is not None else [0] * len(group_shapes)
                if len(pads) != len(group_shapes):
                    raise ValueError(f"{where}: group {group} has {len(pads)} alignment paddings")
                offset = 0
                for (name, shape), pad in zip(group_shapes.items(), pads, strict=True):
                    numel = math.prod(shape)
                    slices = [
                        _Slice(rank, group, start, length)
                        for rank, start, length in _pieces(per_rank, offset, numel)
                    ]
                    recipes[name] = _Recipe(tuple(shape), tuple(slices), "optim")
                    offset += numel + pad
                if -(-offset // align) != -(-sum(per_rank) // align):
                    raise ValueError(
                        f"{where}: group {group} consumed {offset} of {sum(per_rank)} saved "
                        "elements; the model_states and optim_states files do not match"
                    )
        frozen = model_state.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            numel = math.prod(shape)
            if self.zero_stage == 3:
                part = -(-numel // world)
                pieces = tuple(_Slice(rank, 0, 0, part) for rank in range(world))
                recipes[name] = _Recipe(tuple(shape), pieces, "frozen")
            else:
                recipes[name] = _Recipe(tuple(shape), (), "module_frozen")
        module = model_state["module"] or {}  # None when a pipeline engine saved per-layer files
        for name in model_state["buffer_names"] or []:
            if name in module:
                recipes[name] = _Recipe(tuple(module[name].shape), (), "module")
        for alias, target in (model_state.get("shared_params") or {}).items():
            if target in recipes:
                recipes[alias] = recipes[target]
        return recipes

    def _assemble(self, names: Iterable[str]) -> Tensors:
        """The named parameters as full fp32 tensors (buffers keep integer dtypes)."""
        recipes = {n: self._recipes[n] for n in names}
        needed = sorted({s.rank for r in recipes.values() if r.source == "optim" for s in r.slices})
        frozen = sorted(
            {s.rank for r in recipes.values() if r.source == "frozen" for s in r.slices}
        )
        flat = {rank: self._flat_groups(self._optim_files[rank]) for rank in needed}
        models: dict[int, dict[str, Any]] = {}
        if frozen or any(r.source.startswith("module") for r in recipes.values()):
            models[0] = load_file(self._model_files[0])
        for rank in frozen:
            models.setdefault(rank, load_file(self._model_files[rank]))
        out: Tensors = {}
        for name, recipe in recipes.items():
            numel = math.prod(recipe.shape)
            if recipe.source == "optim":
                parts = [flat[s.rank][s.group].narrow(0, s.start, s.length) for s in recipe.slices]
            elif recipe.source == "frozen":
                parts = [models[s.rank]["frozen_param_fragments"][name] for s in recipe.slices]
            else:
                key = "frozen_param_fragments" if recipe.source == "module_frozen" else "module"
                parts = [models[0][key][name]]
            whole = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0]
            whole = whole.reshape(-1)
            if whole.numel() < numel:
                raise ValueError(
                    f"{self.tag_dir}: {name} has {whole.numel()} saved elements, its shape "
                    f"{recipe.shape} needs {numel}"
                )
            tensor = whole[:numel].reshape(recipe.shape)
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                tensor = tensor.float()  # a copy
            elif len(parts) == 1:
                tensor = tensor.clone()  # owns its bytes: the memory maps close with `flat`
            out[name] = tensor  # else a view of torch.cat's fresh buffer (padding at most DP-1)
        return out

    def read_unit(self, unit: Unit) -> Tensors:
        """The unit's consolidated fp32 tensors, mapped from HF to Meshline names."""
        return unit_from_hf(self._assemble(self._by_unit[unit]), unit, self.config, self.tag_dir)

    def full_state_dict(self) -> Tensors:
        """Every parameter under its saved (HF) name, in fp32: zero_to_fp32's result (the whole
        model in memory; conversions use `read_unit`)."""
        return self._assemble(list(self._recipes))
