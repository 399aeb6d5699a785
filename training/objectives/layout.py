"""What each objective has been run under: a combination outside it is refused before any worker.

`TrainingConfig.validate` calls `check_stage` (the CLI calls it before launching workers, the
service before starting a job). `sft` runs under every layout the loop has. The preference stages
(`rm`, `dpo`, `simpo`, `orpo`) have been run and checked in one process on full weights
(tests/training/test_alignment_train.py), under data parallelism with replicated weights
(ZeRO-0/1: tests/training/test_alignment_dist.py), with sharded weights (ZeRO-2/3), tensor
parallelism with and without sequence parallelism, pipeline parallelism and their combinations
(tests/training/test_alignment_layouts.py) and, for `dpo`, with LoRA adapters (the reference is
the base: adapters disabled). Context and expert parallelism (`PAIRWISE_REFUSALS`), other
adapters, recompute and torch.compile are refused by flag until a test shows them equal to one
process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.objectives.dpo import DPOLoss
from training.objectives.orpo import ORPOLoss
from training.objectives.rl_layout import check_rl_stage
from training.objectives.simpo import SimPOLoss

if TYPE_CHECKING:
    from training.config import TrainingConfig

PREFERENCE_STAGES = ("rm", "dpo", "simpo", "orpo")
"""Stages that train on preference pairs."""
RL_STAGES = ("grpo", "ppo")
"""Stages that train on their own rollouts of a prompt file (training/objectives/rl_layout.py)."""


PAIRWISE_REFUSALS = {
    "--context-parallel-size": "a pair's log-probability or last-token reward is a sum over "
    "whole sequences, which context parallelism splits over ranks, and the pairwise batch "
    "(chosen/rejected, padded per side) is not cut into the load-balanced chunks ring attention "
    "needs",
    "--expert-model-parallel-size": "the preference stages have not been run on a mixture of "
    "experts against one process (the routers' auxiliary loss is a next-token-loss term)",
}
"""Why each layout the preference stages cannot run is refused (docs/decisions.md)."""


def check_stage(config: TrainingConfig, world_size: int) -> None:
    """Refuse a --stage the rest of the configuration cannot run with, naming the flag."""
    stage = config.run.stage
    config.rl.check_stage(stage)
    if stage in RL_STAGES:
        check_rl_stage(config, world_size)
        return
    if stage not in PREFERENCE_STAGES:
        return
    where = f"--stage {stage}"
    par = config.parallel
    for flag, size in (
        ("--context-parallel-size", par.context_parallel_size),
        ("--expert-model-parallel-size", par.expert_model_parallel_size),
    ):
        if size > 1:
            raise ValueError(
                f"{flag} {size} with {where}: the preference stages run under data parallelism "
                "(ZeRO 0-3), tensor/sequence and pipeline parallelism, but not this one: "
                f"{PAIRWISE_REFUSALS[flag]}; use {flag} 1 (docs/training.md)"
            )
    peft = config.peft.peft_method
    refused = {
        "--peft-method": peft is not None and not (peft == "lora" and stage == DPOLoss.name),
        "--lora-modules-to-save": bool(config.peft.lora_modules_to_save),
        "--recompute-granularity": config.parallel.recompute_granularity is not None,
        "--compile": config.parallel.compile,
        "--mock-data": config.data.mock_data,
        "--is-instruction-dataset": config.data.is_instruction_dataset,
        "--pack": config.data.pack,
        # Token-stream options that pairs, padded per side, have no use for:
        "--variable-seq-lengths": config.data.variable_seq_lengths,
        "--reset-position-ids": config.data.reset_position_ids,
        "--reset-attention-mask": config.data.reset_attention_mask,
        "--eod-mask-loss": config.data.eod_mask_loss,
        "--data-cache-path": config.data.data_cache_path is not None,
        "--test-data-path": bool(config.data.test_data_path),
    }
    for flag, given in refused.items():
        if given:
            raise ValueError(
                f"{flag} with {where}: not supported for this stage yet (the preference stages "
                "train full weights, or LoRA adapters under dpo, on pairwise shards padded per "
                f"side, without recompute or compile); drop {flag} (docs/alignment.md)"
            )
    if stage == DPOLoss.name:  # the settings' ranges, before any worker builds the objective
        DPOLoss(
            beta=config.run.dpo_beta,
            loss_type=config.run.dpo_loss_type,
            label_smoothing=config.run.dpo_label_smoothing,
        )
    if stage == ORPOLoss.name:
        ORPOLoss(beta=config.run.orpo_beta)
    if stage == SimPOLoss.name:
        SimPOLoss(beta=config.run.simpo_beta, gamma_beta_ratio=config.run.gamma_beta_ratio)
