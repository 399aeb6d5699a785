"""Joining an online-RL objective to its run: prompt data, rewards and the rollout source.

The training library does not import the engine (tests/test_layering.py), so whoever builds the
`Trainer` hands it a `RolloutFactory`: given the policy module (after the objective's
`prepare_model`, before any step), the prompt set and the `rl` section, it returns the
`RolloutSource` that generates with that module's weights. `meshline train` passes
`services.trainer.rollouts.colocated_rollouts` (the engine over the policy, in place).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.tokenizer import build_tokenizer
from training.batching import stack_samples
from training.config import TrainingConfig
from training.objectives.grpo import GRPOLoss
from training.objectives.ppo import PPOLoss
from training.objectives.rollouts import RolloutSource
from training.prompt_data import PromptDataset, read_prompts, tokenize_prompts
from training.rewards import build_reward, load_reward_model
from training.rl_sections import RLSection

RolloutFactory = Callable[[nn.Module, PromptDataset, RLSection], RolloutSource]
"""Builds the rollout source over the policy module."""


def build_prompt_data(config: TrainingConfig, dp_size: int) -> tuple[tuple[Any, Any], int, Any]:
    """(train, valid) `PromptDataset`s, the tokenizer's vocabulary size, collate fn."""
    run, batch, data = config.run, config.batch, config.data
    source = data.tokenizer_model or data.tokenizer_name_or_path
    if data.tokenizer_type is None or source is None:
        raise ValueError(
            f"--stage {run.stage} needs --tokenizer-type and --tokenizer-model or "
            "--tokenizer-name-or-path (to encode the prompts and decode the completions)"
        )
    tokenizer = build_tokenizer(
        data.tokenizer_type, source, use_fast=not data.tokenizer_not_use_fast
    )
    flag, paths = (
        ("--data-path", data.data_path)
        if data.data_path
        else ("--train-data-path", data.train_data_path)
    )
    width = config.rl.max_prompt_length
    train_set = tokenize_prompts(read_prompts(paths[0], flag), tokenizer, width, paths[0])
    valid_set = train_set
    if data.valid_data_path:
        path = data.valid_data_path[0]
        valid_set = tokenize_prompts(
            read_prompts(path, "--valid-data-path"), tokenizer, width, path
        )
    global_batch = batch.global_batch_size or batch.micro_batch_size * dp_size
    train = PromptDataset(train_set, run.train_iters * global_batch, run.seed)
    valid = PromptDataset(
        valid_set, max(run.eval_iters, 1) * batch.micro_batch_size * dp_size, run.seed + 1
    )
    return (train, valid), tokenizer.vocab_size, stack_samples


def attach_rl(
    objective: GRPOLoss | PPOLoss,
    config: TrainingConfig,
    train_data: PromptDataset,
    rollouts: RolloutFactory,
    device: torch.device,
) -> None:
    """Give the objective its prompt records, reward function and rollout factory (without
    them, a Trainer trains on finished rollouts its `datasets` hold)."""
    rl = config.rl
    model_dir = rl.reward_model

    def reward_model() -> nn.Module:
        assert model_dir is not None
        return load_reward_model(model_dir, device)

    objective.records = train_data.records
    objective.pad_id = train_data.pad_id
    objective.reward = build_reward(
        rl.reward_funcs,
        rl.reward_weights,
        regex=rl.reward_regex,
        reward_model=reward_model if model_dir is not None else None,
        pad_id=train_data.pad_id,
    )
    objective.rollout_factory = lambda policy: rollouts(policy, train_data, rl)
