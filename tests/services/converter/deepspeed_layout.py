"""Writes checkpoints in DeepSpeed's ZeRO layout without DeepSpeed (not installed in CI).

Follows deepspeed 0.19.8's `engine.save_checkpoint` (`_common_checkpoint_state`,
`_save_zero_checkpoint`, `_get_zero_param_shapes`, `_get_shared_params`,
`_get_zero_frozen_param_attributes`) and the optimizers' `state_dict` (stage_1_and_2.py,
stage3.py `_rigid_state_dict`, bf16_optimizer.py): the same file names, keys, flat-partition
padding and pickled DeepSpeed objects. The DeepSpeed classes are pickled from stand-in modules
registered under DeepSpeed's module names, so the files name exactly the globals DeepSpeed's would
(`deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`, `...zero.config.ZeroStageEnum`,
`deepspeed.utils.tensor_fragment.fragment_address`).
"""

from __future__ import annotations

import contextlib
import enum
import math
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DS_VERSION = "0.19.8"


def _fake_deepspeed() -> dict[str, types.ModuleType]:
    """Modules named like DeepSpeed's that define its pickled classes (plain attributes)."""
    scaler = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")
    zero_config = types.ModuleType("deepspeed.runtime.zero.config")
    fragment = types.ModuleType("deepspeed.utils.tensor_fragment")

    class LossScaler:
        def __init__(self, scale: float = 1.0) -> None:
            self.cur_scale, self.dynamic = scale, False

    class DynamicLossScaler:
        def __init__(self, init_scale: float, scale_window: int) -> None:
            self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 7, -1
            self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, 1.0
            self.delayed_shift = self.cur_hysteresis = 2
            self.consecutive_hysteresis, self.raise_error_at_min_scale = False, True
            self.dynamic, self.dtype = True, torch.half

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    @dataclass
    class fragment_address:  # DeepSpeed's class name
        numel: int
        start: int

    for module, classes in (
        (scaler, (LossScaler, DynamicLossScaler)),
        (zero_config, (ZeroStageEnum,)),
        (fragment, (fragment_address,)),
    ):
        for cls in classes:
            cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
            setattr(module, cls.__name__, cls)
    modules = {m.__name__: m for m in (scaler, zero_config, fragment)}
    for name in list(modules):
        parts = name.split(".")
        for i in range(1, len(parts)):
            modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return modules


@contextlib.contextmanager
def deepspeed_classes() -> Iterator[dict[str, types.ModuleType]]:
    """The stand-in DeepSpeed modules, importable (for pickling) only inside the block."""
    modules = _fake_deepspeed()
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield modules
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


@dataclass
class ZeroLayout:
    """Which DeepSpeed configuration the checkpoint imitates."""

    stage: int
    """ZeRO stage 1, 2 or 3."""
    world: int
    """Data-parallel ranks (one optim_states file each)."""
    bf16_optimizer: bool = False
    """DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16): `bf16_` files, no zero_stage key."""
    param_alignment: int = 1
    """ZeRO-1/2 `parameter_alignment`: pad each param (but the last) to this many elements."""
    round_robin: bool = False
    """ZeRO-1/2 `round_robin_gradients`: flat order is the round-robin reorder."""
    sub_group_size: int | None = None
    """ZeRO-3: start a new flat sub-group after this many elements."""
    frozen: tuple[str, ...] = ()
    """Parameter names with requires_grad False (not owned by the optimizer)."""


