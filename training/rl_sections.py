"""The online-RL config section: `--stage grpo` and `--stage ppo` settings (trl's names).

Each field is a flag (`num_generations` -> `--num-generations`, trl's GRPOConfig / PPOConfig
spelling); a setting given with a stage that does not read it is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from training.config_sections import flag_name

RL_STAGES = ("grpo", "ppo")
"""Stages that generate their own training data (rollouts)."""
GRPO_ONLY = ("num_generations", "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards")
PPO_ONLY = ("kl_coef", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef")


@dataclass
class RLSection:
    """Rollouts, rewards and the GRPO / PPO losses."""

    max_prompt_length: int = 512
    """--stage grpo/ppo: prompts longer than this many tokens are refused (naming the line)."""
    max_completion_length: int = 256
    """--stage grpo/ppo: new tokens per completion at most."""
    temperature: float = 1.0
    """--stage grpo/ppo: the rollouts' sampling temperature."""
    top_p: float = 1.0
    """--stage grpo/ppo: nucleus sampling mass of the rollouts (1 disables)."""
    top_k: int = 0
    """--stage grpo/ppo: keep the k most likely tokens when sampling (0 disables)."""
    reward_funcs: list[str] = field(default_factory=list)
    """--stage grpo/ppo: reward functions by name, summed with --reward-weights: exact_match,
    gsm8k, regex, reward_model (training/rewards.py)."""
    reward_weights: list[float] = field(default_factory=list)
    """--stage grpo/ppo: one weight per --reward-funcs entry (default 1 each)."""
    reward_regex: str | None = None
    """--reward-funcs regex: the pattern whose match in a completion scores 1."""
    reward_model: str | None = None
    """--reward-funcs reward_model: a `--stage rm` run's --save directory (or a step in it)."""
    num_generations: int = 8
    """--stage grpo: completions per prompt (the group); --micro-batch-size counts prompts."""
    beta: float = 0.0
    """--stage grpo: KL coefficient towards the starting weights (k3 estimator; 0: no
    reference)."""
    epsilon: float = 0.2
    """--stage grpo: lower clipping range of the probability ratio (and upper without
    --epsilon-high)."""
    epsilon_high: float | None = None
    """--stage grpo: upper clipping range (DAPO's clip-higher; default --epsilon)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """--stage grpo: how per-token losses are aggregated (trl's names)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """--stage grpo: divide advantages by the group's or the batch's reward std, or not."""
    kl_coef: float = 0.05
    """--stage ppo: KL penalty per token in the rewards."""
    gamma: float = 1.0
    """--stage ppo: discount factor of GAE."""
    lam: float = 0.95
    """--stage ppo: λ of GAE."""
    cliprange: float = 0.2
    """--stage ppo: clipping range of the policy ratio."""
    cliprange_value: float = 0.2
    """--stage ppo: clipping range of the value estimates."""
    vf_coef: float = 0.1
    """--stage ppo: weight of the value loss."""

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1 or self.max_completion_length < 1:
            raise ValueError(
                f"--max-prompt-length ({self.max_prompt_length}) and --max-completion-length "
                f"({self.max_completion_length}) must be >= 1"
            )
        if not 2 <= self.num_generations < 1 << 16:
            raise ValueError(f"--num-generations must be in [2, 65535], got {self.num_generations}")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"--temperature {self.temperature} (>= 0), --top-p {self.top_p} (in (0, 1]) and "
                f"--top-k {self.top_k} (>= 0) are out of range"
            )

    def check_stage(self, stage: str) -> None:
        """Refuse settings the stage does not read, naming them."""
        defaults = RLSection()
        changed = [
            f.name for f in fields(self) if getattr(self, f.name) != getattr(defaults, f.name)
        ]
        if stage not in RL_STAGES:
            wrong = changed
        else:
            wrong = [n for n in changed if n in (PPO_ONLY if stage == "grpo" else GRPO_ONLY)]
        if wrong:
            names = ", ".join(flag_name(n) for n in wrong)
            raise ValueError(
                f"{names}: not read by --stage {stage}; drop them (docs/alignment.md says "
                "which stage reads which)"
            )
