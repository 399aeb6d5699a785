"""Parity gate: run the source and the converted model on a fixed batch and compare logits.

Both models run in float32 on CPU, so the difference measures only what the conversion changed
in the weights (a lower `--dtype` rounds them). Tolerances (largest absolute logit difference):
1e-4 for float32 outputs (conversions only move bytes, so a correct one gives exactly 0) and
2e-2 for float16 / bfloat16 outputs, unless `--verify-tolerance` says otherwise. Each side is
materialised as a whole model, so verifying needs memory for two float32 copies.

Verification is on by default (`verify=None`, "auto"): every conversion whose two float32 copies
fit in half the memory available runs it and fails on drift; one that does not fit is published
with the report saying why it was not verified (`verify_skipped`). `--verify` forces it (a
conversion that cannot hold both copies then fails for lack of memory), `--no-verify` skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from checkpoints.units import Source, Tensors, units
from models import build_model
from models.config import ModelConfig
from models.transformer import CausalLM

PROMPT_SHAPE = (2, 16)
PROMPT_SEED = 1234


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where the kernel does not say)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def skip_reason(num_parameters: int, available: int | None) -> str | None:
    """Why an automatic check cannot run (None: it can): two float32 copies must fit in half
    of the available memory."""
    needed = 2 * 4 * num_parameters
    if available is not None and needed > available // 2:
        return (
            f"not verified: two float32 copies need {needed / 2**30:.1f} GiB, more than half of "
            f"the {available / 2**30:.1f} GiB available; pass --verify to force it"
        )
    return None


def default_tolerance(dtype: torch.dtype) -> float:
    """The documented tolerance for an output saved in `dtype`."""
    return 1e-4 if dtype == torch.float32 else 2e-2


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of the parity check."""

    max_abs_logit_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        """Whether the difference is within tolerance."""
        return self.max_abs_logit_diff <= self.tolerance


class ModelAssembler:
    """Collects units into a float32 CausalLM (for the parity check)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.model = build_model(config, device="meta")  # MoE layers included
        self.model.to_empty(device="cpu")
        self.model.tie_weights()
        self._loaded: set[str] = set()

    def add(self, tensors: Tensors) -> None:
        """Copies one unit's tensors into the model."""
        params = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor.to(torch.float32))
                self._loaded.add(name)

    def build(self) -> CausalLM:
        """The assembled model in eval mode; raises if a parameter was never loaded."""
        missing = set(self.model.state_dict()) - self._loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"parity check: parameters never loaded: {sorted(missing)[:5]}")
        return self.model.eval()


def load_model(source: Source) -> CausalLM:
    """The whole checkpoint `source` as a float32 CausalLM."""
    assembler = ModelAssembler(source.config)
    for unit in units(source.config):
        assembler.add(source.read_unit(unit))
    return assembler.build()


@torch.no_grad()
def fixed_logits(model: CausalLM) -> torch.Tensor:
    """Logits of the fixed prompt (seeded token ids, B=2, S=16)."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, PROMPT_SHAPE, generator=generator)
    return model(ids).float()


def compare(reference: torch.Tensor, model: CausalLM, tolerance: float) -> VerifyReport:
    """The parity report of `model` against `reference` logits."""
    logits = fixed_logits(model)
    diff = (
        (logits - reference).abs().max().item() if logits.shape == reference.shape else float("inf")
    )
    if diff != diff:  # NaN logits never pass
        diff = float("inf")
    return VerifyReport(max_abs_logit_diff=float(diff), tolerance=tolerance)
