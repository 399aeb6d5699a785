"""`ppo`: proximal policy optimisation with a critic, as DeepSpeed-Chat's step 3 and trl's PPO.

Shapes: N sequences, S positions, T = S - 1 action positions (position t scores token t + 1,
and the critic's value at t is that action's state value). The model is a `PolicyAndCritic`:
the policy (the registry model) and a critic (a copy with a scalar value head,
models/value_head.py), trained together. From a rollout (ids, completion mask, the sampling
policy's log-probabilities `old_logps`, the reference's `ref_logps`, the critic's `old_values`
and one `scores` [N] per sequence from the reward function):

1. per-token rewards: -kl_coef (old_logps - ref_logps) on completion tokens (the k1 estimate),
   plus the sequence's score on its last completion token (DeepSpeed-Chat's `compute_rewards`;
   the reward clipped to ±reward_clip when given);
2. advantages and returns by GAE (γ, λ) over the completion (`rl_losses.gae`), the advantages
   whitened over the micro-batch's completion tokens (trl);
3. loss = clipped policy loss + vf_coef x clipped value loss (`rl_losses.ppo_terms`), each a mean
   over the micro-batch's completion tokens; count 1 per micro-batch, so a step's loss is the
   mean over its micro-batches, as trl's accumulation.

Online, each prompt micro-batch is rolled out with the policy's current weights (one PPO epoch
per rollout: the old log-probabilities and values are the current ones, detached).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from models.transformer import CausalLM
from models.value_head import attach_value_head, has_value_head
from training.objectives.base import ForwardContext, Objective, ObjectiveOutput
from training.objectives.dpo import frozen_copy
from training.objectives.rl_losses import gae, masked_whiten, ppo_terms, token_logps
from training.objectives.rollouts import (
    RewardFn,
    RolloutSource,
    check_prompt_batch,
    is_rollout_batch,
    pack_rollouts,
    prompt_lists,
    samples_of,
)


class PolicyAndCritic(nn.Module):
    """The policy and its critic, one module for the optimizer and the checkpoint."""

    def __init__(self, policy: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        if not has_value_head(critic):
            raise ValueError("PPO's critic needs a scalar value head (models.value_head)")
        self.policy = policy
        self.critic = critic

    def forward(self, ids_NS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(policy logits [N, S, V], critic values [N, S])."""
        return self.policy(ids_NS), self.critic(ids_NS)[..., 0]


