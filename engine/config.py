"""What shapes one engine: capacity, memory budget, weight layout and decode path.

Every caller builds an engine from a checkpoint through `engine.build.build_engine(LoadSpec,
EngineConfig)`; the services derive these fields from their flags (flag names in the
docstrings), so an error names the flag as `meshline serve inference` spells it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from engine.speculative_config import SpeculativeConfig

CPU_LINEAR = ("auto", "dense", "packed", "packed+gemv", "colmajor")
DECODE_STEPS = ("auto", "lean", "module")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20
"""The KV-cache budget on CPU when neither --kv-cache-memory nor a fraction is given: small
enough that serving a 135M-parameter model stays under 2 GB of RSS (tested); one 4k-token row
of Llama-3-8B in bfloat16 (128 KiB a token). Raise it with --kv-cache-memory."""
MAX_LORAS = 256
"""Most adapter slots (--max-loras): each takes memory in every adapted layer."""
MAX_LORA_RANK = 512
"""Largest --max-lora-rank."""
DEFAULT_BLOCK_SIZE = 16
"""Token slots per block of the paged KV cache (vLLM's default)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""Prompt and decode tokens one engine step computes at most under chunked prefill (vLLM's
default for online serving)."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of an accelerator's memory for weights, activations and KV cache."""
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, flag: str = "--kv-cache-memory") -> int:
    """Bytes of "2GiB", "512MiB", "1.5GB", "4096" (decimal and binary suffixes, any case)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{flag} {text!r}: give a size in bytes with an optional suffix, e.g. 2GiB, 512MiB, "
            "1.5GB or 4096"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1 or value > 2**60:
        raise ValueError(f"{flag} {text!r}: must be between 1 byte and 1 EiB")
    return int(value)


def format_size(n: float) -> str:
    """1.5 GiB, 377.0 MiB, 12.0 KiB, 100 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine besides the checkpoint it serves."""

    max_batch_rows: int = 32
    """Most KV-cache rows: sequences (a beam counts one each) decoded together (--max-batch-rows,
    vLLM's --max-num-seqs); the memory budget may allow fewer."""
    max_model_len: int | None = None
    """Tokens per sequence, prompt + new (--max-model-len); None: the model's context length."""
    kv_cache_memory: int | None = None
    """KV-cache budget in bytes (--kv-cache-memory); None: a fraction of the accelerator's
    memory (gpu_memory_utilization), or DEFAULT_CPU_KV_CACHE_MEMORY on CPU."""
    gpu_memory_utilization: float | None = None
    """Accelerators: share of the device's total memory this server may use, weights included,
    measured after loading (--gpu-memory-utilization, vLLM's); None: 0.9. Refused on CPU."""
    dtype: str = "auto"
    """Compute dtype (--dtype): auto (the checkpoint's), float32, bfloat16 or float16."""
    cpu_linear: str = "auto"
    """CPU linear weights: "auto" times dense, packed and column-major on the model's own shapes
    at start-up and keeps the fastest, or packed+gemv when that is fastest and its second copy
    of the weights takes at most 10% of the available memory (engine/linear_choice.py); "dense"
    as loaded; "packed" repacked once for oneDNN (faster decode and prefill, same memory, the
    model becomes inference-only, see kernels/packed_linear.py);
    "packed+gemv" also keeps the dense weights for one-row calls and the C decode step (twice
    the linear weights' memory); "colmajor" stores the dense weights column-major instead (same
    memory, MKL's faster path for few-row inputs). A head tied to the embedding stays dense."""
    compile_decode: bool = False
    """CPU: capture the one-token decode forward with torch.compile (inductor's C++ backend),
    which fuses each layer's norms, RoPE, residual adds and activation into a few kernels; the
    linear layers and the KV-cache write + attention run as they are. The first decode steps
    at a new batch shape compile (seconds each, a few shapes in all); prefill stays eager."""
    decode_step: str = "auto"
    """"auto": one-token decode steps run `engine.decode_step.DecodeStep` (the module forward's
    computation, bit-identical, without per-module dispatch) when it covers the model, else the
    module forward; on CPU in fp32, a step runs in one C call instead
    (`engine.native_step.NativeStep`, equal to fp32 rounding; one row, or several with dense
    weights) where it was built and covers the model; "lean": DecodeStep alone; "module":
    always the module forward (`model(...)`)."""
    enforce_eager: bool = False
    """CUDA: run every decode step eagerly. By default the lean decode step is replayed from
    CUDA graphs, one per active row count and slot bucket (engine/cuda_graphs.py)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (--speculative-config, engine/speculative.py): prompt-lookup or
    draft-model drafts verified in one forward; None: one token per row per step."""
    enable_lora: bool = False
    """Serve LoRA adapters beside the base model (--enable-lora, implied by --lora-modules):
    every decoder-layer projection gets `max_loras` adapter slots (models/lora_batched.py) and a
    request picks one by name; a step with an adapter row runs the module forward."""
    max_loras: int = 1
    """Adapters held at once (--max-loras, vLLM's name; also the most in one batch)."""
    max_lora_rank: int = 16
    """Largest rank of a served adapter (--max-lora-rank, vLLM's name); sizes the slots."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Token slots per KV-cache block of the paged cache (--block-size, vLLM's)."""
    enable_prefix_caching: bool | None = None
    """Share the KV blocks of prompt prefixes, and of earlier answers, between requests of the
    same weights (--enable-prefix-caching /
    --no-enable-prefix-caching, vLLM's); None: on wherever the KV cache is paged
    (engine/model_runner.py says where it is not). True where the cache cannot be paged is
    refused."""
    enable_chunked_prefill: bool | None = None
    """Prefill long prompts in chunks within a per-step token budget, between the decode steps
    of running requests (--enable-chunked-prefill / --no-enable-chunked-prefill); None: on
    wherever the KV cache is paged. True where it cannot be paged is refused."""
    max_num_batched_tokens: int | None = None
    """Tokens (decode rows + prompt chunks) one step computes at most under chunked prefill
    (--max-num-batched-tokens); None: DEFAULT_MAX_NUM_BATCHED_TOKENS. Refused with chunked
    prefill off."""

    def __post_init__(self) -> None:
        if self.max_batch_rows < 1:
            raise ValueError(f"--max-batch-rows must be >= 1, got {self.max_batch_rows}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        util = self.gpu_memory_utilization
        if util is not None and not (math.isfinite(util) and 0 < util <= 1):
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
        if util is not None and self.kv_cache_memory is not None:
            raise ValueError(
                "give one of --kv-cache-memory (bytes) and --gpu-memory-utilization (a share "
                "of the device), not both"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cpu_linear not in CPU_LINEAR:
            raise ValueError(f"--cpu-linear must be one of {CPU_LINEAR}, got {self.cpu_linear!r}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"--block-size must be in 1..1024 tokens, got {self.block_size}")
        budget = self.max_num_batched_tokens
        if budget is not None and self.enable_chunked_prefill is False:
            raise ValueError(
                "--max-num-batched-tokens is the chunked-prefill budget; leave it out with "
                "--no-enable-chunked-prefill"
            )
        if budget is not None and budget <= self.max_batch_rows:
            raise ValueError(
                f"--max-num-batched-tokens {budget} must exceed --max-batch-rows "
                f"{self.max_batch_rows} (every decode row takes one token of it, and a prompt "
                "chunk at least one more)"
            )
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(
                f"--decode-step must be one of {DECODE_STEPS}, got {self.decode_step!r}"
            )
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"--max-loras must be in [1, {MAX_LORAS}], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"--max-lora-rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}"
            )
        if self.enable_lora and self.compile_decode:
            raise ValueError(
                "--compile-decode does not apply LoRA adapters; drop it or --enable-lora"
            )


@dataclass(frozen=True)
class LoadSpec:
    """Which checkpoint to serve and how to read it (torch-free, so the CLIs import it cheaply)."""

    path: Path
    """Checkpoint directory (--load)."""
    load_format: str = "auto"
    """Layout of `path` (--load-format): auto (detect), hf, native or megatron."""
    tokenizer: Path | None = None
    """Tokenizer directory or sentencepiece .model when the checkpoint holds none (--tokenizer)."""
    lora: Path | None = None
    """PEFT LoRA adapter merged into the weights at load time (--lora-load)."""
