"""What an inference server holds when `--load` is a reward model: the model, its scorer and the
thread running it.

A reward model (a scalar value head: `meshline train --stage rm`, or a HF
`...ForSequenceClassification` with one label) scores and never generates, so it gets no
generation engine: the flags that shape one (KV cache, decode path, LoRA slots, speculation,
weight updates, model parallelism) are refused by name when `--load` holds a reward model, before
any weight is read. What applies: --load-format, --tokenizer, --dtype, --lora-load (merged at
load), --max-model-len (the longest input), --max-score-items and --max-score-tokens (per
request), --max-text-chars.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

from engine.build import build_reward_model
from engine.engine_thread import EngineThread
from engine.loading import LoadedModel, is_reward_checkpoint
from engine.quantized_model import parameter_count
from engine.reward import RewardScorer
from engine.tokens import TokenizerInfo
from engine.validation import RewardLimits
from kernels import device as devices
from services.inference.config import InferenceServiceConfig

T = TypeVar("T")
GENERATION_FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "max_batch_rows": "--max-batch-rows",
    "kv_cache_memory": "--kv-cache-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "batch_wait_ms": "--batch-wait-ms",
    "cpu_linear": "--cpu-linear",
    "compile_decode": "--compile-decode",
    "decode_step": "--decode-step",
    "enforce_eager": "--enforce-eager",
    "speculative_config": "--speculative-config",
    "block_size": "--block-size",
    "enable_prefix_caching": "--enable-prefix-caching",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_new_tokens_limit": "--max-new-tokens-limit",
    "max_num_beams": "--max-num-beams",
    "max_stop_strings": "--max-stop-strings",
    "max_stop_string_chars": "--max-stop-string-chars",
    "allow_weight_updates": "--allow-weight-updates",
    "enable_lora": "--enable-lora",
    "lora_modules": "--lora-modules",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
}
"""InferenceServiceConfig fields that shape generation only, with their flags."""


def serves_reward_model(config: InferenceServiceConfig) -> bool:
    """Whether `--load` holds a reward model (read from its config file; no weight is read).

    A format without a JSON config (Megatron) is read as a causal LM: the loader then refuses a
    value head there with its own message."""
    return config.load is not None and is_reward_checkpoint(config.load, config.load_format)


def check_reward_flags(config: InferenceServiceConfig) -> None:
    """ValueError naming the first generation-only flag set for a reward model."""
    default = InferenceServiceConfig()
    for f in fields(InferenceServiceConfig):
        flag = GENERATION_FLAGS.get(f.name)
        if flag is not None and getattr(config, f.name) != getattr(default, f.name):
            raise ValueError(
                f"{flag}: --load {config.load} is a reward model, which scores (Reward RPC, "
                f"POST /pooling) and never generates; {flag} shapes generation only, drop it"
            )


class RewardFront:
    """Runs calls on the model's thread from the event loop (AsyncEngine's `run`/`close`)."""

    def __init__(self, worker: EngineThread) -> None:
        self._worker = worker

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the model's thread."""
        return await asyncio.wrap_future(self._worker.call(fn))

    async def close(self) -> None:
        """Stop the model's thread."""
        await asyncio.to_thread(self._worker.stop, 10.0)


@dataclass
class ServingRewardModel:
    """A loaded reward model, its scorer and the thread that loaded it and runs every score."""

    loaded: LoadedModel
    scorer: RewardScorer
    tokens: TokenizerInfo
    max_seq_len: int
    """Longest input in tokens: --max-model-len, else the model's context length."""
    worker: EngineThread

    @property
    def front(self) -> RewardFront:
        """The event loop's way to run calls on the model's thread."""
        return RewardFront(self.worker)

    @property
    def dtype_name(self) -> str:
        """Compute dtype as the proto spells it."""
        return str(next(self.loaded.model.parameters()).dtype).removeprefix("torch.")

    def num_parameters(self) -> int:
        """Parameters of the model (a quantized layer counts its out x in weights)."""
        return parameter_count(self.loaded.model)

    def limits(self, config: InferenceServiceConfig) -> RewardLimits:
        """The bounds one request meets."""
        return RewardLimits(
            max_inputs=config.max_score_items,
            max_tokens=config.max_score_tokens,
            max_model_len=self.max_seq_len,
            vocab_size=self.tokens.vocab_size,
        )

    def stop(self, grace_s: float) -> None:
        """Server on_stop hook: stop the model's thread."""
        self.worker.stop(grace_s)


def build_serving_reward_model(config: InferenceServiceConfig) -> ServingRewardModel:
    """Load the reward model `config.load` names on this process's device (ValueError naming the
    flag at fault, generation-only flags before any weight is read)."""
    assert config.load is not None
    check_reward_flags(config)
    worker = EngineThread(name="reward")
    device = devices.current().torch_device()

    def load() -> tuple[LoadedModel, RewardScorer]:
        # Forwards of at most 8192 tokens each, as Score's (a request may hold more).
        return build_reward_model(config.load_spec(), dtype=config.dtype, device=device)

    try:
        loaded, scorer = worker.call(load).result()
    except BaseException:
        worker.stop()
        raise
    context = loaded.config.max_position_embeddings
    limit = config.max_model_len
    if limit is not None and limit > context:
        worker.stop()
        raise ValueError(
            f"--max-model-len {limit} exceeds the reward model's context length {context}"
        )
    tokens = TokenizerInfo.from_tokenizer(loaded.tokenizer, loaded.config.vocab_size)
    return ServingRewardModel(loaded, scorer, tokens, limit or context, worker)
