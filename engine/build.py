"""`build_engine(LoadSpec, EngineConfig)`: the one way to build an engine from a checkpoint
(and `build_reward_model`, its counterpart for a reward model, which scores and never generates).

The inference service (one process, and every rank of a tensor/pipeline-parallel server), the
evaluator's in-process model and `meshline generate` all call it, so every `EngineConfig` field
reaches every engine (tests/test_layering.py checks that services build engines only here).
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig, LoadSpec
from engine.engine import Engine
from engine.loading import LoadedModel, load_checkpoint
from engine.parallel_engine import build_parallel_engine
from engine.reward import RewardScorer
from engine.speculative import check_same_vocabulary
from engine.tokens import TokenizerInfo
from models.transformer import CausalLM


def build_engine(
    spec: LoadSpec,
    config: EngineConfig,
    *,
    device: torch.device | str = "cpu",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> tuple[LoadedModel, Engine]:
    """Load `spec` on `device` and wrap it in an engine shaped by `config`.

    With tensor_parallel_size x pipeline_parallel_size > 1 (the default process group joined),
    this rank keeps its stage and shard and gets a `LeaderFollowerEngine`
    (engine/parallel_engine.py). ValueError names the flag at fault.
    """
    if config.enable_lora and tensor_parallel_size * pipeline_parallel_size > 1:
        raise ValueError(
            "--enable-lora / --lora-modules: LoRA adapters are served by one process only; "
            "drop --tensor-parallel-size / --pipeline-parallel-size or the adapters"
        )
    loaded = load_checkpoint(
        spec.path,
        load_format=spec.load_format,
        dtype=config.dtype,
        tokenizer=spec.tokenizer,
        lora=spec.lora,
        device=device,
        # tensor/pipeline parallel engines reshard float weights: a quantized checkpoint is
        # dequantized for them
        quantized_weights=tensor_parallel_size * pipeline_parallel_size == 1,
    )
    tokens = TokenizerInfo.from_tokenizer(loaded.tokenizer, loaded.config.vocab_size)
    if tensor_parallel_size * pipeline_parallel_size > 1:
        if config.speculative_config is not None:
            raise ValueError(
                "--speculative-config serves from one process; drop it or use "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1"
            )
        engine: Engine = build_parallel_engine(
            loaded.model, tokens, config, tp=tensor_parallel_size, pp=pipeline_parallel_size
        )
    else:
        draft = _load_draft(config, tokens, loaded.config.vocab_size, device)
        engine = Engine(loaded.model, tokens, config, draft_model=draft)
    return loaded, engine


def build_reward_model(
    spec: LoadSpec,
    *,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    max_batch_tokens: int = 8192,
) -> tuple[LoadedModel, RewardScorer]:
    """Load the reward model `spec` names (a scalar value head; a causal LM is refused, naming
    --load) on `device` and wrap it in a scorer. Quantized checkpoints hold no value head."""
    if spec.load_format == "quantized":
        raise ValueError(
            "--load-format quantized: a reward model is served from float weights (hf, native "
            "or megatron); the converter writes no quantized reward model"
        )
    loaded = load_checkpoint(
        spec.path,
        load_format=spec.load_format,
        dtype=dtype,
        tokenizer=spec.tokenizer,
        lora=spec.lora,
        device=device,
        quantized_weights=False,
        reward_model=True,
    )
    pad = loaded.tokenizer.pad_id if loaded.tokenizer is not None else None
    scorer = RewardScorer(loaded.model, pad_id=pad or 0, max_batch_tokens=max_batch_tokens)
    return loaded, scorer


def _load_draft(
    config: EngineConfig, tokens: TokenizerInfo, vocab_size: int, device: torch.device | str
) -> CausalLM | None:
    """The draft model --speculative-config names (same dtype and device as the served one),
    refused unless its vocabulary is the served model's."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return None
    where = f"--speculative-config model {str(spec.model)!r}"
    try:
        draft = load_checkpoint(spec.model, dtype=config.dtype, device=device)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    draft_tokens = TokenizerInfo.from_tokenizer(draft.tokenizer, draft.config.vocab_size)
    check_same_vocabulary(tokens, vocab_size, draft_tokens, draft.config.vocab_size, where)
    return draft.model
