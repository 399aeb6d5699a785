"""Training config sections for the model, data, batch and optimizer flags (see `train_config`).

Each field is a flag (`micro_batch_size` -> `--micro-batch-size`); the attribute docstring under
it is the flag's help text. Sections validate themselves when built (ValueError naming the flag).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from training.lr_schedule import MAX_SCHEDULE_LAG


def flag_name(name: str) -> str:
    """The command-line spelling of a field name."""
    return "--" + name.replace("_", "-")


@dataclass
class ModelSection:
    """Which network to train: a registry name, optionally with shape overrides."""

    model: str | None = None
    """Model registry name (`models.registry.list_configs()`), e.g. tiny-llama."""
    num_layers: int | None = None
    """Number of transformer layers (overrides the registry value)."""
    hidden_size: int | None = None
    """Hidden (embedding) size (overrides the registry value)."""
    ffn_hidden_size: int | None = None
    """Feed-forward inner size (overrides the registry value)."""
    num_attention_heads: int | None = None
    """Number of query heads (overrides the registry value)."""
    num_query_groups: int | None = None
    """Number of key/value heads for GQA/MQA (Megatron's --num-query-groups)."""
    max_position_embeddings: int | None = None
    """Longest position the model supports (overrides the registry value)."""
    vocab_size: int | None = None
    """Vocabulary size; default: the registry value, raised to cover the tokenizer's vocabulary."""
    seq_length: int = 128
    """Training sequence length in tokens."""
    init_method_std: float | None = None
    """Standard deviation of the weight initialisation (registry value when unset)."""
    hidden_dropout: float | None = None
    """Dropout on attention and MLP outputs before the residual adds (registry value if unset)."""
    attention_dropout: float | None = None
    """Dropout on the attention probabilities (registry value when unset)."""
    num_experts: int | None = None
    """MoE experts per layer: every MLP becomes a mixture of experts (registry value when unset)."""
    moe_router_topk: int | None = None
    """Experts each token is routed to (MoE models; registry value when unset, else 2)."""
    moe_aux_loss_coeff: float | None = None
    """Weight of the MoE load-balancing loss (registry value when unset, else 0)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the MoE router z-loss (registry value when unset, else 0)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{flag_name(name)} must be positive, got {value}")
        if self.num_query_groups is not None and self.num_query_groups <= 0:
            raise ValueError(f"--num-query-groups must be positive, got {self.num_query_groups}")
        if self.seq_length <= 0:
            raise ValueError(f"--seq-length must be positive, got {self.seq_length}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{flag_name(name)} must be in [0, 1), got {value}")
        for name in ("num_experts", "moe_router_topk"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{flag_name(name)} must be positive, got {value}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{flag_name(name)} must be >= 0, got {value}")

    def overrides(self) -> dict[str, Any]:
        """The shape overrides as `models.config.ModelConfig` field names (unset ones left out)."""
        mapping = {
            "num_layers": "num_layers",
            "hidden_size": "hidden_size",
            "ffn_hidden_size": "ffn_hidden_size",
            "num_attention_heads": "num_attention_heads",
            "num_query_groups": "num_kv_heads",
            "max_position_embeddings": "max_position_embeddings",
            "vocab_size": "vocab_size",
            "init_method_std": "init_std",
            "hidden_dropout": "hidden_dropout",
            "attention_dropout": "attention_dropout",
        }
        return {
            dst: getattr(self, src)
            for src, dst in mapping.items()
            if getattr(self, src) is not None
        }

    def moe_overrides(self) -> dict[str, Any]:
        """The MoE flags that are set, as `models.moe.MoEConfig` field names."""
        mapping = {
            "num_experts": "num_experts",
            "moe_router_topk": "top_k",
            "moe_aux_loss_coeff": "aux_loss_coeff",
            "moe_z_loss_coeff": "z_loss_coeff",
        }
        return {
            dst: getattr(self, src)
            for src, dst in mapping.items()
            if getattr(self, src) is not None
        }


# Megatron-LM's tokenizer type names -> Meshline's.
TOKENIZER_ALIASES = {
    "HuggingFaceTokenizer": "PretrainedFromHF",
    "Llama2Tokenizer": "SentencePiece",
    "GPTSentencePieceTokenizer": "SentencePiece",
}


@dataclass
class DataSection:
    """Where the token shards are and how they are split and batched."""

    data_path: list[str] = field(default_factory=list)
    """Megatron --data-path: prefixes of .bin/.idx shards, optionally weighted: `0.3 a 0.7 b`."""
    split: str = "969,30,1"
    """Train/valid/test proportions of the corpus."""
    train_data_path: list[str] = field(default_factory=list)
    """The training split's own datasets (weighted like --data-path); replaces --split."""
    valid_data_path: list[str] = field(default_factory=list)
    """The validation split's own datasets (with --train-data-path)."""
    test_data_path: list[str] = field(default_factory=list)
    """The test split's own datasets (with --train-data-path)."""
    data_cache_path: str | None = None
    """Directory for the sample-index cache (default: a `cache/` folder beside the data)."""
    data_format: Literal["auto", "mmap", "arrow"] = "auto"
    """Shard format: mmap (.bin/.idx), arrow (IPC shards + manifest) or auto (detect)."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token (pretraining data)."""
    reset_attention_mask: bool = False
    """Stop attention at each end-of-document token (pretraining data)."""
    eod_mask_loss: bool = False
    """No loss on the token predicted from an end-of-document token (the next document's first)."""
    mock_data: bool = False
    """Train on deterministic random tokens instead of --data-path (benchmarks, smoke tests)."""
    is_instruction_dataset: bool = False
    """The shards hold instruction data (prompt tokens carry no loss)."""
    variable_seq_lengths: bool = False
    """Pad each micro-batch to its longest sample instead of --seq-length."""
    pack: bool = False
    """Pack several documents into each sample (attention stays within a document)."""
    tokenizer_type: str | None = None
    """Tokenizer kind: SentencePiece or PretrainedFromHF."""
    tokenizer_model: str | None = None
    """Path of the sentencepiece .model file (SentencePiece tokenizers)."""
    tokenizer_name_or_path: str | None = None
    """Local HF tokenizer directory (PretrainedFromHF tokenizers)."""
    tokenizer_not_use_fast: bool = False
    """Load HF's slow (Python) tokenizer instead of the fast one (PretrainedFromHF)."""

    def __post_init__(self) -> None:
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"--split {self.split!r} must be comma-separated numbers, e.g. 969,30,1"
            ) from None
        if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"--split {self.split!r} needs up to 3 non-negative numbers with a positive sum"
            )
        if (self.valid_data_path or self.test_data_path) and not self.train_data_path:
            raise ValueError(
                "--valid-data-path / --test-data-path need --train-data-path (the per-split form "
                "replaces --data-path + --split)"
            )
        if self.train_data_path and self.data_path:
            raise ValueError(
                "--data-path and --train-data-path are exclusive: give --data-path with --split, "
                "or --train-data-path (and --valid-data-path / --test-data-path)"
            )
        # Megatron-LM's names for the same two kinds.
        if self.tokenizer_type is not None:
            self.tokenizer_type = TOKENIZER_ALIASES.get(self.tokenizer_type, self.tokenizer_type)
        if self.tokenizer_type == "GPT2BPETokenizer":
            raise ValueError(
                "--tokenizer-type GPT2BPETokenizer (--vocab-file/--merge-file) is not supported: "
                "use --tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR"
            )
        if self.tokenizer_type not in (None, "SentencePiece", "PretrainedFromHF"):
            raise ValueError(
                f"--tokenizer-type {self.tokenizer_type!r} is not supported; use SentencePiece or PretrainedFromHF"
            )


