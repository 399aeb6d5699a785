"""Settings of the inference gRPC service: which checkpoint to serve and per-request limits."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from checkpoints.registry import SERVE_CHOICES
from engine.config import (
    CPU_LINEAR,
    DECODE_STEPS,
    DEFAULT_BLOCK_SIZE,
    EngineConfig,
    LoadSpec,
    parse_size,
)
from engine.lora_files import ADAPTER_FILES, check_adapter_config, check_adapter_name
from engine.speculative_config import SpeculativeConfig, parse_speculative_config
from services.common.data_roots import (
    DataRootsConfig,
    add_data_root_flag,
    data_roots_from_args,
)
from services.common.dataclass_flags import FlagSpec, add_fields, config_values
from services.common.errors import PermissionDenied

DEFAULT_PORT = 50054
LOAD_FORMATS = SERVE_CHOICES
"""`--load-format` choices: auto and the served formats of checkpoints/registry.py."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_BATCH_WAIT_MS = 1000.0
DEFAULT_MAX_LORA_RANK = 16
"""vLLM's default --max-lora-rank."""


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry: an adapter served from start-up."""

    name: str
    """The name requests pick it by (their `model` field)."""
    path: Path
    """Its peft adapter directory."""
    base_model_name: str | None = None
    """The model it adapts as /v1/models reports it (`parent`); None: the served model."""


def parse_lora_module(text: str) -> LoraModule:
    """A `--lora-modules` value: `name=DIR` or vLLM's JSON `{"name", "path", "base_model_name"}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({exc})") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
        if (
            unknown
            or not isinstance(spec.get("name"), str)
            or not isinstance(spec.get("path"), str)
        ):
            raise ValueError(
                f'--lora-modules {text!r}: give a JSON object with string "name" and "path" '
                f'(and optionally "base_model_name"){f"; unknown keys {unknown}" if unknown else ""}'
            )
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        return LoraModule(spec["name"], Path(spec["path"]), base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules {text!r}: give name=DIR (or vLLM's JSON form "
            '{"name": ..., "path": ...})'
        )
    return LoraModule(name, Path(path))


@dataclass
class InferenceServiceConfig(DataRootsConfig):
    """The model an inference server loads at start-up and the limits it puts on requests."""

    load: Path | None = None
    """Checkpoint directory to serve; without it the server starts with no model (health
    SERVING, model RPCs FAILED_PRECONDITION)."""
    load_format: str = "auto"
    """Layout of --load: auto detects it from the files."""
    tokenizer: Path | None = None
    """Tokenizer directory or sentencepiece .model when the checkpoint holds none."""
    dtype: str = "auto"
    """Compute dtype: auto is the checkpoint's."""
    lora_load: Path | None = None
    """PEFT LoRA adapter directory merged into the weights at load time."""
    tensor_parallel_size: int = 1
    """Split the model over N processes (gloo on CPU, NCCL/HCCL on accelerators); rank 0
    serves gRPC."""
    pipeline_parallel_size: int = 1
    """Split the layers over N processes, one stage each, each stage sharded over
    --tensor-parallel-size processes (tp × pp in all); rank 0 serves gRPC."""
    max_batch_rows: int = 32
    """KV-cache rows decoded together, a beam takes one; the KV-cache budget may allow fewer
    (engine/cache_plan.py says how many)."""
    max_model_len: int | None = None
    """Most tokens per sequence, prompt + new (vLLM's flag; default: the model's context
    length); the KV cache holds rows of this length."""
    kv_cache_memory: int | None = None
    """KV-cache budget in bytes, e.g. 2GiB or 512MiB (vLLM's flag); the cache rows follow from
    it and --max-model-len, at most --max-batch-rows (default: --gpu-memory-utilization on
    accelerators, 512 MiB on CPU)."""
    gpu_memory_utilization: float | None = None
    """Accelerators: share of the device's memory for weights and KV cache, measured after
    loading (vLLM's flag; default 0.9); refused on CPU."""
    batch_wait_ms: float = 1.0
    """A request reaching an idle server waits until no other request has come for this many
    milliseconds (at most 5 times it), so that requests sent together are prefilled and decoded
    in step instead of a step or two apart; 0 admits at once."""
    cpu_linear: str = "auto"
    """CPU linear weights: auto (dense, packed and colmajor timed on the model's shapes at
    start-up, the fastest kept; packed+gemv when fastest and its extra copy takes at most 10% of
    the available memory), dense (as loaded), packed (oneDNN-packed, same memory), packed+gemv
    (packed, plus the dense weights for batch-1 decoding, 2x their memory) or colmajor
    (column-major dense weights, same memory)."""
    compile_decode: bool = False
    """CPU, one process: compile the decode step with torch.compile (fused norms, RoPE,
    residuals; seconds of compiling per new batch shape on the first requests)."""
    decode_step: str = "auto"
    """One-token decode steps: auto (a lean step over the model's own weights, bit-identical to
    the module forward, where it covers the model: RoPE + RMSNorm + SwiGLU decoders without
    sliding windows; else the module forward; on CPU in fp32 a step runs in one C call instead,
    equal to fp32 rounding, where it was built at install and covers the model: fused q|k|v and
    gate|up, no q/k norms; one row, or several with dense weights), lean (the lean step alone,
    bit-identical) or module (always the module forward)."""
    enforce_eager: bool = False
    """CUDA: run decode steps eagerly instead of replaying them from CUDA graphs (by default the
    lean decode step is captured once per active row count and slot bucket, as vLLM does; this
    flag is vLLM's name for turning that off)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}' drafts by prompt lookup, '{"model": DIR,
    "num_speculative_tokens": 4}' by a draft model with the same tokenizer;
    "disable_by_batch_size": N turns it off in steps of N or more rows. Greedy output is
    unchanged, sampled output keeps its distribution; one process only (default: off; see
    engine/speculative.py)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per block of the paged KV cache (vLLM's flag)."""
    enable_prefix_caching: bool | None = None
    """Share the KV blocks of prompt prefixes, and of earlier answers (a chat's next turn),
    between requests computed with the same weights (base model or LoRA adapter) (vLLM's flag;
    default: on wherever the KV cache is paged: one process, no sliding window, no
    --compile-decode, CPU or --enforce-eager)."""
    enable_chunked_prefill: bool | None = None
    """Prefill long prompts in chunks between the decode steps of running requests, within
    --max-num-batched-tokens a step (vLLM's flag; default: on wherever the KV cache is paged)."""
    max_num_batched_tokens: int | None = None
    """Chunked prefill: tokens (decode rows + prompt chunks) one engine step computes at most;
    more than --max-batch-rows (vLLM's flag; default 2048)."""
    max_new_tokens_limit: int = 4096
    """Largest max_new_tokens a request may ask for."""
    max_num_beams: int = 16
    """Largest num_beams / num_return_sequences a request may ask for."""
    max_score_items: int = 1024
    """Most items one Score request may carry."""
    max_stop_strings: int = 16
    """Most stop strings one request may carry."""
    max_stop_string_chars: int = 256
    """Longest stop string in characters."""
    max_text_chars: int = 1_000_000
    """Longest prompt / Tokenize text / Score context or continuation in characters, and most
    ids one Detokenize takes."""
    max_score_tokens: int = 65536
    """Most tokens (contexts + continuations) one Score request may carry in all."""
    max_request_mb: int = 16
    """Largest request message in MiB, refused with RESOURCE_EXHAUSTED past it
    (--max-message-mb still bounds it)."""
    allow_weight_updates: bool = False
    """Accept UpdateWeights: a trainer replacing the served weights with a newer version (needs
    --auth-token-file; one process; --cpu-linear auto then keeps dense weights)."""
    enable_lora: bool = False
    """Serve LoRA adapters beside the base model: a request picks one by its model name;
    authenticated clients load and unload them at run time (vLLM's flag; implied by
    --lora-modules)."""
    lora_modules: list[LoraModule] = field(default_factory=list)
    """LoRA adapters (peft directories) served from start-up, as name=DIR or vLLM's JSON
    {"name": ..., "path": ..., "base_model_name": ...}; implies --enable-lora."""
    max_loras: int | None = None
    """LoRA adapters held at once, each with memory in every adapted layer (vLLM's flag;
    default 1, or the number of --lora-modules)."""
    max_lora_rank: int | None = None
    """Largest LoRA rank served (vLLM's flag; default 16)."""

    def resolve_adapter(self, path: str, field_name: str) -> Path:
        """The adapter directory a run-time load names, resolved under --data-root, whose
        files do not link outside the roots either (PermissionDenied naming `field_name`)."""
        directory = self.resolve(path, field_name)
        for name in ADAPTER_FILES:
            file = directory / name
            if file.exists() and not self.under_roots(file.resolve()):
                raise PermissionDenied(
                    f"{field_name}: {name} of {path!r} links outside the --data-root directories"
                )
        return directory

    @property
    def lora(self) -> bool:
        """Whether this server serves LoRA adapters."""
        return self.enable_lora or bool(self.lora_modules)

    def engine_config(self) -> EngineConfig:
        """The engine these flags shape (every rank of a parallel server builds the same)."""
        return EngineConfig(
            max_batch_rows=self.max_batch_rows,
            max_model_len=self.max_model_len,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            dtype=self.dtype,
            # An update copies into the weights in place; a packed copy would not see it.
            cpu_linear="dense"
            if self.allow_weight_updates and self.cpu_linear == "auto"
            else self.cpu_linear,
            compile_decode=self.compile_decode,
            decode_step=self.decode_step,
            enforce_eager=self.enforce_eager,
            speculative_config=self.speculative_config,
            enable_lora=self.lora,
            max_loras=self.max_loras or max(1, len(self.lora_modules)),
            max_lora_rank=self.max_lora_rank or DEFAULT_MAX_LORA_RANK,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def load_spec(self) -> LoadSpec:
        """The checkpoint to serve (needs --load)."""
        assert self.load is not None
        return LoadSpec(self.load, self.load_format, self.tokenizer, self.lora_load)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine_config()  # ValueError naming the flag, before any weight is read
        if self.load is not None:
            self.load = Path(self.load).resolve()
            if not self.load.is_dir():
                raise ValueError(
                    f"--load {str(self.load)!r} is not an existing checkpoint directory"
                )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.batch_wait_ms <= MAX_BATCH_WAIT_MS:
            raise ValueError(
                f"--batch-wait-ms must be between 0 and {MAX_BATCH_WAIT_MS}, got "
                f"{self.batch_wait_ms} (0 turns the wait off)"
            )
        self._resolve_load_files()
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--max-batch-rows", self.max_batch_rows),
            ("--max-new-tokens-limit", self.max_new_tokens_limit),
            ("--max-num-beams", self.max_num_beams),
            ("--max-score-items", self.max_score_items),
            ("--max-stop-strings", self.max_stop_strings),
            ("--max-stop-string-chars", self.max_stop_string_chars),
            ("--max-text-chars", self.max_text_chars),
            ("--max-score-tokens", self.max_score_tokens),
            ("--max-request-mb", self.max_request_mb),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.allow_weight_updates:
            self._check_weight_updates()
        if self.compile_decode and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "--compile-decode serves from one process; drop it or use "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1"
            )
        # Flags that ask for the paged KV cache, refused by name where the rows stay dense
        # (engine/model_runner.py decides the same at load; these cases need no weight).
        block_size = None if self.block_size == DEFAULT_BLOCK_SIZE else self.block_size
        paging = (
            ("--enable-prefix-caching", self.enable_prefix_caching),
            ("--enable-chunked-prefill", self.enable_chunked_prefill),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--block-size", block_size),
        )
        asked = [flag for flag, value in paging if value is not None and value is not False]
        if asked and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ValueError(
                f"{asked[0]} needs the paged KV cache, which tensor- and pipeline-parallel "
                "serving does not use yet (its rows stay dense); drop one of them"
            )
        parallel = self.tensor_parallel_size * self.pipeline_parallel_size > 1
        if self.speculative_config is not None and parallel:
            raise ValueError(
                "--speculative-config serves from one process; drop it or use "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1"
            )
        self._check_lora()

    def _resolve_load_files(self) -> None:
        """--tokenizer and --lora-load: need --load, resolved, and must exist."""
        if self.tokenizer is not None:
            if self.load is None:
                raise ValueError("--tokenizer is only used with --load; give the checkpoint too")
            self.tokenizer = Path(self.tokenizer).resolve()
            if not self.tokenizer.exists():
                raise ValueError(f"--tokenizer {str(self.tokenizer)!r} does not exist")
        if self.lora_load is not None:
            if self.load is None:
                raise ValueError("--lora-load needs --load (the base checkpoint)")
            self.lora_load = Path(self.lora_load).resolve()
            if not self.lora_load.is_dir():
                raise ValueError(
                    f"--lora-load {str(self.lora_load)!r} is not an existing directory"
                )

    def _check_lora(self) -> None:
        """The LoRA flags, and each --lora-modules directory's adapter_config.json (no weight
        is read): a user error stops the server before the model loads."""
        if not self.lora:
            for flag, value in (
                ("--max-loras", self.max_loras),
                ("--max-lora-rank", self.max_lora_rank),
            ):
                if value is not None:
                    raise ValueError(f"{flag} needs --enable-lora or --lora-modules")
            return
        if self.load is None:
            raise ValueError("--enable-lora / --lora-modules need --load (the base checkpoint)")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "--enable-lora / --lora-modules serve from one process; drop them or use "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1"
            )
        engine = self.engine_config()
        if len(self.lora_modules) > engine.max_loras:
            raise ValueError(
                f"--lora-modules names {len(self.lora_modules)} adapters but --max-loras is "
                f"{engine.max_loras}; raise --max-loras"
            )
        seen: set[str] = set()
        for module in self.lora_modules:
            label = f"--lora-modules {module.name}"
            check_adapter_name(module.name, "--lora-modules")
            if module.name in seen:
                raise ValueError(f"{label}: the name is given twice")
            seen.add(module.name)
            check_adapter_config(module.path.resolve(), engine.max_lora_rank, label)

    def _check_weight_updates(self) -> None:
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "--allow-weight-updates serves from one process; drop it or use "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1"
            )
        if self.cpu_linear in ("packed", "packed+gemv"):
            raise ValueError(
                f"--allow-weight-updates updates the weights in place, and --cpu-linear "
                f"{self.cpu_linear} serves a packed copy of them; use --cpu-linear dense, "
                "colmajor or auto (dense)"
            )


