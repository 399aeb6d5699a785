"""`dpo`: direct preference optimisation of a policy against a frozen reference.

Shapes: B pairs, S sequence, V vocab. The policy scores chosen and rejected in one forward
(`pairs.concatenated`); the reference's log-probabilities come from the batch when precomputed
(`ref_chosen_logps` / `ref_rejected_logps`) and otherwise from a frozen reference run under
no_grad: the model given as `reference`, or one read from `--ref-model DIR` (`reference.py`), or
for a LoRA policy the policy itself with its adapters disabled (trl's choice under peft: no second
copy of the base), or else a copy of the weights the run starts from. The loss is
`preference_losses.dpo_loss`; the logged sums are trl's quantities (divide by `pairs` for trl's
means).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from models.config import ModelConfig
from models.lora import LoraLinear, adapters_disabled
from training.objectives.base import ForwardContext, ObjectiveOutput
from training.objectives.pairs import (
    check_pairwise,
    concatenated,
    sequence_logps,
)
from training.objectives.preference import PairwiseObjective, reward_metrics
from training.objectives.preference_losses import DPO_LOSS_TYPES, dpo_loss


class DPOLoss(PairwiseObjective):
    """Summed per-pair DPO loss, normalised by the pair count."""

    name: ClassVar[str] = "dpo"

    def __init__(
        self,
        *,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference: nn.Module | None = None,
        reference_loader: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"--dpo-loss-type {loss_type!r}: choose one of {list(DPO_LOSS_TYPES)}")
        if not beta > 0:
            raise ValueError(f"--dpo-beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"--dpo-label-smoothing must be in [0, 0.5), got {label_smoothing}")
        if label_smoothing and loss_type not in ("sigmoid", "robust"):
            raise ValueError(
                f"--dpo-label-smoothing {label_smoothing} has no effect on --dpo-loss-type "
                f"{loss_type}; use sigmoid or robust, or leave it at 0"
            )
        self.beta = beta
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.reference = reference
        if reference is not None:
            reference.requires_grad_(False).eval()
        # Reads the reference (--ref-model) given the policy; called once, in `begin`.
        self.reference_loader = reference_loader
        self._policy_as_reference: nn.Module | None = None

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Policy forward under the run's precision; reference under no_grad; loss in fp32."""
        check_pairwise(batch, self.name)
        if ctx.feed is not None:  # vocabulary-sharded logits: log-probs would need a gather
            raise ValueError(f"--stage {self.name} runs without tensor/context/expert parallelism")
        ids = concatenated(batch, "input_ids")
        mask = concatenated(batch, "loss_mask")
        with ctx.autocast():
            logits = model(ids)
        chosen_logps, rejected_logps = sequence_logps(logits, ids, mask).chunk(2)
        ref_chosen, ref_rejected = self._reference_logps(batch, ids, mask, ctx)
        tokens = mask[:, 1:].sum(dim=1).to(chosen_logps.dtype)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        terms = dpo_loss(
            chosen_logps,
            rejected_logps,
            ref_chosen,
            ref_rejected,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            chosen_tokens=chosen_tokens,
            rejected_tokens=rejected_tokens,
        )
        metrics = reward_metrics(terms, chosen_logps, rejected_logps)
        return ObjectiveOutput(terms.losses.sum(), metrics)

    def begin(self, model: nn.Module, step: int) -> None:
        """Set up the reference: --ref-model's, else the LoRA policy's base, else a frozen copy
        of the starting weights (which a resumed run no longer has: refused)."""
        if self.reference is not None:
            return
        if self.reference_loader is not None:
            self.reference = self.reference_loader(model)
            return
        if any(isinstance(m, LoraLinear) for m in model.modules()):
            self._policy_as_reference = model  # the frozen base weights are the reference
            return
        if step > 0:
            raise ValueError(
                f"--stage dpo resumed at step {step}: the reference is the run's starting weights, "
                "which a checkpoint does not hold; pass them as --ref-model DIR (e.g. the SFT "
                "checkpoint the run started from) to resume"
            )
        self.reference = frozen_copy(model)

    @torch.no_grad()
    def _reference_logps(
        self,
        batch: dict[str, torch.Tensor],
        ids: torch.Tensor,
        mask: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
            return batch["ref_chosen_logps"].float(), batch["ref_rejected_logps"].float()
        reference, disabled = self.reference, contextlib.nullcontext()
        if reference is None and self._policy_as_reference is not None:
            reference = self._policy_as_reference
            disabled = adapters_disabled(reference)
        if reference is None:
            raise ValueError(
                "--stage dpo needs a reference: a reference model (the starting weights or "
                "--ref-model DIR) or precomputed ref_chosen_logps/ref_rejected_logps in the data"
            )
        with ctx.autocast(), disabled:
            logits = reference(ids)
        ref_chosen, ref_rejected = sequence_logps(logits, ids, mask).chunk(2)
        return ref_chosen, ref_rejected


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, unwrapped copy of `model`'s current weights (a registry `CausalLM`, possibly under
    data-parallel `replicate`, whose hooks must not be copied): built anew, loaded from
    the state dict, with the same attention kernels."""
    from models import build_model

    config = model.config
    assert isinstance(config, ModelConfig), "the registry builds CausalLM models"
    first = next(model.parameters())
    copy = build_model(config, device="meta").to(dtype=first.dtype)
    copy.to_empty(device=first.device)
    copy.init_weights(seed=0)  # ties the head where the config does; the load overwrites all
    copy.load_state_dict(
        {name: value.detach() for name, value in model.state_dict().items()}, strict=True
    )
    backends = {
        name: module.attention_backend
        for name, module in model.named_modules()
        if hasattr(module, "attention_backend")
    }
    for name, module in copy.named_modules():
        if name in backends:
            module.attention_backend = backends[name]
    return copy.requires_grad_(False).eval()
