"""The online-RL losses as small functions of log-probabilities (trl's GRPO and PPO notation).

Shapes: N sequences (prompts x generations), T token positions of a sequence's prediction
targets (its length - 1: position t scores token t + 1), G generations per prompt. `mask_NT`
is 1 on completion tokens. Every function works in fp32 and returns per-token or per-sequence
terms; how they are summed and normalised (trl's `loss_type`) is `aggregate`'s concern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""trl's names for how GRPO's per-token losses become one number (GRPOConfig.loss_type)."""
SCALE_REWARDS = ("group", "batch", "none")
"""trl's names for what a reward's deviation from its group mean is divided by."""
STD_EPS = 1e-4
"""Added to the standard deviation before dividing (trl's constant)."""


def token_logps(logits_NSV: torch.Tensor, ids_NS: torch.Tensor) -> torch.Tensor:
    """Log-probability [N, S-1] of each token after the first, from the logits before it (fp32)."""
    logps_NTV = torch.log_softmax(logits_NSV[:, :-1].float(), dim=-1)
    return logps_NTV.gather(-1, ids_NS[:, 1:, None]).squeeze(-1)


def group_advantages(
    rewards_N: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> torch.Tensor:
    """GRPO's advantages [N]: each reward minus its group's mean, divided by the group's (or the
    batch's) unbiased standard deviation + 1e-4 unless `scale_rewards` is "none".

    Rows are grouped in order: rows [g*G, (g+1)*G) are one prompt's generations."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"--scale-rewards {scale_rewards!r}: choose one of {list(SCALE_REWARDS)}")
    rewards = rewards_N.float()
    if rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of --num-generations "
            f"{num_generations}"
        )
    grouped_PG = rewards.view(-1, num_generations)
    mean_N = grouped_PG.mean(dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean_N
    if scale_rewards == "none":
        return advantages
    if scale_rewards == "group":
        std_N = grouped_PG.std(dim=1).repeat_interleave(num_generations)
    else:
        std_N = rewards.std().expand_as(rewards)
    return advantages / (std_N + STD_EPS)


@dataclass(frozen=True)
class GRPOTerms:
    """GRPO's per-token quantities [N, T] (before masking)."""

    loss: torch.Tensor
    """The clipped surrogate's negative, plus β times the KL estimate."""
    ratio: torch.Tensor
    """π/π_old per token."""
    kl: torch.Tensor | None
    """k3 estimate of KL(π || π_ref) per token (None when β = 0)."""
    low_clipped: torch.Tensor
    """Tokens whose ratio fell below 1 - ε with a negative advantage (bool)."""
    high_clipped: torch.Tensor
    """Tokens whose ratio rose above 1 + ε_high with a positive advantage (bool)."""


def grpo_token_terms(
    logps_NT: torch.Tensor,
    old_logps_NT: torch.Tensor,
    advantages_N: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    ref_logps_NT: torch.Tensor | None = None,
) -> GRPOTerms:
    """-min(r A, clip(r, 1-ε, 1+ε_high) A) + β (exp(ref - logp) - (ref - logp) - 1) per token."""
    advantages_N1 = advantages_N.float()[:, None]
    ratio = torch.exp(logps_NT - old_logps_NT)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages_N1, clipped * advantages_N1)
    kl = None
    if beta != 0.0:
        if ref_logps_NT is None:
            raise ValueError("GRPO with β != 0 needs reference log-probabilities")
        delta = ref_logps_NT - logps_NT
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    ratio = ratio.detach()
    return GRPOTerms(
        loss=loss,
        ratio=ratio,
        kl=None if kl is None else kl.detach(),
        low_clipped=(ratio < 1 - epsilon_low) & (advantages_N1 < 0),
        high_clipped=(ratio > 1 + epsilon_high) & (advantages_N1 > 0),
    )