def check_weight_update_auth(config: InferenceServiceConfig, auth_token_file: str | None) -> None:
    """ValueError when weight updates are allowed without authentication: replacing the served
    weights is the most powerful call a server takes, never open to anyone who can reach it."""
    if config.allow_weight_updates and auth_token_file is None:
        raise ValueError(
            "--allow-weight-updates needs --auth-token-file (UpdateWeights replaces the served "
            "model; only a client holding the token may call it)"
        )


def path_or_none(text: str) -> Path | None:
    """A path flag's value; an empty one leaves the setting unset."""
    return Path(text) if text else None


def parse_lora_modules(texts: list[str]) -> list[LoraModule]:
    """The `--lora-modules` values (see `parse_lora_module`)."""
    return [parse_lora_module(text) for text in texts]


FLAGS = (
    "load", "load_format", "tokenizer", "dtype", "lora_load", "enable_lora", "lora_modules",
    "max_loras", "max_lora_rank", "data_roots", "tensor_parallel_size", "pipeline_parallel_size",
    "max_batch_rows", "max_model_len", "kv_cache_memory", "gpu_memory_utilization",
    "batch_wait_ms", "cpu_linear", "compile_decode", "decode_step", "enforce_eager",
    "speculative_config", "block_size", "enable_prefix_caching", "enable_chunked_prefill",
    "max_num_batched_tokens", "max_new_tokens_limit", "max_num_beams", "max_score_items",
    "max_stop_strings", "max_stop_string_chars", "max_text_chars", "max_score_tokens",
    "max_request_mb", "allow_weight_updates",
)  # fmt: skip
"""Every `InferenceServiceConfig` field, in the order of its flag in --help."""
FLAG_SPECS = {
    "load": FlagSpec(metavar="DIR", convert=path_or_none),
    "load_format": FlagSpec(choices=LOAD_FORMATS),
    "tokenizer": FlagSpec(convert=path_or_none),
    "dtype": FlagSpec(choices=DTYPES),
    "lora_load": FlagSpec(metavar="DIR", convert=path_or_none),
    "lora_modules": FlagSpec(metavar="NAME=DIR", convert=parse_lora_modules),
    "kv_cache_memory": FlagSpec(metavar="SIZE", convert=parse_size),
    "cpu_linear": FlagSpec(choices=CPU_LINEAR),
    "decode_step": FlagSpec(choices=DECODE_STEPS),
    "speculative_config": FlagSpec(metavar="JSON", convert=parse_speculative_config),
}
"""What the flags add to the dataclass: placeholders, choices, the parsing of text values."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the inference service's own flags to its `serve` parser: one per config field,
    its type, default and help text from `InferenceServiceConfig`."""
    group = parser.add_argument_group("inference service")
    roots = FLAGS.index("data_roots")  # the flag every job service shares
    add_fields(group, InferenceServiceConfig, FLAGS[:roots], FLAG_SPECS, show_defaults=True)
    add_data_root_flag(group, "adapter directories loaded at run time (load_lora_adapter)")
    add_fields(group, InferenceServiceConfig, FLAGS[roots + 1 :], FLAG_SPECS, show_defaults=True)


def from_args(args: argparse.Namespace) -> InferenceServiceConfig:
    """Builds (and so validates) the config from the flags `add_flags` added."""
    if args.data_roots and not (args.enable_lora or args.lora_modules):
        raise ValueError(
            "--data-root bounds adapter directories loaded at run time; it needs --enable-lora "
            "or --lora-modules"
        )
    values = config_values(args, InferenceServiceConfig, FLAG_SPECS)
    values["data_roots"] = data_roots_from_args(args)
    return InferenceServiceConfig(**values)
