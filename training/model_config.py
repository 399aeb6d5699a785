"""The `models` config a training run builds: a registry model, the shape flags, the tokenizer.

`registry_model_config` is the library's whole path (--model NAME plus shape and MoE flags); a
front end with its own architecture flags (the trainer service's Megatron flags) picks the base
fields itself and finishes with `finish_model_config`, so the vocabulary padding, the MoE flags
and the sequence-length check are one code path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from kernels.attention import ATTENTION
from models.config import ModelConfig
from models.moe_config import MoEConfig
from models.registry import get_config, list_configs
from models.transformer import Attention

if TYPE_CHECKING:  # the config calls this module: a runtime import would be a cycle
    from training.config import TrainingConfig

DEFAULT_MODEL = "tiny-llama"
DEFAULT_VOCAB_MULTIPLE = 128
"""Megatron's --make-vocab-size-divisible-by default."""


def check_known_model(name: str) -> None:
    """ValueError naming --model when `name` is not in the registry."""
    if name not in list_configs():
        raise ValueError(f"--model {name!r} is unknown; known models: {', '.join(list_configs())}")


def pad_vocab(vocab: int, multiple: int, tensor_parallel: int = 1) -> int:
    """Megatron's padded vocabulary: `vocab` rounded up to `multiple x tensor_parallel`."""
    step = multiple * tensor_parallel
    return -(-vocab // step) * step


def registry_model_config(
    config: TrainingConfig, tokenizer_vocab: int | None = None
) -> ModelConfig:
    """--model NAME (default tiny-llama) from the registry with the shape and MoE flags."""
    name = config.model.model or DEFAULT_MODEL
    if config.model.model is not None:
        check_known_model(name)
    overrides = config.model.overrides()
    return finish_model_config(
        config, name, overrides, tokenizer_vocab, vocab_multiple=DEFAULT_VOCAB_MULTIPLE
    )


def finish_model_config(
    config: TrainingConfig,
    name: str,
    overrides: dict[str, Any],
    tokenizer_vocab: int | None,
    *,
    vocab_multiple: int,
    model_config: ModelConfig | None = None,
) -> ModelConfig:
    """`get_config(name, **overrides)` (or the given `model_config` built from them) covering the
    tokenizer's vocabulary (padded up to `vocab_multiple`), with the MoE flags, checked against
    --seq-length."""
    if model_config is None:
        model_config = get_config(name, **overrides)
    if tokenizer_vocab is not None and model_config.vocab_size < tokenizer_vocab:
        if config.model.vocab_size is not None:
            raise ValueError(
                f"--vocab-size {config.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({tokenizer_vocab}); drop --vocab-size or raise it"
            )
        padded = pad_vocab(tokenizer_vocab, vocab_multiple)
        model_config = get_config(name, **{**overrides, "vocab_size": padded})
    moe = config.model.moe_overrides()
    if moe:
        base = model_config.moe.to_dict() if model_config.moe is not None else {}
        merged = {**base, **moe}
        if "num_experts" not in merged:
            raise ValueError(
                f"--model {name} has no experts: {', '.join('--' + k for k in _moe_flags(config))} "
                "need --num-experts (or an MoE model such as tiny-mixtral)"
            )
        # MoEConfig validates (ValueError naming the flag).
        model_config = model_config.replace(moe=MoEConfig(**merged))
    if model_config.max_position_embeddings < config.model.seq_length:
        raise ValueError(
            f"--seq-length {config.model.seq_length} exceeds the model's --max-position-embeddings "
            f"{model_config.max_position_embeddings}; shorten one or raise the other"
        )
    return model_config


def _moe_flags(config: TrainingConfig) -> list[str]:
    names = ("num_experts", "moe_router_topk", "moe_aux_loss_coeff", "moe_z_loss_coeff")
    return [n.replace("_", "-") for n in names if getattr(config.model, n) is not None]


def apply_attention_backend(model: nn.Module, backend: str | None) -> int:
    """Point every attention layer of `model` at `backend` (None: the device's default).

    Returns how many layers were set. The name is checked against the registered backends so a
    typo fails before the first step.
    """
    if backend is None:
        return 0
    if backend not in ATTENTION.candidates():
        raise ValueError(
            f"--attention-backend {backend}: this device has no such attention kernel; choose "
            f"one of {ATTENTION.candidates()} (or drop the flag for the device's default)"
        )
    count = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_backend = backend
            count += 1
    return count