@dataclass
class BatchSection:
    """Micro-batch, global batch and batch-size ramp-up."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass on each data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks (default: micro-batch size x data-parallel size)."""
    rampup_batch_size: list[int] | None = None
    """`START INCREMENT SAMPLES`: grow the global batch from START by INCREMENT over SAMPLES samples."""

    def __post_init__(self) -> None:
        if self.micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {self.micro_batch_size}")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"--global-batch-size must be positive, got {self.global_batch_size}")
        if self.rampup_batch_size is not None and (
            len(self.rampup_batch_size) != 3 or min(self.rampup_batch_size) <= 0
        ):
            raise ValueError(
                f"--rampup-batch-size needs three positive integers START INCREMENT SAMPLES, "
                f"got {self.rampup_batch_size}"
            )


@dataclass
class OptimSection:
    """Optimizer, learning-rate schedule and gradient clipping."""

    optimizer: Literal["adam", "adamw", "fused_adam", "cadam", "sgd"] = "adamw"
    """Optimizer (kernels.optim registry); "adam" is Megatron's adam, i.e. decoupled decay (AdamW)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine"
    """Shape of the decay after warmup."""
    lr_warmup_iters: int = 0
    """Iterations of warmup from 0 to --lr."""
    lr_warmup_style: Literal["linear", "log"] = "linear"
    """Warmup curve: linear (Megatron's) or log, lr x log(step + 1) / log(warmup) (DeepSpeed's default)."""
    lr_schedule_lag: int = 0
    """Steps the schedule runs behind the optimizer: step k uses iteration k - lag's rate (DeepSpeed: 1)."""
    lr_warmup_lag: int = 0
    """Steps the warmup alone runs behind, the decay keeping its place (DeepSpeed's WarmupCosineLR: 1)."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."""
    lr_decay_iters: int | None = None
    """Iterations over which the learning rate decays (default: --train-iters)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to norms and biases)."""
    adam_beta1: float = 0.9
    """Adam/Cadam first-moment coefficient."""
    adam_beta2: float = 0.999
    """Adam second-moment coefficient."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    sgd_momentum: float = 0.9
    """Momentum of the sgd optimizer."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""

    def __post_init__(self) -> None:
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError(f"--lr ({self.lr}) and --min-lr ({self.min_lr}) must be >= 0")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if not 0 <= self.lr_warmup_lag <= MAX_SCHEDULE_LAG:
            raise ValueError(
                f"--lr-warmup-lag must be in [0, {MAX_SCHEDULE_LAG}], got {self.lr_warmup_lag}"
            )
        if not 0 <= self.lr_schedule_lag <= MAX_SCHEDULE_LAG:
            raise ValueError(
                f"--lr-schedule-lag must be in [0, {MAX_SCHEDULE_LAG}], got {self.lr_schedule_lag}"
            )
        if self.lr_warmup_fraction is not None:
            if not 0.0 <= self.lr_warmup_fraction <= 1.0:
                raise ValueError(
                    f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}"
                )
            if self.lr_warmup_iters:
                raise ValueError(
                    "--lr-warmup-iters and --lr-warmup-fraction are exclusive; give one"
                )
        if self.lr_decay_iters is not None and self.lr_decay_iters <= 0:
            raise ValueError(f"--lr-decay-iters must be positive, got {self.lr_decay_iters}")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ValueError(
                f"--adam-beta1/--adam-beta2 must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}"
            )
        if self.adam_eps <= 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError("--adam-eps must be > 0, --weight-decay and --clip-grad >= 0")
