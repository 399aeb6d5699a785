"""What `--stage grpo|ppo` has been run under: one process or data parallelism with replicated
weights (ZeRO-0/1), full weights, a prompt file.

`layout.check_stage` calls `check_rl_stage` (the CLI before launching workers, the service before
starting a job); everything else is refused by flag, before any worker starts or weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from training.objectives.grpo import GRPOLoss
from training.objectives.ppo import PPOLoss
from training.rewards import check_reward_flags

if TYPE_CHECKING:
    from training.config import TrainingConfig


def build_rl_objective(config: TrainingConfig) -> GRPOLoss | PPOLoss:
    """The stage's objective with its settings (no rollout source, reward or data yet)."""
    rl, stage = config.rl, config.run.stage
    if stage == GRPOLoss.name:
        return GRPOLoss(
            num_generations=rl.num_generations,
            beta=rl.beta,
            epsilon=rl.epsilon,
            epsilon_high=rl.epsilon_high,
            loss_type=rl.loss_type,
            scale_rewards=rl.scale_rewards,
            max_completion_length=rl.max_completion_length,
        )
    return PPOLoss(
        kl_coef=rl.kl_coef,
        gamma=rl.gamma,
        lam=rl.lam,
        cliprange=rl.cliprange,
        cliprange_value=rl.cliprange_value,
        vf_coef=rl.vf_coef,
        seed=config.run.seed,
    )


def check_rl_stage(config: TrainingConfig, world_size: int) -> None:
    """Refuse a configuration --stage grpo/ppo cannot run, naming the flag."""
    stage = config.run.stage
    where = f"--stage {stage}"
    par = config.parallel
    for flag, size in (
        ("--tensor-model-parallel-size", par.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", par.pipeline_model_parallel_size),
        ("--context-parallel-size", par.context_parallel_size),
        ("--expert-model-parallel-size", par.expert_model_parallel_size),
    ):
        if size > 1:
            raise ValueError(
                f"{flag} {size} with {where}: online RL runs in one process or under data "
                "parallelism (each rank's colocated engine generates with its whole replica of "
                f"the policy); use {flag} 1 (docs/alignment.md)"
            )
    if world_size > 1 and par.zero_stage >= 2:
        raise ValueError(
            f"--zero-stage {par.zero_stage} with {where} on {world_size} ranks: the colocated "
            "engine reads each rank's whole weights in place, which ZeRO-2/3 shards; use "
            "--zero-stage 0 or 1 (docs/alignment.md)"
        )
    data, rl = config.data, config.rl
    refused = {
        "--peft-method": config.peft.peft_method is not None,
        "--recompute-granularity": config.parallel.recompute_granularity is not None,
        "--compile": config.parallel.compile,
        "--mock-data": data.mock_data,
        "--is-instruction-dataset": data.is_instruction_dataset,
        "--pack": data.pack,
        "--variable-seq-lengths": data.variable_seq_lengths,
        "--reset-position-ids": data.reset_position_ids,
        "--reset-attention-mask": data.reset_attention_mask,
        "--eod-mask-loss": data.eod_mask_loss,
        "--data-cache-path": data.data_cache_path is not None,
        "--test-data-path": bool(data.test_data_path),
        "--split": data.split != "969,30,1",
        "--fp16": config.precision.fp16,
    }
    for flag, given in refused.items():
        if given:
            raise ValueError(
                f"{flag} with {where}: not supported for online RL yet (data parallelism, "
                f"full weights, a JSON-lines prompt file); drop {flag} (docs/alignment.md)"
            )
    for flag, paths in (
        ("--data-path", data.data_path),
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
    ):
        if len(paths) > 1:
            raise ValueError(f"{flag} {' '.join(paths)}: {where} reads one prompt file; give one")
    if data.data_path and data.train_data_path:
        raise ValueError(f"{where}: give --data-path or --train-data-path, not both")
    total = rl.max_prompt_length + rl.max_completion_length
    if total > config.model.seq_length:
        raise ValueError(
            f"--max-prompt-length {rl.max_prompt_length} + --max-completion-length "
            f"{rl.max_completion_length} = {total} is over --seq-length "
            f"{config.model.seq_length}, the longest rollout row; raise --seq-length"
        )
    if rl.reward_model is not None and not Path(rl.reward_model).is_dir():
        raise ValueError(
            f"--reward-model {rl.reward_model}: no such directory; pass a --stage rm run's --save"
        )
    check_reward_flags(
        rl.reward_funcs, rl.reward_weights, rl.reward_regex, rl.reward_model is not None
    )
    build_rl_objective(config)  # the settings' ranges
