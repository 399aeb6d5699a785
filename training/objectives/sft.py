"""`sft`: next-token cross entropy over the unmasked labels (pretraining and instruction tuning).

The labels are the inputs shifted by one (built by the datasets); `loss_mask` zeroes prompt,
padding and (with --eod-mask-loss) end-of-document tokens, label -100 never counts, and packed
samples keep their documents apart through `segment_ids`. Under tensor parallelism the logits are
vocabulary-sharded and the model-parallel feed computes the loss-parallel cross entropy.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kernels.cross_entropy import cross_entropy
from tokendata.datasets.samples import IGNORE_INDEX
from training.objectives.base import ForwardContext, Objective, ObjectiveOutput


def counted_tokens(batch: dict[str, torch.Tensor]) -> float:
    """Loss-mask weight of the tokens whose label counts (what the summed cross entropy covers)."""
    counted = batch["labels"] != IGNORE_INDEX
    return float((batch["loss_mask"] * counted).sum())


class NextTokenLoss(Objective):
    """Summed masked next-token cross entropy, normalised by the counted tokens."""

    name: ClassVar[str] = "sft"
    pipeline_loss: ClassVar[bool] = True

    def count(self, batch: dict[str, torch.Tensor]) -> float:
        """Counted tokens (`counted_tokens`)."""
        return counted_tokens(batch)

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Forward under the run's precision; the loss in fp32 outside it."""
        with ctx.autocast():
            logits_BSV = model(
                batch["input_ids"],
                position_ids_BS=batch.get("position_ids"),
                segment_ids_BS=batch.get("segment_ids"),
            )
        if ctx.feed is not None:
            loss = ctx.feed.loss_sum(logits_BSV, batch)
        else:
            loss = cross_entropy(
                logits_BSV, batch["labels"], loss_mask=batch["loss_mask"], reduction="sum"
            )
        return ObjectiveOutput(loss)