def token_rewards(
    scores_N: torch.Tensor,
    old_logps_NT: torch.Tensor,
    ref_logps_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    kl_coef: float,
    reward_clip: float | None = None,
) -> torch.Tensor:
    """Per-token rewards [N, T]: the KL penalty on every completion token, the score on the last."""
    mask = mask_NT.to(old_logps_NT.dtype)
    rewards = -kl_coef * (old_logps_NT - ref_logps_NT) * mask
    scores = scores_N.float()
    if reward_clip is not None:
        scores = scores.clamp(-reward_clip, reward_clip)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * positions).argmax(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += scores * (mask.sum(dim=1) > 0)
    return rewards


class PPOLoss(Objective):
    """Clipped policy + value loss over a micro-batch's completion tokens; count 1 per batch."""

    name: ClassVar[str] = "ppo"

    def __init__(
        self,
        *,
        kl_coef: float = 0.05,
        gamma: float = 1.0,
        lam: float = 0.95,
        cliprange: float = 0.2,
        cliprange_value: float = 0.2,
        vf_coef: float = 0.1,
        whiten_advantages: bool = True,
        reward_clip: float | None = None,
        reference: nn.Module | None = None,
        rollouts: RolloutSource | None = None,
        reward: RewardFn | None = None,
        records: Sequence[dict[str, Any]] = (),
        pad_id: int = 0,
        seed: int | None = None,
    ) -> None:
        for flag, value, low, high in (
            ("--kl-coef", kl_coef, 0.0, math.inf),
            ("--gamma", gamma, 0.0, 1.0),
            ("--lam", lam, 0.0, 1.0),
            ("--cliprange", cliprange, 1e-12, 1.0),
            ("--cliprange-value", cliprange_value, 1e-12, math.inf),
            ("--vf-coef", vf_coef, 0.0, math.inf),
        ):
            if not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{flag} must be in [{low:g}, {high:g}], got {value}")
        if reward_clip is not None and not reward_clip > 0:
            raise ValueError(f"--reward-clip must be > 0, got {reward_clip}")
        self.kl_coef = kl_coef
        self.gamma = gamma
        self.lam = lam
        self.cliprange = cliprange
        self.cliprange_value = cliprange_value
        self.vf_coef = vf_coef
        self.whiten_advantages = whiten_advantages
        self.reward_clip = reward_clip
        self.reference = reference
        if reference is not None:
            reference.requires_grad_(False).eval()
        self.rollouts = rollouts
        self.reward = reward
        self.records = records
        self.pad_id = pad_id
        self.rollout_factory: Callable[[nn.Module], RolloutSource] | None = None
        """Builds `rollouts` over the policy when the run begins (training/rl_setup.py)."""
        self.seed = seed

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The policy with a critic: a copy of it whose vocabulary head is a value head."""
        assert isinstance(model, CausalLM), "the registry builds CausalLM models"
        critic = attach_value_head(copy.deepcopy(model), seed=self.seed)
        return PolicyAndCritic(model, critic)

    def begin(self, model: nn.Module, step: int) -> None:
        """Build the rollout source over the policy; without a given reference, freeze a copy
        of the starting policy."""
        if self.rollouts is None and self.rollout_factory is not None:
            self.rollouts = self.rollout_factory(_parts(model)[0])
        if self.reference is not None:
            return
        if step > 0:
            raise ValueError(
                f"--stage ppo resumed at step {step}: the reference is the run's starting "
                "policy, which a checkpoint does not hold; start again from the weights"
            )
        self.reference = frozen_copy(_parts(model)[0])

    def count(self, batch: dict[str, torch.Tensor]) -> float:
        """One per micro-batch (the losses are means over its completion tokens)."""
        return 1.0

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Positions fed to the policy."""
        key = "input_ids" if is_rollout_batch(batch) else "prompt_ids"
        return int(batch[key].numel())

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Roll out (for prompts), then PPO's losses on the rollout."""
        if ctx.feed is not None:
            raise ValueError(f"--stage {self.name} runs without tensor/context/expert parallelism")
        policy, critic = _parts(model)
        metrics: dict[str, float] = {}
        if not is_rollout_batch(batch):
            batch, metrics = self.roll_out(policy, critic, batch, ctx)
        ids = batch["input_ids"]
        mask = batch["completion_mask"][:, 1:].float()
        with ctx.autocast():  # through the root: data parallelism's hooks sync the gradients
            logits, values_NS = model(ids)
        logps = token_logps(logits, ids)
        values = values_NS[:, :-1].float()
        old_logps = batch["old_logps"].float()
        old_values = batch["old_values"].float()
        rewards = token_rewards(
            batch["scores"], old_logps, batch["ref_logps"].float(), mask, self.kl_coef,
            self.reward_clip,
        )  # fmt: skip
        advantages, returns = gae(rewards * mask, old_values * mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        terms = ppo_terms(
            logps,
            old_logps,
            advantages.detach(),
            values,
            old_values,
            returns.detach(),
            mask,
            cliprange=self.cliprange,
            cliprange_value=self.cliprange_value,
        )
        loss = terms.policy_loss + self.vf_coef * terms.value_loss
        with torch.no_grad():
            kl = ((old_logps - batch["ref_logps"].float()) * mask).sum(dim=1)
            metrics |= {
                "batches": 1.0,
                "sequences": float(ids.shape[0]),
                "score": float(batch["scores"].double().sum()),
                "score_sq": float((batch["scores"].double() ** 2).sum()),
                "kl": float(kl.sum()),
                "loss/policy": float(terms.policy_loss),
                "loss/value": float(terms.value_loss),
                "policy/clipfrac": terms.policy_clipfrac,
                "value/clipfrac": terms.value_clipfrac,
                "policy/approxkl": terms.approx_kl,
            }
        return ObjectiveOutput(loss, metrics)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Means: score (reward) and KL per sequence, losses and clip fractions per batch."""
        sequences, batches = sums.get("sequences", 0.0), sums.get("batches", 0.0)
        if sequences <= 0 or batches <= 0:
            return {}
        mean = sums["score"] / sequences
        out = {
            "reward": mean,
            "reward_std": math.sqrt(max(sums["score_sq"] / sequences - mean**2, 0.0)),
            "kl": sums["kl"] / sequences,
        }
        for name in ("loss/policy", "loss/value", "policy/clipfrac", "value/clipfrac"):
            out[name] = sums[name] / batches
        out["policy/approxkl"] = sums["policy/approxkl"] / batches
        if sums.get("rollout_seconds", 0.0) > 0:
            out["rollout_tokens_per_s"] = sums["rollout_tokens"] / sums["rollout_seconds"]
        return out

    @torch.no_grad()
    def roll_out(
        self,
        policy: nn.Module,
        critic: nn.Module,
        batch: dict[str, torch.Tensor],
        ctx: ForwardContext,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Prompts -> one completion each, scored, with old/ref log-probabilities and values."""
        check_prompt_batch(batch, self.name)
        if self.rollouts is None or self.reward is None or self.reference is None:
            raise ValueError(
                f"--stage {self.name} on prompts needs a rollout source, a reward function and "
                "a reference (the trainer builds them)"
            )
        prompts = prompt_lists(batch)
        seeds = [int(s) for s in batch["seed"].tolist()]
        was_training = policy.training
        started = time.perf_counter()
        completions = self.rollouts.generate(policy, prompts, seeds, 1)
        seconds = time.perf_counter() - started
        policy.train(was_training)
        records = [self._record(int(i)) for i in batch["prompt_index"].tolist()]
        scores = self.reward(samples_of(prompts, completions, records)).float()
        device = batch["prompt_ids"].device
        rollout = pack_rollouts(prompts, completions, self.pad_id, device)
        ids = rollout["input_ids"]
        with ctx.autocast():
            rollout["old_logps"] = token_logps(policy(ids), ids)
            rollout["ref_logps"] = token_logps(self.reference(ids), ids)
            rollout["old_values"] = critic(ids)[..., 0][:, :-1].float()
        rollout["scores"] = scores.to(device)
        generated = float(sum(len(c.token_ids) for group in completions for c in group))
        return rollout, {"rollout_tokens": generated, "rollout_seconds": seconds}

    def _record(self, index: int) -> dict[str, Any]:
        return self.records[index] if 0 <= index < len(self.records) else {}


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    if not isinstance(model, PolicyAndCritic):
        raise ValueError(
            "--stage ppo trains a PolicyAndCritic (PPOLoss.prepare_model builds it from the policy)"
        )
    return model.policy, model.critic
