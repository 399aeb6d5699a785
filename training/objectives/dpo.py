"""`dpo`: direct preference optimisation of a policy against a frozen reference.

Shapes: B pairs, S sequence, V vocab. The policy scores chosen and rejected in one forward
(`pairs.concatenated`); the reference's log-probabilities come from the batch when precomputed
(`ref_chosen_logps` / `ref_rejected_logps`) and otherwise from a frozen reference run under
no_grad: the model given as `reference`, or one read from `--ref-model DIR` (`reference.py`), or
for a LoRA policy the policy itself with its adapters disabled (trl's choice under peft: no second
copy of the base), or else a copy of the weights the run starts from. When this rank holds only
shards of the policy (tensor or pipeline parallelism, ZeRO-2/3) the starting or `--ref-model`
weights are kept as such shards and swapped into the policy to score (`swapped_reference.py`).
The reference scores a step's micro-batches before any policy forward of the step
(`prepare_step`, which the loop calls; `compute` calls it for a lone batch). The loss is
`preference_losses.dpo_loss`; the logged sums are trl's quantities (divide by `pairs` for trl's
means).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models import build_model
from models.config import ModelConfig
from models.lora import LoraLinear, adapters_disabled
from training.objectives.base import ForwardContext, ObjectiveOutput
from training.objectives.pairs import (
    check_pairwise,
    concatenated,
    sequence_logps,
)
from training.objectives.preference import PairwiseObjective, pair_forward, reward_metrics
from training.objectives.preference_losses import DPO_LOSS_TYPES, dpo_loss
from training.objectives.swapped_reference import SwappedReference

if TYPE_CHECKING:
    from training.objectives.swapped_reference import SwappedReference


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
        self._swapped: SwappedReference | None = None

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """Reference log-probabilities first (`prepare_step`, unless the loop or the data gave
        them), then the policy's forward and `score`."""
        batch = dict(batch)  # the caller's batch is left as given
        self.prepare_step(model, [batch], ctx)
        return super().compute(model, batch, ctx)

    def score(
        self, output: torch.Tensor, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        """The DPO loss in fp32 from the policy's logits and the batch's reference log-probs."""
        ids = concatenated(batch, "input_ids")
        mask = concatenated(batch, "loss_mask")
        chosen_logps, rejected_logps = sequence_logps(output, ids, mask).chunk(2)
        tokens = mask[:, 1:].sum(dim=1).to(chosen_logps.dtype)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        terms = dpo_loss(
            chosen_logps,
            rejected_logps,
            batch["ref_chosen_logps"].float(),
            batch["ref_rejected_logps"].float(),
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            chosen_tokens=chosen_tokens,
            rejected_tokens=rejected_tokens,
        )
        metrics = reward_metrics(terms, chosen_logps, rejected_logps)
        return ObjectiveOutput(terms.losses.sum(), metrics)

    def begin(self, model: nn.Module, step: int) -> None:
        """Set up the reference: --ref-model's, else the LoRA policy's base, else the starting
        weights (which a resumed run no longer has: refused). A policy whose ranks hold shards
        (TP, PP, ZeRO-2/3) keeps the reference as shards swapped in to score
        (`swapped_reference`); otherwise it is a whole frozen model."""
        if self.reference is not None:
            return
        sharded = _sharded(model)
        if self.reference_loader is not None:
            reference = self.reference_loader(model)
            if not sharded:
                self.reference = reference
                return

            self._swapped = SwappedReference.from_state(model, reference.state_dict())
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
        if sharded:
            self._swapped = SwappedReference.snapshot(model)
            return
        self.reference = frozen_copy(model)

    def prepare_step(
        self, model: nn.Module, micro: list[dict[str, torch.Tensor]], ctx: ForwardContext
    ) -> None:
        """Add the reference's log-probabilities (`ref_chosen_logps` / `ref_rejected_logps`) to
        the micro-batches that lack them, before any policy forward of the step (a pipeline rank
        without the last stage adds zeros: only the last stage scores)."""
        missing = []
        for batch in micro:
            check_pairwise(batch, self.name)
            if "ref_chosen_logps" not in batch or "ref_rejected_logps" not in batch:
                missing.append(batch)
        if not missing:
            return
        with self._reference_forward(model, ctx) as forward:
            for batch in missing:
                ids = concatenated(batch, "input_ids")
                mask = concatenated(batch, "loss_mask")
                with ctx.autocast():
                    output = forward(ids.to(_device(model)))
                if output is None:
                    logps = torch.zeros(ids.shape[0])
                else:
                    logps = sequence_logps(output, ids.to(output.device), mask.to(output.device))
                # Kept beside the batch's other tensors (the loop moves them all together).
                logps = logps.detach().to(ids.device)
                batch["ref_chosen_logps"], batch["ref_rejected_logps"] = logps.chunk(2)

    @contextlib.contextmanager
    def _reference_forward(
        self, model: nn.Module, ctx: ForwardContext
    ) -> Iterator[Callable[[torch.Tensor], torch.Tensor | None]]:
        """A function from input ids to the reference's output (None on a pipeline rank without
        the last stage), valid inside the block."""

        def policy(ids: torch.Tensor) -> torch.Tensor | None:
            if ctx.pipeline is None:
                return pair_forward(model, ids, ctx)
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            return ctx.pipeline.output(ids, positions)

        with torch.no_grad():
            if self.reference is not None:
                yield self.reference
            elif self._policy_as_reference is not None:
                with adapters_disabled(self._policy_as_reference):
                    yield policy
            elif self._swapped is not None:
                with self._swapped.swapped():
                    yield policy
            else:
                raise ValueError(
                    "--stage dpo needs a reference: a reference model (the starting weights or "
                    "--ref-model DIR) or precomputed ref_chosen_logps/ref_rejected_logps in the "
                    "data"
                )


def _sharded(model: nn.Module) -> bool:
    """Whether this rank holds shards of the policy (pipeline stages or DTensor parameters)."""
    if getattr(model, "runner", None) is not None:
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, unwrapped copy of `model`'s current weights (a registry `CausalLM`, possibly under
    data-parallel `replicate`, whose hooks must not be copied): built anew, loaded from
    the state dict, with the same attention kernels."""
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
