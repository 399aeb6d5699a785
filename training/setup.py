"""Building the pieces a `Trainer` runs on: model config, model, data, parallel wrapping, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from models import build_model
from models.config import ModelConfig
from models.registry import get_config
from models.tokenizer import build_tokenizer
from parallel.compile import apply_compile
from parallel.data_parallel import apply_run_data_parallel, build_dp_mesh, wrap_optimizer
from parallel.parallel_dims import ParallelDims
from parallel.parallelize import parallelize_model
from parallel.recompute import apply_recompute
from tokendata.datasets import DataConfig, build_datasets, collate
from training import finetune
from training.batching import stack_samples
from training.checkpoint import CheckpointManager
from training.ckpt.state import TrainState, tensor_tree
from training.config import TrainingConfig
from training.fp8 import apply_fp8
from training.mock_data import MockDataset
from training.objectives.layout import PREFERENCE_STAGES, RL_STAGES
from training.pairwise_data import build_pairwise_data
from training.precision import PrecisionPlan
from training.rl_setup import build_prompt_data
from training.trainer_state import TrainerState


def build_model_config(config: TrainingConfig, tokenizer_vocab: int | None = None) -> ModelConfig:
    """The `models` config `config` trains, covering the tokenizer's vocabulary
    (`TrainingConfig.model_config`: the registry path, or a front end's architecture flags)."""
    return config.model_config(tokenizer_vocab)


def create_model(
    model_config: ModelConfig, device: torch.device, seed: int, *, materialize: bool = True
) -> nn.Module:
    """Build on the meta device, materialise on `device`, initialise from `seed` (fp32).
    `materialize=False` leaves it on the meta device for `materialize_model` after sharding."""
    model = build_model(model_config, device="meta")
    if materialize:
        materialize_model(model, device, seed)
    return model


def materialize_model(model: nn.Module, device: torch.device, seed: int) -> None:
    """Give a meta (possibly ZeRO-3-sharded) model storage on `device` and initialise it from
    `seed`: sharded, each rank allocates its shards only, with the unsharded model's values."""
    model.to_empty(device=device)
    model.init_weights(seed=seed)  # type: ignore[operator]


def build_data(config: TrainingConfig, dp_size: int) -> tuple[tuple[Any, Any], int | None, Any]:
    """(train, valid) datasets, the tokenizer's vocabulary size (None for --mock-data), collate fn."""
    if config.run.stage in RL_STAGES:
        return build_prompt_data(config, dp_size)
    if config.run.stage in PREFERENCE_STAGES:
        return build_pairwise_data(config, dp_size)
    run, batch = config.run, config.batch
    global_batch = batch.global_batch_size or batch.micro_batch_size * dp_size
    train_samples = run.train_iters * global_batch
    valid_samples = max(run.eval_iters, 1) * batch.micro_batch_size * dp_size
    seq = config.model.seq_length
    if config.data.mock_data:
        vocab = config.model.vocab_size or get_config(config.model.model or "tiny-llama").vocab_size
        datasets = (
            MockDataset(train_samples, seq, vocab, seed=run.seed),
            MockDataset(valid_samples, seq, vocab, seed=run.seed + 1),
        )
        return datasets, None, stack_samples

    data = config.data
    source = data.tokenizer_model or data.tokenizer_name_or_path
    if data.tokenizer_type is None or source is None:
        raise ValueError(
            f"--tokenizer-type {data.tokenizer_type} needs --tokenizer-model or --tokenizer-name-or-path"
        )
    tokenizer = build_tokenizer(
        data.tokenizer_type, source, use_fast=not data.tokenizer_not_use_fast
    )
    data_config = DataConfig(
        data_path=list(data.data_path),
        split=data.split,
        train_data_path=list(data.train_data_path),
        valid_data_path=list(data.valid_data_path),
        test_data_path=list(data.test_data_path),
        is_instruction_dataset=data.is_instruction_dataset,
        variable_seq_lengths=data.variable_seq_lengths,
        pack=data.pack,
        data_format=data.data_format,
        cache_dir=data.data_cache_path,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
    )
    wanted_valid = valid_samples if run.eval_interval else 0
    train, valid, _ = build_datasets(
        data_config, tokenizer, seq, run.seed, num_samples=(train_samples, wanted_valid, 0)
    )
    if train is None:
        raise ValueError(
            f"--split {data.split} leaves no training documents; give the train split a share"
        )
    if valid is None and run.eval_interval:
        where = (
            "pass --valid-data-path"
            if data.train_data_path
            else f"--split {data.split} leaves none; give the second split a share"
        )
        raise ValueError(f"no validation documents: {where}, or pass --eval-interval 0")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eod_id

    def collate_fn(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(samples, variable_seq_lengths=data.variable_seq_lengths, pad_id=pad_id)

    return (train, valid), tokenizer.vocab_size, collate_fn


def build_parallel(
    model: nn.Module, config: TrainingConfig, plan: PrecisionPlan, dims: ParallelDims
) -> tuple[nn.Module, Any, Any]:
    """Apply the run's parallelism to `model`: (model, mesh, optimizer wrapper or None).

    `dims` is the run's layout (`parallel.parallel_dims.build_dims`, built once by the caller).
    With tensor, pipeline, context or expert parallelism `parallel.parallelize` applies them and
    the data parallelism over the named mesh; otherwise DDP/FSDP2 over the (`dp_replicate`,
    `dp_shard`) mesh of `dims`. --qat's fake-quantized linears (issue #40), --fp8's FP8 linears
    (issue #43) and a --peft-method adapter (issue #10) are added first.
    """
    model = finetune.apply_qat(model, config)
    apply_fp8(model, config)
    model = finetune.prepare_model(model, config)
    par = config.parallel
    if par.recompute_granularity is not None and dims.model_parallel == 1:
        apply_recompute(
            model, par.recompute_granularity, par.recompute_method, par.recompute_num_layers
        )
    if par.compile and dims.model_parallel == 1:
        apply_compile(model)
    if dims.world_size == 1:
        return model, None, None
    param_dtype = plan.compute_dtype if plan.mode == "fsdp" else torch.float32
    if dims.is_model_parallel:
        model_config = cast(ModelConfig, model.config)
        return parallelize_model(model, model_config, config.parallel_config(), dims, param_dtype)

    mesh = build_dp_mesh(dims.dp, dims.dp_replicate, dims.dp_shard)
    model = apply_run_data_parallel(model, mesh, config.parallel_config(), param_dtype)

    def wrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return wrap_optimizer(optimizer, model, mesh, zero_stage=par.zero_stage)

    return model, mesh, wrap


def _master_module(trainer: TrainerState) -> nn.Module:
    """A module tree holding the fp32 master copies under the model's parameter names.

    Built from the live model's names, not from the model config: a pipeline rank holds only its
    stages' parameters (and a tied head copy also as `embed_tokens.weight`), a tensor-parallel
    rank DTensor shards, so the twin has exactly this rank's tensors under their global names
    and DCP lines the masters up across layouts as it does the fp32 parameters.
    """
    optimizer = trainer.optimizer
    masters = dict(zip(map(id, optimizer.model_params), optimizer.master_params, strict=True))
    named = trainer.model.named_parameters(remove_duplicate=False)
    return tensor_tree((name, masters[id(param)]) for name, param in named)


def checkpoint_state(trainer: TrainerState, *, loading: bool = False) -> TrainState:
    """The checkpoint manager's `TrainState` view of `trainer` (fp32 masters in master mode).

    When `loading`, --finetune restores weights only, --no-load-optim skips the optimizer state
    and --no-load-rng the RNG states.
    """
    if trainer.config.peft.peft_method is not None:
        return finetune.checkpoint_state(trainer, loading=loading)
    optimizer = trainer.optimizer
    module = _master_module(trainer) if optimizer.plan.mode == "master" else trainer.model
    run = trainer.config.run
    if loading and run.finetune:
        return TrainState(model=module, save_rng=False)
    return TrainState(
        model=module,
        optimizer=None if loading and run.no_load_optim else optimizer.inner,
        scheduler=trainer.scheduler,
        loss_scaler=trainer.scaler,
        extra=trainer.state.state_dict(),
        save_rng=not (loading and run.no_load_rng),
    )


def _saved_value_head(manager: CheckpointManager) -> bool:
    """Whether the latest step under `manager` (--load) is a reward model's (its config.json
    says value_head); a causal LM's is not (nor a step without one)."""
    step = manager.latest()
    if step is None:
        return False  # the load itself reports the missing checkpoint
    path = manager.step_dir(step) / "config.json"
    try:
        saved = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--load {manager.save_dir}: {path} is unreadable ({exc})") from exc
    return isinstance(saved, dict) and saved.get("value_head") is True


def _backbone(module: nn.Module) -> nn.Module:
    """The tensors of `module` less its output head: --stage rm --finetune from a causal LM loads
    the backbone, and the value head keeps its fresh initialisation (a vocabulary head has
    another shape and another meaning)."""
    named = module.named_parameters(remove_duplicate=False)
    return tensor_tree(
        (name, param)
        for name, param in named
        if finetune.clean_name(name).split(".")[0] != "lm_head"
    )


def _manager(trainer: TrainerState, directory: str | None) -> CheckpointManager:
    if directory is None:
        raise ValueError("no checkpoint directory: pass --save DIR (or --load DIR to resume)")
    run, data = trainer.config.run, trainer.config.data
    return CheckpointManager(
        directory,
        path_guard=trainer.path_guard,
        keep_last=run.keep_last_checkpoints,
        async_save=run.async_save,
        model_config=trainer.model_config.to_dict(),
        tokenizer_files=tokenizer_files(data.tokenizer_model, data.tokenizer_name_or_path),
    )


# The files of a local transformers tokenizer directory that describe the tokenizer (weights,
# chat templates in other files and anything else there are not copied).
HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip


def tokenizer_files(model_file: str | None, name_or_path: str | None) -> list[Path]:
    """The tokenizer files a checkpoint carries (for convert and serve): a SentencePiece
    --tokenizer-model, or the tokenizer files of a local --tokenizer-name-or-path directory."""
    if model_file:
        return [Path(model_file)]
    if name_or_path and Path(name_or_path).is_dir():
        return [p for n in HF_TOKENIZER_FILES if (p := Path(name_or_path) / n).is_file()]
    return []


def save_checkpoint(trainer: TrainerState) -> str:
    """Save the current step under --save; returns the step directory."""
    if trainer.checkpoints is None:
        trainer.checkpoints = _manager(trainer, trainer.config.run.save)
    saved = trainer.checkpoints.save(trainer.state.step, lambda: _saved_state(trainer))
    finetune.export_adapter(trainer)
    return str(saved)


def _saved_state(trainer: TrainerState) -> TrainState:
    """`checkpoint_state` less what --no-save-optim and --no-save-rng leave out."""
    state = checkpoint_state(trainer)
    run = trainer.config.run
    if run.no_save_optim:
        state.optimizer = None
    if run.no_save_rng:
        state.save_rng = False
    return state


def load_checkpoint(trainer: TrainerState) -> int:
    """Restore the latest step under --load (honouring --finetune/--no-load-optim/--no-load-rng)."""
    run = trainer.config.run
    state = checkpoint_state(trainer, loading=True)
    manager = _manager(trainer, run.load)
    if run.finetune and run.stage == "rm" and not _saved_value_head(manager):
        state.model = _backbone(state.model)
    step = manager.load("latest", state)
    optimizer = trainer.optimizer
    if optimizer.plan.mode == "master":
        with torch.no_grad():
            for p, m in zip(optimizer.model_params, optimizer.master_params, strict=True):
                p.copy_(m)
    if not run.finetune:
        trainer.state.load_state_dict(state.extra)
    resumed = finetune.resume(trainer, _manager)
    return step if resumed is None else resumed