def _groups(model: torch.nn.Module, frozen: tuple[str, ...]) -> list[list[str]]:
    """HF Trainer's two optimizer groups: decayed weights, then norms and biases."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # dedups tied parameters, as DeepSpeed sees them
        if name in frozen:
            continue
        (no_decay if param.ndim < 2 or name.endswith("bias") else decay).append(name)
    return [decay, no_decay]


def _round_robin(names: list[str], world: int) -> list[str]:
    return [n for r in range(world) for i, n in enumerate(names) if i % world == r]


def _adam_state(sizes: list[int]) -> dict:
    state = {
        i: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.ones(n)}
        for i, n in enumerate(sizes)
    }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "params": [i]} for i in range(len(sizes))]
    return {"state": state, "param_groups": groups}


def _shared_params(model: torch.nn.Module) -> dict[str, str]:
    owner: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner:
            shared[name] = owner[id(param)]
        else:
            owner[id(param)] = name
    return shared


def write_zero_checkpoint(
    model: torch.nn.Module, directory: Path, layout: ZeroLayout, step: int = 12
) -> Path:
    """Saves `model`'s fp32 parameters as a DeepSpeed ZeRO checkpoint under `directory`
    (`latest` + `global_step<step>/`); returns the tag directory."""
    world = layout.world
    tag = directory / f"global_step{step}"
    tag.mkdir(parents=True)
    (directory / "latest").write_text(f"global_step{step}")
    params = dict(model.named_parameters())
    buffers = [n for n, _ in model.named_buffers() if n in model.state_dict()]
    groups = _groups(model, layout.frozen)
    if layout.stage <= 2 and layout.round_robin:
        groups = [_round_robin(g, world) for g in groups]
    if layout.stage == 3 and layout.sub_group_size:
        split: list[list[str]] = []
        for group in groups:
            current, size = [], 0
            for name in group:
                current.append(name)
                size += params[name].numel()
                if size >= layout.sub_group_size:
                    split.append(current)
                    current, size = [], 0
            split += [current] if current else []
        flat_groups = split
    else:
        flat_groups = groups
    param_shapes = [OrderedDict((n, params[n].shape) for n in g) for g in flat_groups]
    lp = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
    frozen_shapes = OrderedDict((n, params[n].shape) for n in layout.frozen)
    with deepspeed_classes() as ds:
        scaler = ds["deepspeed.runtime.fp16.loss_scaler"]
        zero_stage = ds["deepspeed.runtime.zero.config"].ZeroStageEnum
        address = ds["deepspeed.utils.tensor_fragment"].fragment_address
        if layout.stage <= 2:
            per_rank, paddings, group_paddings, mappings = _zero12_partitions(
                params, flat_groups, layout
            )
        else:
            per_rank = _zero3_partitions(params, flat_groups, world)
        for rank in range(world):
            fp32 = per_rank[rank]
            if layout.stage == 3:
                optim = {
                    "zero_stage": zero_stage.weights,
                    "loss_scaler": scaler.DynamicLossScaler(2.0**16, 1000),
                    "dynamic_loss_scale": True,
                    "overflow": False,
                    "partition_count": world,
                    "optimizer_state_dict": _adam_state([t.numel() for t in fp32]),
                    "fp32_flat_groups": fp32,
                }
            elif layout.bf16_optimizer:
                optim = {
                    "clip_grad": 1.0,
                    "base_optimizer_state": _adam_state([t.numel() for t in fp32]),
                    "single_partition_of_fp32_groups": fp32,
                    "group_paddings": group_paddings[rank],
                    "partition_count": [world] * len(fp32),
                    "ds_version": DS_VERSION,
                    "param_slice_mappings": [
                        OrderedDict((n, address(numel=s[1], start=s[0])) for n, s in m.items())
                        for m in mappings[rank]
                    ],
                }
            else:
                optim = {
                    "loss_scaler": scaler.LossScaler(1.0),
                    "dynamic_loss_scale": False,
                    "overflow": False,
                    "clip_grad": 1.0,
                    "base_optimizer_state": _adam_state([t.numel() for t in fp32]),
                    "single_partition_of_fp32_groups": fp32,
                    "zero_stage": zero_stage.gradients
                    if layout.stage == 2
                    else zero_stage.optimizer_states,
                    "group_paddings": group_paddings[rank],
                    "partition_count": [world] * len(fp32),
                    "ds_version": DS_VERSION,
                    "param_slice_mappings": [
                        OrderedDict((n, address(numel=s[1], start=s[0])) for n, s in m.items())
                        for m in mappings[rank]
                    ],
                }
                if paddings is not None:
                    optim["param_alignment_paddings"] = paddings
            config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
            prefix = "bf16_" if layout.bf16_optimizer else ""
            torch.save(
                {"optimizer_state_dict": optim, "ds_config": config, "ds_version": DS_VERSION},
                tag / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            )
            if layout.stage == 3 or rank == 0:
                module = dict(lp)
                fragments: OrderedDict[str, torch.Tensor] = OrderedDict()
                if layout.stage == 3:  # partitioned weights: placeholders in the module
                    module = {n: (torch.empty(0) if n in params else t) for n, t in lp.items()}
                    for n in layout.frozen:
                        fragments[n] = _zero3_piece(params[n].detach(), rank, world).clone()
                else:
                    for n in layout.frozen:
                        fragments[n] = params[n].detach().clone()
                state = {
                    "module": module,
                    "buffer_names": buffers,
                    "optimizer": None,
                    "param_shapes": param_shapes,
                    "frozen_param_shapes": frozen_shapes if layout.frozen else None,
                    "shared_params": _shared_params(model),
                    "frozen_param_fragments": fragments if layout.frozen else None,
                    "lr_scheduler": {"last_batch_iteration": step},
                    "data_sampler": None,
                    "random_ltd": None,
                    "skipped_steps": 0,
                    "global_steps": step,
                    "global_samples": step * world,
                    "dp_world_size": world,
                    "mp_world_size": 1,
                    "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                    "ds_config": config,
                    "ds_version": DS_VERSION,
                }
                name = (
                    f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
                    if layout.stage == 3
                    else "mp_rank_00_model_states.pt"
                )
                torch.save(state, tag / name)
    return tag


def _zero12_partitions(
    params: dict[str, torch.nn.Parameter], groups: list[list[str]], layout: ZeroLayout
) -> tuple[list[list[torch.Tensor]], list[list[int]] | None, list[list[int]], list[list[dict]]]:
    """Per rank, per group: the saved fp32 partition (stage_1_and_2.py / bf16_optimizer.py)."""
    world = layout.world
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    group_paddings: list[list[int]] = [[] for _ in range(world)]
    mappings: list[list[dict]] = [[] for _ in range(world)]
    all_paddings = []
    for names in groups:
        pieces, pads, offsets, offset = [], [], {}, 0
        for i, name in enumerate(names):
            tensor = params[name].detach().reshape(-1)
            pieces.append(tensor)
            offsets[name] = (offset, tensor.numel())
            offset += tensor.numel()
            pad = 0 if i == len(names) - 1 else (-offset) % layout.param_alignment
            pads.append(pad)
            if pad:
                pieces.append(torch.zeros(pad))
            offset += pad
        padded_numel = offset
        aligned = math.ceil(padded_numel / (2 * world)) * (2 * world)
        flat = torch.cat([*pieces, torch.zeros(aligned - padded_numel)])
        size = aligned // world
        for rank in range(world):
            left = rank * size
            padding = max(0, min(size, left + size - padded_numel))
            partition = flat[left : left + size]
            if not layout.bf16_optimizer:  # _get_groups_without_padding
                partition = partition[: size - padding]
            per_rank[rank].append(partition.clone())
            group_paddings[rank].append(padding)
            mappings[rank].append(
                {
                    n: (max(s, left) - left, min(s + c, left + size) - max(s, left))
                    for n, (s, c) in offsets.items()
                    if s < left + size and s + c > left
                }
            )
        all_paddings.append(pads)
    paddings = all_paddings if layout.param_alignment > 1 else None
    return per_rank, paddings, group_paddings, mappings


def _zero3_piece(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    flat = tensor.reshape(-1)
    part = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, torch.zeros(part * world - flat.numel())])
    return padded[rank * part : (rank + 1) * part]


def _zero3_partitions(
    params: dict[str, torch.nn.Parameter], groups: list[list[str]], world: int
) -> list[list[torch.Tensor]]:
    """Per rank, per sub-group: rank's piece of each parameter, concatenated (stage3.py)."""
    return [
        [torch.cat([_zero3_piece(params[n].detach(), r, world) for n in g]).clone() for g in groups]
        for r in range(world)
    ]
