"""Weight-decay parameter groups and the optimizer they feed (built through kernels.optim).

Norm weights and biases get no weight decay (Megatron's convention; decaying a norm's gain pulls
it towards 0 and hurts training). Everything else, embeddings included, decays.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoints.safe_fs import Dir, Escape, open_dir_beneath
from kernels.optim import build_optimizer
from parallel.offload_optimizer import OffloadAdamW, OptimizerOffload
from parallel.param_swap import ParamSwap
from training.config_sections import OptimSection
from training.precision import PrecisionOptimizer, PrecisionPlan


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """True for biases, norm weights and any other 1-D parameter."""
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim < 2 or leaf == "bias" or "norm" in name.lower()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decayed and not-decayed groups over the trainable parameters (empty groups dropped).

    Plain parameters and the DTensors of each mesh (expert parallelism's sharded experts next
    to replicated or tensor-parallel parameters) get groups of their own: the optimizers'
    foreach kernels run per group and refuse a mix of plain tensors and DTensors, or of meshes.
    """
    groups: dict[tuple[bool, tuple[str, ...]], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        no_decay = is_no_decay(name, param)
        key = (no_decay, _mesh_key(param))
        group = groups.setdefault(
            key, {"params": [], "weight_decay": 0.0 if no_decay else weight_decay, "names": []}
        )
        group["params"].append(param)
        group["names"].append(name)
    return [groups[key] for key in sorted(groups)]


def _mesh_key(param: torch.Tensor) -> tuple[str, ...]:
    """() for a plain tensor; a DTensor's mesh axis names and ranks."""
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return (*(mesh.mesh_dim_names or ()), *map(str, mesh.mesh.flatten().tolist()))


# Megatron's `--optimizer adam` applies weight decay decoupled (AdamW); scripts moved over from
# Megatron / ModelLink must get the same update, so the flag maps onto kernels' "adamw".
MEGATRON_OPTIMIZER_NAMES = {"adam": "adamw"}


def build_inner_optimizer(
    optim: OptimSection,
    groups: list[dict],
    offload: OptimizerOffload | None = None,
    param_swap: ParamSwap | None = None,
) -> torch.optim.Optimizer:
    """The optimizer named by --optimizer from kernels.optim's registry over `groups`, or with
    `offload` (--optimizer-cpu-offload) AdamW stepped on the CPU with its states in that tier
    (and the parameter shards in `param_swap`'s file, --param-nvme-path)."""
    clean = [{k: v for k, v in g.items() if k != "names"} for g in groups]
    if offload is not None:
        # Validated with the config (training.config.check_optimizer_offload): an AdamW name.
        swap_dir = None
        if offload.nvme_path is not None:
            swap_dir = open_nvme_path(offload.nvme_path, "--optimizer-nvme-path")
        return OffloadAdamW(
            clean,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=(optim.adam_beta1, optim.adam_beta2),
            eps=optim.adam_eps,
            offload=offload,
            swap_dir=swap_dir,
            param_swap=param_swap,
        )
    extra = {"momentum": optim.sgd_momentum} if optim.optimizer == "sgd" else {}
    return build_optimizer(
        MEGATRON_OPTIMIZER_NAMES.get(optim.optimizer, optim.optimizer),
        clean,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
        **extra,
    )


def build_training_optimizer(
    model: nn.Module,
    optim: OptimSection,
    plan: PrecisionPlan,
    *,
    wrap_inner=None,
    group: torch.distributed.ProcessGroup | None = None,
    offload: OptimizerOffload | None = None,
    param_swap: ParamSwap | None = None,
) -> PrecisionOptimizer:
    """Param groups -> kernels optimizer, or the offloaded AdamW (`offload`), optionally wrapped
    (e.g. ZeRO-1) -> precision handling."""

    def build(groups: list[dict]) -> torch.optim.Optimizer:
        inner = build_inner_optimizer(optim, groups, offload, param_swap)
        return wrap_inner(inner) if wrap_inner is not None else inner

    groups = param_groups(model, optim.weight_decay)
    return PrecisionOptimizer(
        [{k: v for k, v in g.items() if k != "names"} for g in groups],
        build,
        plan,
        clip_grad=optim.clip_grad,
        group=group,
    )


def open_nvme_path(path: str, flag: str) -> Dir:
    """`path` opened (created if missing) as a directory inside the data roots reached through
    no symlink; ValueError naming `flag` otherwise."""
    try:
        return open_dir_beneath(path, create=True)
    except Escape as exc:
        raise ValueError(
            f"{flag} {path!r}: {exc.strerror}; give a directory inside the data roots reached "
            "through no symbolic link"
        ) from None
    except OSError as exc:
        raise ValueError(
            f"{flag} {path!r} is not a usable directory ({exc.strerror}); give a writable local "
            "directory for the swap files"
        ) from None


def build_param_swap(model: nn.Module, path: str | None, buffer_count: int) -> ParamSwap | None:
    """--param-nvme-path: the ZeRO-3 model's parameter shards moved into a swap file there,
    gathered through --param-nvme-buffer-count host buffers."""
    if path is None:
        return None
    return ParamSwap(model, open_nvme_path(path, "--param-nvme-path"), buffer_count)
