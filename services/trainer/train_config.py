"""The trainer service's configuration: the training library's sections plus Megatron's
architecture flags, composed into `TrainConfig`.

Field names are Megatron/ModelLink destination names, so `--micro-batch-size` is
`config.batch.micro_batch_size`; `services.trainer.arguments` derives every flag from these fields
(type, default and help text — the attribute docstring under each field) in one place. The
library's sections live in `training.config_sections` (model, data, batch, optim),
`training.run_sections` (precision, run, parallel) and `training.finetune` (peft), composed by
`training.config.TrainingConfig`; `arch` (`model_arch.ArchSection`) is the service's own. Sections
validate themselves when built; `TrainConfig.validate(world_size)` checks what needs the whole
picture (batch divisibility against the data-parallel size).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from models.config import ModelConfig
from models.registry import get_config
from training.config import (
    AutotuneSection,
    BatchSection,
    DataSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    PeftSection,
    PrecisionSection,
    RLSection,
    RunSection,
    TrainingConfig,
)
from training.model_arch import ArchSection, check_against_model, megatron_fields
from training.model_config import DEFAULT_MODEL, check_known_model, finish_model_config

__all__ = [
    "SECTIONS",
    "ArchSection",
    "BatchSection",
    "DataSection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "PeftSection",
    "PrecisionSection",
    "RunSection",
    "TrainConfig",
]

SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "arch": ArchSection,
    "data": DataSection,
    "batch": BatchSection,
    "optim": OptimSection,
    "precision": PrecisionSection,
    "run": RunSection,
    "parallel": ParallelSection,
    "peft": PeftSection,
    "rl": RLSection,
    "autotune": AutotuneSection,
}


@dataclass
class TrainConfig(TrainingConfig):
    """Everything one training run needs; built by `services.trainer.arguments.parse_args`."""

    arch: ArchSection = field(default_factory=ArchSection)
    """Megatron's architecture flags (a model without --model)."""

    def model_config(self, tokenizer_vocab: int | None = None) -> ModelConfig:
        """`models` config for --model or Megatron's architecture flags, covering the tokenizer.

        With --model, the registry config plus the shape flags; an architecture flag that
        contradicts the registry value is an error naming both. Without it, Megatron's defaults
        plus the flags (`training.model_arch`), the vocabulary being the tokenizer's
        padded up to --make-vocab-size-divisible-by.
        """
        name = self.model.model or DEFAULT_MODEL
        overrides = self.model.overrides()
        arch = self.arch
        if self.model.model is not None:
            check_known_model(name)
            check_against_model(name, get_config(name), arch.fields_set())
        else:
            overrides = megatron_fields(arch, self.model, tokenizer_vocab)
        model_config = get_config(name, **overrides)
        if arch.kv_channels is not None and arch.kv_channels != model_config.head_dim:
            raise ValueError(
                f"--kv-channels {arch.kv_channels} differs from --hidden-size / "
                f"--num-attention-heads = {model_config.head_dim}; these models' head width is "
                "that ratio: drop --kv-channels or change the sizes"
            )
        return finish_model_config(
            self,
            name,
            overrides,
            tokenizer_vocab,
            vocab_multiple=arch.make_vocab_size_divisible_by,
            model_config=model_config,
        )

    def attention_backend(self) -> str | None:
        """--attention-backend's `kernels.attention` name (None: the device's default)."""
        return self.arch.kernel_backend()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe nested dict (the form `--config` files use), sections in `SECTIONS` order."""
        flat = asdict(self)
        return {name: flat[name] for name in SECTIONS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from `to_dict()` output; unknown keys raise ValueError naming them."""
        unknown = set(data) - set(SECTIONS)
        if unknown:
            raise ValueError(
                f"unknown config sections {sorted(unknown)}; known: {sorted(SECTIONS)}"
            )
        built = {}
        for name, section_cls in SECTIONS.items():
            values = dict(data.get(name) or {})
            known = {f.name for f in fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ValueError(f"unknown keys {sorted(bad)} in config section {name!r}")
            built[name] = section_cls(**values)
        return cls(**built)
