"""`grpo`: group relative policy optimisation (DeepSeekMath), with trl 1.16's settings and names.

Shapes: P prompts, G generations per prompt (--num-generations), N = P x G sequences, S positions.
Each micro-batch is either finished rollouts or prompts (training/objectives/rollouts.py). For
prompts, the rollout source samples G completions each with the policy's current weights, the
reward function scores them and the advantages are normalised within each prompt's group
(`rl_losses.group_advantages`, trl's scale_rewards). The loss is trl's: the clipped surrogate
with ε / ε_high, plus β times the k3 estimate of KL to a frozen reference (the starting weights),
aggregated as --loss-type says (`rl_losses.aggregate`). One optimisation pass per generation
(trl's num_iterations = 1): the sampling policy's log-probabilities are the current ones,
detached, unless the batch brings `old_logps`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from training.objectives.base import ForwardContext, Objective, ObjectiveOutput
from training.objectives.dpo import frozen_copy
from training.objectives.rl_losses import (
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    STD_EPS,
    aggregate,
    group_advantages,
    grpo_token_terms,
    token_logps,
)
from training.objectives.rollouts import (
    RewardFn,
    RolloutSource,
    check_prompt_batch,
    is_rollout_batch,
    pack_rollouts,
    prompt_lists,
    samples_of,
)

PENDING_KEPT = 256
"""Rollouts kept between `count` and `compute` at most (more micro-batches than one step has)."""


class GRPOLoss(Objective):
    """GRPO's loss, summed as --loss-type says and normalised by its count."""

    name: ClassVar[str] = "grpo"

    def __init__(
        self,
        *,
        num_generations: int = 8,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        max_completion_length: int = 256,
        reference: nn.Module | None = None,
        rollouts: RolloutSource | None = None,
        reward: RewardFn | None = None,
        records: Sequence[dict[str, Any]] = (),
        pad_id: int = 0,
    ) -> None:
        if loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"--loss-type {loss_type!r}: choose one of {list(GRPO_LOSS_TYPES)}")
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"--scale-rewards {scale_rewards!r}: choose one of {list(SCALE_REWARDS)}"
            )
        if num_generations < 2:
            raise ValueError(
                f"--num-generations must be >= 2 (a group of one has no relative advantage), "
                f"got {num_generations}"
            )
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"--beta must be >= 0, got {beta}")
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if not 0 < epsilon < 1 or not epsilon_high > 0:
            raise ValueError(
                f"--epsilon must be in (0, 1) and --epsilon-high > 0, got {epsilon} and "
                f"{epsilon_high}"
            )
        if max_completion_length < 1:
            raise ValueError(f"--max-completion-length must be >= 1, got {max_completion_length}")
        self.num_generations = num_generations
        self.beta = beta
        self.epsilon_low = epsilon
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.max_completion_length = max_completion_length
        self.reference = reference
        if reference is not None:
            reference.requires_grad_(False).eval()
        self.rollouts = rollouts
        self.reward = reward
        self.records = records
        self.pad_id = pad_id
        self.rollout_factory: Callable[[nn.Module], RolloutSource] | None = None
        """Builds `rollouts` over the policy when the run begins (training/rl_setup.py)."""
        self._model: nn.Module | None = None
        # Rollouts of this step's prompt batches, by their samples' seeds (`count` makes them,
        # `compute` uses them once: the loop moves the batch to the device in between), and
        # their generation sums.
        self._pending: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        self._rollout_metrics: dict[tuple[int, ...], dict[str, float]] = {}

    # ------------------------------------------------------------------ counting

    def prepare_step(
        self, model: nn.Module, micro: list[dict[str, torch.Tensor]], ctx: ForwardContext
    ) -> None:
        """Roll out the step's prompt micro-batches before any forward (every completion of a
        step comes from the weights before it, as trl generates them). With --scale-rewards
        batch, the advantages are divided by the standard deviation of the whole step's rewards:
        every micro-batch of every data-parallel rank (trl's gathered generation batch), so the
        loss does not depend on how the step is cut into micro-batches or ranks."""
        del model, ctx
        rollouts = [self._rollout_of(batch) for batch in micro if not is_rollout_batch(batch)]
        if self.scale_rewards != "batch" or not rollouts:
            return
        rewards = torch.cat([r["rewards"].double().cpu() for r in rollouts])
        mean = _global_sum(torch.tensor([rewards.sum().item(), rewards.numel()]))
        count = mean[1].item()
        centre = mean[0].item() / count
        squares = _global_sum(torch.tensor([((rewards - centre) ** 2).sum().item()]))
        std = math.sqrt(squares[0].item() / max(count - 1.0, 1.0))
        for rollout in rollouts:
            deviations = group_advantages(rollout["rewards"], self.num_generations, "none")
            rollout["advantages"] = (deviations / (std + STD_EPS)).float()

    def count(self, batch: dict[str, torch.Tensor]) -> float:
        """What --loss-type normalises by (`rl_losses.aggregate`). For prompts this rolls them
        out (the loop counts every micro-batch of a step before its first forward, so a step's
        completions all come from the weights before it, as trl generates them)."""
        if not is_rollout_batch(batch):
            batch = self._rollout_of(batch)
        rows = batch["input_ids"].shape[0]
        if self.loss_type == "grpo":
            return float(rows)
        if self.loss_type == "bnpo":
            return 1.0
        if self.loss_type == "dr_grpo":
            return float(rows * self.max_completion_length)
        return float(batch["completion_mask"][:, 1:].sum())

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Positions fed (for prompts: each prompt's positions, G times)."""
        if is_rollout_batch(batch):
            return int(batch["input_ids"].numel())
        return int(batch["prompt_ids"].numel() * self.num_generations)

    # ------------------------------------------------------------------ run

    def begin(self, model: nn.Module, step: int) -> None:
        """Keep the policy for rollouts; with β > 0 and no given reference, freeze a copy of the
        starting weights."""
        self._model = model
        if self.rollouts is None and self.rollout_factory is not None:
            self.rollouts = self.rollout_factory(model)
        if self.beta == 0.0 or self.reference is not None:
            return
        if step > 0:
            raise ValueError(
                f"--stage grpo --beta {self.beta} resumed at step {step}: the reference is the "
                "run's starting weights, which a checkpoint does not hold; resume with --beta 0 "
                "(trl's default) or start again from the weights with --finetune"
            )
        self.reference = frozen_copy(model)  # not a deepcopy: `replicate`'s hooks stay behind

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Roll out (for prompts), score the policy's log-probabilities, GRPO's loss."""
        if ctx.feed is not None:
            raise ValueError(f"--stage {self.name} runs without tensor/context/expert parallelism")
        metrics: dict[str, float] = {}
        if not is_rollout_batch(batch):
            key = _batch_key(batch)
            device = next(model.parameters()).device  # made on the host by `count`
            batch = {k: v.to(device) for k, v in self._rollout_of(batch, model).items()}
            metrics = self._rollout_metrics.pop(key, {})
            self._pending.pop(key, None)
        ids, mask = batch["input_ids"], batch["completion_mask"]
        mask_NT = mask[:, 1:]
        with ctx.autocast():
            logits = model(ids)
        logps = token_logps(logits, ids)
        old = batch.get("old_logps")
        old_logps = logps.detach() if old is None else old.float()
        ref_logps = None
        if self.beta != 0.0:
            ref_logps = self._reference_logps(batch, ctx)
        terms = grpo_token_terms(
            logps,
            old_logps,
            batch["advantages"],
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            ref_logps_NT=ref_logps,
        )
        loss_sum, _ = aggregate(terms.loss, mask_NT, self.loss_type, self.max_completion_length)
        weight = mask_NT.float()
        metrics |= {
            "sequences": float(ids.shape[0]),
            "completion_tokens": float(weight.sum()),
            "clip_ratio/low": float((terms.low_clipped * weight).sum()),
            "clip_ratio/high": float((terms.high_clipped * weight).sum()),
            "clip_ratio/region": float(((terms.low_clipped | terms.high_clipped) * weight).sum()),
        }
        if terms.kl is not None:
            metrics["kl"] = float((terms.kl * weight).sum())
        if "rewards" in batch:
            rewards = batch["rewards"].double()
            metrics["reward"] = float(rewards.sum())
            metrics["reward_sq"] = float((rewards**2).sum())
        return ObjectiveOutput(loss_sum, metrics)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """trl's logged means: reward and reward_std per sequence, kl and clip ratios per
        completion token, completion length per sequence, rollout tokens/s."""
        sequences = sums.get("sequences", 0.0)
        tokens = sums.get("completion_tokens", 0.0)
        if sequences <= 0:
            return {}
        out: dict[str, float] = {}
        if "reward" in sums:
            mean = sums["reward"] / sequences
            out["reward"] = mean
            out["reward_std"] = math.sqrt(max(sums["reward_sq"] / sequences - mean**2, 0.0))
        if "kl" in sums:
            out["kl"] = sums["kl"] / max(tokens, 1.0)
        for name in ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region"):
            out[name] = sums[name] / max(tokens, 1.0)
        out["completion_length"] = tokens / sequences
        if sums.get("rollout_seconds", 0.0) > 0:
            out["rollout_tokens_per_s"] = sums["rollout_tokens"] / sums["rollout_seconds"]
        return out

    # ------------------------------------------------------------------ rollouts

    def _rollout_of(
        self, batch: dict[str, torch.Tensor], model: nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        key = _batch_key(batch)
        if key in self._pending:
            return self._pending[key]
        model = model if model is not None else self._model
        if model is None:
            raise ValueError(f"--stage {self.name}: prompts before the objective began (no policy)")
        rollout, sums = self.roll_out(model, batch)
        while len(self._pending) >= PENDING_KEPT:  # evaluation counts after its forward
            oldest = next(iter(self._pending))
            self._pending.pop(oldest)
            self._rollout_metrics.pop(oldest, None)
        self._pending[key] = rollout
        self._rollout_metrics[key] = sums
        return rollout

    @torch.no_grad()
    def roll_out(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Prompts -> a rollout batch (completions, rewards, advantages) and the rollout's sums."""
        check_prompt_batch(batch, self.name)
        if self.rollouts is None or self.reward is None:
            raise ValueError(
                f"--stage {self.name} on prompts needs a rollout source and a reward function "
                "(the trainer builds both: --reward-funcs and the colocated engine)"
            )
        prompts = prompt_lists(batch)
        seeds = [int(s) for s in batch["seed"].tolist()]
        was_training = model.training
        started = time.perf_counter()
        completions = self.rollouts.generate(model, prompts, seeds, self.num_generations)
        seconds = time.perf_counter() - started
        model.train(was_training)
        records = [self._record(int(i)) for i in batch["prompt_index"].tolist()]
        rewards = self.reward(samples_of(prompts, completions, records)).float()
        device = batch["prompt_ids"].device
        rollout = pack_rollouts(prompts, completions, self.pad_id, device)
        rollout["rewards"] = rewards.to(device)
        rollout["advantages"] = group_advantages(
            rewards, self.num_generations, self.scale_rewards
        ).to(device)
        generated = float(sum(len(c.token_ids) for group in completions for c in group))
        return rollout, {"rollout_tokens": generated, "rollout_seconds": seconds}

    def _record(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.records):
            return {}
        return self.records[index]

    @torch.no_grad()
    def _reference_logps(self, batch: dict[str, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        if self.reference is None:
            raise ValueError(
                f"--stage {self.name} --beta {self.beta} needs a reference model (the starting "
                "weights) or precomputed ref_logps in the rollouts"
            )
        with ctx.autocast():
            logits = self.reference(batch["input_ids"])
        return token_logps(logits, batch["input_ids"])


def _batch_key(batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """A prompt batch's identity: its samples' seeds (unique per sample of the run)."""
    return tuple(int(s) for s in batch["seed"].tolist())


def _global_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` (float64) summed over the job's ranks. Online RL runs in one process or under
    data parallelism alone (rl_layout refuses every other layout), so the world is the
    data-parallel group."""
    values = values.double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values
