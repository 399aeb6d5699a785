"""Preference losses as small functions of per-pair scores, in their papers' notation.

Every function takes one value per pair (shape [P], P pairs) and returns the per-pair loss [P];
the objectives sum it (the loop normalises by the step's pair count). The names follow trl's
`DPOTrainer` and `RewardTrainer` so that a number logged by Meshline means what it means there:
π_θ is the policy, π_ref the frozen reference, y_w the chosen and y_l the rejected response,
log π(y|x) the summed log-probability of the response tokens given the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
"""The DPO losses (trl's `loss_type` names; MindSpeed-LLM's --dpo-loss-type has the first three)."""

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust")
"""Every `DPOLossType`, for choices and checks."""


@dataclass(frozen=True)
class PairTerms:
    """A preference loss per pair and the implicit rewards trl logs."""

    losses: torch.Tensor
    """Per-pair loss [P] (backward runs through it)."""
    chosen_rewards: torch.Tensor
    """The chosen response's implicit reward, detached [P] (trl's `rewards/chosen`): DPO's
    β (log π_θ(y_w|x) − log π_ref(y_w|x)), SimPO's β log π_θ(y_w|x) / |y_w|."""
    rejected_rewards: torch.Tensor
    """The same for the rejected response (trl's `rewards/rejected`)."""


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> PairTerms:
    """DPO (Rafailov et al. 2023) and the variants trl names by `loss_type`.

    With h = log π_θ(y_w|x)/π_ref(y_w|x) − log π_θ(y_l|x)/π_ref(y_l|x):
      sigmoid: −(1−ε) log σ(βh) − ε log σ(−βh)  (ε = label_smoothing: conservative DPO; ε = 0 is
               the paper's loss and trl 1.16's `sigmoid`)
      hinge:   max(0, 1 − βh)  (SLiC)
      ipo:     (h̄ − 1/(2β))², h̄ with each log-ratio averaged over its response tokens
               (Azar et al. 2023, eq. 17, length-normalised as trl does; needs the token counts)
      robust:  (−(1−ε) log σ(βh) + ε log σ(−βh)) / (1 − 2ε)  (Chowdhury et al. 2024)
    """
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    rejected_logratios = policy_rejected_logps - reference_rejected_logps
    h = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss: loss_type 'ipo' needs chosen_tokens and rejected_tokens")
        h_mean = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / (
            rejected_tokens.clamp(min=1)
        )
        losses = (h_mean - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (
            1 - 2 * eps
        )
    else:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}; known: {DPO_LOSS_TYPES}")
    return PairTerms(
        losses=losses,
        chosen_rewards=beta * chosen_logratios.detach(),
        rejected_rewards=beta * rejected_logratios.detach(),
    )


def simpo_loss(
    policy_chosen_avg_logps: torch.Tensor,
    policy_rejected_avg_logps: torch.Tensor,
    *,
    beta: float,
    gamma: float,
) -> PairTerms:
    """SimPO (Meng et al. 2024), reference-free: −log σ(β/|y_w| log π_θ(y_w|x) −
    β/|y_l| log π_θ(y_l|x) − γ), the log-probabilities averaged over each response's tokens
    (trl's CPOTrainer with loss_type="simpo", cpo_alpha=0)."""
    h = policy_chosen_avg_logps - policy_rejected_avg_logps
    return PairTerms(
        losses=-F.logsigmoid(beta * h - gamma),
        chosen_rewards=beta * policy_chosen_avg_logps.detach(),
        rejected_rewards=beta * policy_rejected_avg_logps.detach(),
    )


def reward_pair_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """The reward model's pairwise (Bradley-Terry) loss −log σ(r(x,y_w) − r(x,y_l) − m) per pair,
    m an optional margin (Llama 2's; trl's `margin` column)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards - margin)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0, without the cancellation of either form alone (branch at
    −ln 2, Mächler 2012)."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def orpo_odds_ratio(
    policy_chosen_avg_logps: torch.Tensor,
    policy_rejected_avg_logps: torch.Tensor,
    *,
    beta: float,
) -> tuple[PairTerms, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4 and 7; trl's `odds_ratio_loss`).

    With p = exp(avg log π_θ(y|x)) and odds(y) = p / (1 − p), the per-pair loss is
    −β log σ(log odds(y_w) − log odds(y_l)); the objective adds the chosen responses' NLL.
    Returns the terms (rewards β × the averaged log-probabilities, as trl logs them), log σ(·)
    and the log odds ratio, per pair (trl's `log_odds_ratio` and `log_odds_chosen`)."""
    chosen, rejected = policy_chosen_avg_logps.float(), policy_rejected_avg_logps.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    terms = PairTerms(
        losses=-beta * ratio,
        chosen_rewards=beta * chosen.detach(),
        rejected_rewards=beta * rejected.detach(),
    )
    return terms, ratio.detach(), log_odds.detach()
