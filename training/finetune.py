"""Parameter-efficient fine-tuning in the trainer: flags, model preparation, adapter checkpoints.

ModelLink's flags: `--lora-target-modules` (which also switches LoRA on), `--lora-r`,
`--lora-alpha`, `--lora-dropout`, `--lora-modules-to-save`, `--lora-load`, plus
`--peft-method {lora,bitfit,prefix}` and `--num-virtual-tokens` (prefix length).

Checkpoints with a method on hold only the trainable tensors (and their optimizer state): the
base comes from `--load BASE --finetune`, and `--lora-load DIR` resumes a run saved with `--save`
(adapters, optimizer, schedule, counters) or loads an adapter directory (Meshline or peft).
Every save also exports `<--save>/adapter/` (Meshline + peft formats, see `models/lora_io.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from torch import nn

from models.config import ModelConfig
from models.lora import LoraConfig, LoraLinear, apply_lora
from models.lora_io import load_lora, save_lora_state
from models.peft_methods import apply_bitfit, apply_prefix
from models.qat import apply_qat as fake_quantize_linears
from models.qlora import quantize_lora_base
from training.ckpt.state import TrainState, tensor_tree
from training.config_sections import flag_name

if TYPE_CHECKING:  # both import this module (PeftSection, check): runtime imports would cycle
    from training.checkpoint import CheckpointManager
    from training.config import TrainingConfig
    from training.trainer_state import TrainerState

_WRAPPER_PARTS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass
class PeftSection:
    """Parameter-efficient fine-tuning: LoRA, BitFit or prefix tuning."""

    peft_method: Literal["lora", "bitfit", "prefix"] | None = None
    """Train only an adapter: lora, bitfit (biases and norms) or prefix (key/value prefixes)."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Linear layers to adapt (Meshline names or ModelLink aliases); implies --peft-method lora."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (adapter output x alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA adapters' input."""
    lora_modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full and saved with the adapters (e.g. lm_head)."""
    lora_load: str | None = None
    """Adapter directory (Meshline or peft), or a fine-tuning run's --save dir to resume."""
    num_virtual_tokens: int = 8
    """Prefix length per layer for --peft-method prefix."""
    base_quant: Literal["nf4", "int4", "int8"] | None = None
    """QLoRA: hold the frozen base of the LoRA layers as NF4, int4 (groups of 64) or int8 (per
    channel) from the first step on (models/qlora.py); needs --lora-target-modules."""

    def __post_init__(self) -> None:
        if (self.lora_target_modules or self.lora_load) and self.peft_method is None:
            self.peft_method = "lora"
        if self.peft_method == "lora":
            self.lora_config()
        elif self.lora_target_modules or self.lora_modules_to_save:
            raise ValueError(
                f"--lora-* flags are set but --peft-method is {self.peft_method}; drop them or "
                "use --peft-method lora"
            )
        if self.base_quant is not None and self.peft_method != "lora":
            raise ValueError(
                f"--base-quant {self.base_quant} quantizes the frozen base under LoRA adapters; "
                "add --lora-target-modules (e.g. query_key_value dense), or drop --base-quant"
            )
        if self.num_virtual_tokens <= 0:
            raise ValueError(f"{flag_name('num_virtual_tokens')} must be positive")

    def lora_config(self) -> Any:
        """The `models.lora.LoraConfig` these flags describe (validated)."""
        if not self.lora_target_modules and not self.lora_load:
            raise ValueError(
                "--peft-method lora needs --lora-target-modules (e.g. query_key_value dense) or "
                "--lora-load DIR"
            )
        return LoraConfig(
            r=self.lora_r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=self.lora_target_modules or ["qkv_proj"],
            modules_to_save=list(self.lora_modules_to_save),
        )


def _is_run_checkpoint(path: str | None) -> bool:
    return path is not None and (Path(path) / "latest").exists()


def check(config: TrainingConfig) -> None:
    """Cross-section checks (ValueError naming the flags)."""
    peft = config.peft
    qat = config.precision.qat
    if qat is not None:
        if peft.peft_method is not None:
            raise ValueError(
                f"--qat {qat} fake-quantizes the weights being trained; with --peft-method "
                f"{peft.peft_method} the base is frozen: drop one (QLoRA: --base-quant)"
            )
        _check_whole_model_swap(config, f"--qat {qat}", "fake-quantizes the decoder linears")
    if peft.peft_method is None:
        return
    if config.run.load and not config.run.finetune:
        raise ValueError(
            f"--peft-method {peft.peft_method} with --load: the base checkpoint loads weights only; "
            "add --finetune (resume a fine-tuning run with --lora-load SAVE_DIR)"
        )
    if peft.base_quant is not None:
        _check_whole_model_swap(
            config,
            f"--base-quant {peft.base_quant}",
            "swaps the frozen base weights of one process's whole model after loading",
        )
    if _is_run_checkpoint(peft.lora_load) and not config.run.load:
        raise ValueError(
            f"--lora-load {peft.lora_load} is a training checkpoint; resume it with the base "
            "weights it was trained on: --load BASE --finetune"
        )


def _check_whole_model_swap(config: TrainingConfig, flag: str, what: str) -> None:
    """Refuse the layouts that shard or wrap the linears a quantized-training flag swaps."""
    par = config.parallel
    layout = {
        "--tensor-model-parallel-size": par.tensor_model_parallel_size > 1,
        "--pipeline-model-parallel-size": par.pipeline_model_parallel_size > 1,
        "--context-parallel-size": par.context_parallel_size > 1,
        "--zero-stage 2/3 (sharded parameters)": par.zero_stage >= 2,
        "--hsdp": par.hsdp,
        "--compile": par.compile,
    }
    bad = [name for name, on in layout.items() if on]
    if bad:
        raise ValueError(
            f"{flag} {what}; it does not combine with {', '.join(bad)} (use data parallelism "
            f"with --zero-stage 0 or 1, or drop {flag.split()[0]})"
        )


def apply_qat(model: nn.Module, config: TrainingConfig) -> nn.Module:
    """--qat: fake-quantize the freshly built model's decoder linears (models/qat.py)."""
    scheme = config.precision.qat_scheme()
    if scheme is None:
        return model

    try:
        fake_quantize_linears(model, scheme)
    except ValueError as exc:
        raise ValueError(
            f"--qat {config.precision.qat} --qat-group-size {scheme.group_size}: {exc}"
        ) from exc
    return model


def prepare_model(model: nn.Module, config: TrainingConfig) -> nn.Module:
    """Apply the configured method to a freshly built model (before wrapping or the optimizer)."""
    peft = config.peft
    if peft.peft_method is None:
        return model
    check(config)
    seed = config.run.seed
    model_config = cast(ModelConfig, model.config)
    if peft.peft_method == "bitfit":
        apply_bitfit(model)
    elif peft.peft_method == "prefix":
        apply_prefix(model, peft.num_virtual_tokens, model_config.init_std, seed)
    elif peft.lora_load and not _is_run_checkpoint(peft.lora_load):
        load_lora(model, peft.lora_load, model_config)
    else:
        apply_lora(model, peft.lora_config(), seed=seed)
    return model


def clean_name(name: str) -> str:
    """A parameter name without data-parallel / compile / recompute wrapper components."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def is_adapter_tensor(name: str) -> bool:
    """True for tensors a method adds (LoRA A/B, prefixes), which a base checkpoint lacks."""
    return ".lora_" in name or name.endswith((".prefix_key", ".prefix_value"))


def adapter_module(trainer: TrainerState, *, base: bool) -> nn.Module:
    """A module tree holding the trainable parameters (or, with `base`, every parameter the base
    model has), under the model's names.

    In fp32-master precision the trainable tensors are the optimizer's master copies.
    """
    optimizer = trainer.optimizer
    masters: dict[int, Any] = {}
    if optimizer.plan.mode == "master":
        masters = dict(zip(map(id, optimizer.model_params), optimizer.master_params, strict=True))
    return tensor_tree(
        (clean_name(name), masters.get(id(param), param))
        for name, param in trainer.model.named_parameters()
        if (not is_adapter_tensor(name) if base else param.requires_grad)
    )


def checkpoint_state(trainer: TrainerState, *, loading: bool) -> TrainState:
    """The `TrainState` of a fine-tuning run: the base weights when loading --load, else the
    trainable tensors with their optimizer state and the run's counters."""
    if loading:
        return TrainState(model=adapter_module(trainer, base=True), save_rng=False)
    return TrainState(
        model=adapter_module(trainer, base=False),
        optimizer=trainer.optimizer.inner,
        scheduler=trainer.scheduler,
        loss_scaler=trainer.scaler,
        extra=trainer.state.state_dict(),
    )


def resume(
    trainer: TrainerState, manager_for: Callable[[TrainerState, str | None], CheckpointManager]
) -> int | None:
    """Restore adapters, optimizer and counters from a --lora-load run checkpoint (else None)."""
    import torch

    peft = trainer.config.peft
    if peft.peft_method is None or not _is_run_checkpoint(peft.lora_load):
        return None
    state = checkpoint_state(trainer, loading=False)
    run = trainer.config.run
    if run.no_load_optim:
        state.optimizer = None
    if run.no_load_rng:
        state.save_rng = False
    step = manager_for(trainer, peft.lora_load).load("latest", state)
    optimizer = trainer.optimizer
    if optimizer.plan.mode == "master":
        with torch.no_grad():
            for p, m in zip(optimizer.model_params, optimizer.master_params, strict=True):
                p.copy_(m)
    trainer.state.load_state_dict(state.extra)
    return int(step)


def export_adapter(trainer: TrainerState) -> Path | None:
    """Write `<--save>/adapter` (Meshline + peft files) for LoRA runs; other methods' tensors
    are in the step checkpoint. Every rank contributes the adapters it holds (pipeline stages
    hold different ones, sharded ones are gathered); rank 0 writes and returns the directory."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    peft = trainer.config.peft
    if peft.peft_method != "lora" or not trainer.config.run.save:
        return None
    model = adapter_module(trainer, base=False)
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in model.named_parameters()
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        # In-process exchange between this job's ranks (not a file): object gather is safe here.
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, full)
        full = {k: v for part in parts for k, v in part.items()}
        if dist.get_rank() != 0:
            return None

    target = Path(trainer.config.run.save) / "adapter"
    lora = _effective_lora(trainer.model, full)
    return save_lora_state(full, lora, trainer.model_config, target)


def _effective_lora(model: nn.Module, tensors: dict[str, Any]) -> Any:
    """The LoraConfig of the adapters in `tensors` (rank, scale and dropout read from `model`)."""
    first = next(m for m in model.modules() if isinstance(m, LoraLinear))
    adapted = {n.rsplit(".", 3)[-3] for n in tensors if ".lora_A." in n}
    saved = sorted({n.rpartition(".")[0] for n in tensors if ".lora_" not in n})
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    return LoraConfig(
        r=first.r,
        alpha=first.scaling * first.r,
        dropout=dropout,
        target_modules=sorted(adapted),
        modules_to_save=saved,
    )


def quantize_base(model: nn.Module, config: TrainingConfig) -> tuple[int, int] | None:
    """QLoRA (--base-quant): hold the LoRA layers' frozen base weights quantized, once the base
    is loaded; (float bytes, quantized bytes) of those weights, or None without the flag."""
    kind = config.peft.base_quant
    if kind is None:
        return None

    return quantize_lora_base(model, kind)
