"""Training objectives, one registry keyed by the string the CLI and the config use (--stage).

`sft` (next-token cross entropy), `rm` (a reward model: a scalar value head scored on
chosen/rejected pairs), `dpo` (chosen/rejected against a frozen reference), `simpo`
(reference-free, length-normalised), `orpo` (NLL plus an odds-ratio term, reference-free); `grpo`
and `ppo` (online RL on rollouts, settings from the config's `rl` section,
training/objectives/rl_layout.py). Each is an
`Objective` subclass in its own file, registered here: it reads its batch, says what it counts
(tokens, pairs) and returns the summed loss with any extra metrics. Adding one also adds its name
to `RunSection.stage`'s choices, which is what lets `--stage NAME` through, and to
`layout.STAGE_LAYOUTS`, which says what it has been run under.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.objectives.base import ForwardContext, Objective, ObjectiveOutput
from training.objectives.dpo import DPOLoss
from training.objectives.grpo import GRPOLoss
from training.objectives.orpo import ORPOLoss
from training.objectives.ppo import PPOLoss
from training.objectives.rl_layout import build_rl_objective
from training.objectives.rm import RewardLoss
from training.objectives.sft import NextTokenLoss
from training.objectives.simpo import SimPOLoss

if TYPE_CHECKING:
    from training.checkpoint import PathGuard
    from training.config import TrainingConfig
    from training.run_sections import RunSection

__all__ = ["OBJECTIVES", "ForwardContext", "Objective", "ObjectiveOutput", "build_objective"]

OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls
    for cls in (NextTokenLoss, RewardLoss, DPOLoss, SimPOLoss, ORPOLoss, GRPOLoss, PPOLoss)
}
"""Objective classes by name."""


def build_objective(
    name: str,
    run: RunSection | None = None,
    path_guard: PathGuard | None = None,
    config: TrainingConfig | None = None,
) -> Objective:
    """The registered objective `name` with the run's settings (--dpo-*, --ref-model,
    --simpo-beta, --gamma-beta-ratio, --orpo-beta, --seed; defaults without `run`; `path_guard`
    checks the reference's path when read; grpo/ppo from `config`'s rl section); ValueError
    naming --stage and the known ones for an unknown name."""
    if name not in OBJECTIVES:
        raise ValueError(
            f"--stage {name!r} is not a training objective; known: {sorted(OBJECTIVES)}"
        )
    if name in (GRPOLoss.name, PPOLoss.name) and config is not None:
        return build_rl_objective(config)
    if run is None:
        return OBJECTIVES[name]()
    if name == DPOLoss.name:
        # On use: at the top it would cycle (training.config imports training.objectives.layout,
        # which runs this file, and reference imports training.setup, which imports the config).
        from training.objectives.reference import reference_loader

        return DPOLoss(
            beta=run.dpo_beta,
            loss_type=run.dpo_loss_type,
            label_smoothing=run.dpo_label_smoothing,
            reference_loader=None
            if run.ref_model is None
            else reference_loader(run.ref_model, path_guard),
        )
    if name == ORPOLoss.name:
        return ORPOLoss(beta=run.orpo_beta)
    if name == SimPOLoss.name:
        return SimPOLoss(beta=run.simpo_beta, gamma_beta_ratio=run.gamma_beta_ratio)
    if name == RewardLoss.name:
        return RewardLoss(seed=run.seed)
    return OBJECTIVES[name]()
