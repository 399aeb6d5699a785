"""What the preference objectives share: pair counting, tokens, logged means, and the one forward.

Shapes: B pairs, S sequence, C packed channels. Every preference objective runs the model once
on the concatenated pair ([2B,S], chosen rows first) and scores its output (`score`). Under
pipeline parallelism the schedule runs that forward stage by stage and the last stage scores
it: `pipeline_inputs` packs a step's micro-batches as the schedule's input and target, micro-batch
after micro-batch, so the schedule's split along the rows keeps each pair's chosen and rejected
halves in the same micro-batch, and `pipeline_score` unpacks a micro-batch's target there.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from training.objectives.base import ForwardContext, Objective, ObjectiveOutput
from training.objectives.pairs import SIDES, check_pairwise, concatenated
from training.objectives.preference_losses import PairTerms

PAIRS_METRIC = "pairs"
"""The metric sum every preference objective logs: pairs scored (the divisor of the means)."""

REWARD_METRICS = (
    PAIRS_METRIC,
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""The sums `reward_metrics` returns."""

TOKEN_CHANNELS = ("input_ids", "loss_mask", "attention_mask")
"""Per-token fields of a side, packed as the first channels of the pipeline target."""
PAIR_FIELDS = ("margin", "ref_chosen_logps", "ref_rejected_logps")
"""Optional per-pair fields ([B]), packed as further channels (constant along the sequence)."""


class PairwiseObjective(Objective):
    """An objective over preference pairs (training/objectives/pairs.py's batch)."""

    pipeline_scored: ClassVar[bool] = True
    metric_names: ClassVar[tuple[str, ...]] = REWARD_METRICS
    _packed: tuple[str, ...] = ()
    """The optional per-pair fields the last `pipeline_inputs` packed, in channel order."""

    def count(self, batch: dict[str, torch.Tensor]) -> float:
        """Pairs in the micro-batch."""
        return float(batch["chosen_input_ids"].shape[0])

    def tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Both sides' token positions."""
        return int(batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel())

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Means per pair, as trl logs them (accuracies as a fraction)."""
        pairs = sums.get(PAIRS_METRIC, 0.0)
        if pairs <= 0:
            return {}
        return {name: value / pairs for name, value in sums.items() if name != PAIRS_METRIC}

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """One forward of both sides under the run's precision, then `score`."""
        check_pairwise(batch, self.name)
        with ctx.autocast():
            output = pair_forward(model, concatenated(batch, "input_ids"), ctx)
        return self.score(output, batch, ctx)

    @abstractmethod
    def score(
        self, output: torch.Tensor, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """The loss sum and metrics of the model's `output` on the concatenated pair ([2B,S,V]
        logits, vocabulary-sharded under tensor parallelism, or [2B,S,1] scores)."""

    def pipeline_inputs(
        self, micro: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids [n·2B,S], target [n·2B,S,C] float64) of a step's n micro-batches."""
        for batch in micro:
            check_pairwise(batch, self.name)
        extras = [key for key in PAIR_FIELDS if key in micro[0]]
        ids, targets = [], []
        for batch in micro:
            channels = [concatenated(batch, key).double() for key in TOKEN_CHANNELS]
            seq = channels[0].shape[1]
            for key in extras:
                if key == "margin":
                    rows = torch.cat([batch[key], batch[key]])
                else:  # each side's reference log-probability on its own rows
                    rows = torch.cat(
                        [batch[key], torch.zeros_like(batch[key])]
                        if key == "ref_chosen_logps"
                        else [torch.zeros_like(batch[key]), batch[key]]
                    )
                channels.append(rows.double()[:, None].expand(-1, seq))
            ids.append(concatenated(batch, "input_ids"))
            targets.append(torch.stack(channels, dim=-1))
        self._packed = tuple(extras)
        return torch.cat(ids), torch.cat(targets)

    def pipeline_score(
        self, output: torch.Tensor, target: torch.Tensor, ctx: ForwardContext
    ) -> ObjectiveOutput:
        """`score` of one micro-batch at the last pipeline stage, from its packed target."""
        pairs = target.shape[0] // 2
        batch: dict[str, torch.Tensor] = {}
        for index, key in enumerate(TOKEN_CHANNELS):
            for side, rows in zip(SIDES, (target[:pairs], target[pairs:]), strict=True):
                batch[f"{side}_{key}"] = rows[..., index].long()
        for index, key in enumerate(self._packed, start=len(TOKEN_CHANNELS)):
            column = target[:, 0, index]
            rows = column[pairs:] if key == "ref_rejected_logps" else column[:pairs]
            batch[key] = rows.float()
        return self.score(output, batch, ctx)


def pair_forward(model: nn.Module, ids_BS: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """`model`'s output on the concatenated pair; model-parallel ranks are given the positions
    (under sequence parallelism a rank embeds only its sequence shard, whose own positions
    would start at 0)."""
    if ctx.feed is None:
        return model(ids_BS)
    positions_BS = torch.arange(ids_BS.shape[1], device=ids_BS.device).expand_as(ids_BS)
    return model(ids_BS, position_ids_BS=positions_BS)


def reward_metrics(
    terms: PairTerms, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor
) -> dict[str, float]:
    """trl's logged quantities of a policy-preference loss, as sums (with `pairs`)."""
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    return {
        PAIRS_METRIC: float(chosen.shape[0]),
        "rewards/chosen": float(chosen.sum()),
        "rewards/rejected": float(rejected.sum()),
        "rewards/accuracies": float((chosen > rejected).sum()),
        "rewards/margins": float((chosen - rejected).sum()),
        "logps/chosen": float(chosen_logps.detach().sum()),
        "logps/rejected": float(rejected_logps.detach().sum()),
    }
