"""--stage ppo end to end: colocated rollouts, the reward, policy and critic trained together."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.arguments import parse_args
from services.trainer.launch_checks import check_paths
from services.trainer.rollouts import colocated_rollouts
from tests.training.test_grpo_train import _flags, digit_task  # noqa: F401  (a fixture)
from training.loop import Trainer
from training.objectives.ppo import PolicyAndCritic, PPOLoss


def _ppo_flags(task, *extra: str) -> list[str]:
    flags = _flags(task, *extra)
    for flag in ("--num-generations", "--loss-type"):
        at = flags.index(flag)
        del flags[at : at + 2]
    flags[flags.index("grpo")] = "ppo"
    return flags


def test_ppo_trains_policy_and_critic_on_its_rollouts(digit_task, tmp_path) -> None:  # noqa: F811
    records: list[dict] = []
    flags = _ppo_flags(digit_task, "--train-iters", "2", "--kl-coef", "0.1", "--vf-coef", "0.5")
    trainer = Trainer(
        parse_args([*flags, "--save", str(tmp_path)]),
        on_metrics=records.append,
        rollouts=colocated_rollouts,
    )
    assert isinstance(trainer.objective, PPOLoss) and trainer.objective.kl_coef == 0.1
    model = trainer.model
    assert isinstance(model, PolicyAndCritic)
    start = copy.deepcopy(model.state_dict())
    summary = trainer.fit()
    assert summary.checkpoint is not None
    moved = {
        part: any(
            not torch.equal(tensor, start[name])
            for name, tensor in model.state_dict().items()
            if name.startswith(part)
        )
        for part in ("policy.", "critic.")
    }
    assert moved == {"policy.": True, "critic.": True}
    assert {
        "reward", "reward_std", "kl", "loss/policy", "loss/value", "policy/clipfrac",
        "value/clipfrac", "rollout_tokens_per_s",
    } <= set(records[-1]["objective"])  # fmt: skip
    assert trainer.objective.rollouts.weight_bytes_copied() == 0
    # Resuming would take the trained policy for the reference: refused before any worker,
    # and by the objective itself should a worker be started anyway.
    resumed = parse_args([*flags, "--load", str(tmp_path), "--train-iters", "3"])
    with pytest.raises(ValueError, match=r"--stage ppo with --load .*resuming is not supported"):
        check_paths(resumed)
    worker = Trainer(resumed, rollouts=colocated_rollouts)
    worker.load()
    with pytest.raises(ValueError, match="resumed at step 2"):
        worker.train_step()