def aggregate(
    loss_NT: torch.Tensor, mask_NT: torch.Tensor, loss_type: str, max_completion_length: int
) -> tuple[torch.Tensor, float]:
    """(summed loss, count) of one micro-batch: the step's loss is Σ sums / Σ counts.

    - grpo: each sequence's mean over its tokens, summed; count the sequences (trl: the mean of
      per-sequence means per micro-batch, averaged over equal micro-batches).
    - bnpo: the micro-batch's token mean; count 1 (trl: averaged over the micro-batches).
    - dr_grpo: the token sum; count sequences x max_completion_length.
    - dapo: the token sum; count the tokens (of the whole step: trl's num_items_in_batch).
    """
    mask = mask_NT.to(loss_NT.dtype)
    masked = loss_NT * mask
    if loss_type == "grpo":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum(), float(loss_NT.shape[0])
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), 1.0
    if loss_type == "dr_grpo":
        return masked.sum(), float(loss_NT.shape[0] * max_completion_length)
    if loss_type == "dapo":
        return masked.sum(), float(mask.sum())
    raise ValueError(f"--loss-type {loss_type!r}: choose one of {list(GRPO_LOSS_TYPES)}")


def gae(
    rewards_NT: torch.Tensor, values_NT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: (advantages, returns) [N, T], a value of 0 after the end.

    δ_t = r_t + γ V_{t+1} - V_t, A_t = δ_t + γλ A_{t+1}, returns = A + V (trl's PPO and
    DeepSpeed-Chat's `get_advantages_and_returns`); positions after a sequence's end must carry
    zero rewards and values."""
    steps = rewards_NT.shape[1]
    advantages = torch.zeros_like(rewards_NT)
    running = torch.zeros_like(rewards_NT[:, 0])
    for t in reversed(range(steps)):
        next_value = values_NT[:, t + 1] if t + 1 < steps else torch.zeros_like(running)
        delta = rewards_NT[:, t] + gamma * next_value - values_NT[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values_NT


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked positions, the variance unbiased (trl's);
    without `shift_mean` the mean is added back."""
    mean = masked_mean(x, mask)
    centred = x - mean
    count = mask.to(x.dtype).sum()
    var = masked_mean(centred**2, mask) * count / (count - 1).clamp(min=1.0)
    whitened = centred * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


@dataclass(frozen=True)
class PPOTerms:
    """PPO's losses of one micro-batch (masked means) and what it logs."""

    policy_loss: torch.Tensor
    """max(-A r, -A clip(r, 1 ± ε)) averaged over the completion tokens."""
    value_loss: torch.Tensor
    """½ max((V - R)², (clip(V, V_old ± ε_v) - R)²) averaged over the completion tokens."""
    policy_clipfrac: float
    """Share of tokens where the clipped policy term was the larger."""
    value_clipfrac: float
    """Share of tokens where the clipped value term was the larger."""
    approx_kl: float
    """½ mean (log π - log π_old)² (trl's approxkl)."""


def ppo_terms(
    logps_NT: torch.Tensor,
    old_logps_NT: torch.Tensor,
    advantages_NT: torch.Tensor,
    values_NT: torch.Tensor,
    old_values_NT: torch.Tensor,
    returns_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    *,
    cliprange: float,
    cliprange_value: float,
    value_mask_NT: torch.Tensor | None = None,
) -> PPOTerms:
    """The clipped policy and value losses of trl's PPOTrainer (and DeepSpeed-Chat's step 3);
    the value loss averages over `value_mask_NT` (default: `mask_NT`)."""
    value_mask = mask_NT if value_mask_NT is None else value_mask_NT
    ratio = torch.exp(logps_NT - old_logps_NT)
    policy_unclipped = -advantages_NT * ratio
    policy_clipped = -advantages_NT * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    policy_loss = masked_mean(torch.max(policy_unclipped, policy_clipped), mask_NT)
    values_clipped = torch.clamp(
        values_NT, old_values_NT - cliprange_value, old_values_NT + cliprange_value
    )
    value_unclipped = (values_NT - returns_NT) ** 2
    value_clipped = (values_clipped - returns_NT) ** 2
    value_loss = 0.5 * masked_mean(torch.max(value_unclipped, value_clipped), value_mask)
    with torch.no_grad():
        log_ratio = logps_NT - old_logps_NT
        return PPOTerms(
            policy_loss=policy_loss,
            value_loss=value_loss,
            policy_clipfrac=float(
                masked_mean((policy_clipped > policy_unclipped).float(), mask_NT)
            ),
            value_clipfrac=float(
                masked_mean((value_clipped > value_unclipped).float(), value_mask)
            ),
            approx_kl=float(0.5 * masked_mean(log_ratio**2, mask_NT)),
        )
