"""What a conversion is asked to do (`ConvertOptions`), how it reports (`Progress`), what it
returns (`ConvertReport`) and how it can end early."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from checkpoints.hf_format import DEFAULT_MAX_SHARD_BYTES
from checkpoints.native_format import PPO_MODELS
from checkpoints.registry import (
    GGUF_TYPES,
    QUANTIZE_CHOICES,
    QUANTIZE_METHODS,
    READ_FORMATS,
    WRITE_FORMATS,
    get_format,
)
from checkpoints.units import DTYPES
from kernels.gptq import DEFAULT_PERCDAMP
from services.converter.verify import VerifyReport

FORMATS = WRITE_FORMATS
"""Checkpoint formats written (`--save-format` choices; checkpoints/registry.py); each is read
too."""
LOAD_FORMATS = READ_FORMATS
"""Checkpoint formats read (`--load-format` choices; checkpoints/registry.py): DeepSpeed ZeRO and
FSDP state dicts of HF models are read only."""
STAGES = ("load", "merge_lora", "reshard", "save", "verify")
"""Progress stages, in order."""
DEFAULT_CALIBRATION_SAMPLES = 64
"""--calibration-samples when none is given."""
DEFAULT_CALIBRATION_SEQ_LEN = 512
"""--calibration-seq-len when none is given."""
MAX_CALIBRATION_SAMPLES = 4096
"""Largest --calibration-samples."""
MAX_CALIBRATION_SEQ_LEN = 32768
"""Largest --calibration-seq-len (the model's context bounds it further)."""
MAX_CALIBRATION_TOKENS = 1 << 20
"""Largest samples × length: the calibration hidden states (tokens × hidden × 4 bytes, twice
while a layer runs) stay in memory, 8 GiB for a 4096-wide model at this bound."""


class VerificationFailed(Exception):
    """The converted checkpoint's logits differ from the source's beyond the tolerance."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(
            f"parity check failed: max |logit difference| {report.max_abs_logit_diff:.3g} > "
            f"tolerance {report.tolerance:.3g}; the output was not written"
        )
        self.report = report


class ConversionCancelled(Exception):
    """The conversion stopped because cancellation was requested (no output was written)."""


@dataclass
class ConvertOptions:
    """What to convert, where to, and how (the `meshline convert` flags)."""

    load_format: str
    """Format of the source checkpoint, one of LOAD_FORMATS (the command's default with
    ModelLink's flags: hf, or megatron for a --lora-load merge): deepspeed is a ZeRO-1/2/3
    checkpoint, consolidated to fp32 like zero_to_fp32.py; fsdp an FSDP SHARDED_STATE_DICT DCP
    directory or FULL_STATE_DICT file of an HF model; gguf a llama.cpp .gguf file of the llama
    architecture, dequantized, tokenizer and chat template from its metadata."""
    save_format: str
    """Format to write, one of FORMATS (the command's default: megatron; native with
    --deepspeed)."""
    load_dir: Path
    """Source: an HF model directory, a native save directory (its `latest` step) or
    step-XXXXXX directory, a Megatron directory with latest_checkpointed_iteration.txt, a
    DeepSpeed directory with `latest` (or its global_stepN), an FSDP DCP directory / directory
    with one state-dict file, or a .gguf file (or a directory holding one)."""
    save_dir: Path
    """Output directory; written under a temporary name and renamed when complete (it must not
    exist unless `overwrite`)."""
    model: str | None = None
    """Model config name (e.g. llama2-7B, tiny-llama); needed when the source records no config
    (Megatron checkpoints not written by Meshline); checked against the source's own config
    otherwise."""
    target_tp: int = 1
    """Tensor-parallel size of a Megatron output (default 1)."""
    target_pp: int = 1
    """Pipeline-parallel size of a Megatron output (default 1)."""
    layers_per_virtual_stage: int | None = None
    """Layers per virtual pipeline chunk of a Megatron output (interleaved schedule); files then
    hold model0, model1, ... (None: no virtual chunks)."""
    lora_dir: Path | None = None
    """LoRA to merge (the command needs --merge-lora, which --lora-load implies): a peft adapter
    directory, or a Megatron/ModelLink LoRA checkpoint (latest_checkpointed_iteration.txt +
    mp_rank_* files, any TP/PP; merged per TP rank)."""
    lora_r: int | None = None
    """LoRA rank of a Megatron LoRA checkpoint whose args do not record it."""
    lora_alpha: float | None = None
    """LoRA alpha of a Megatron LoRA checkpoint whose args do not record it."""
    dtype: str | None = None
    """Dtype of the saved weights ("fp32", "bf16", "fp16"; default: keep the source's)."""
    verify: bool | None = None
    """Check logit parity of the output against the source before publishing it, on a fixed
    prompt, failing (exit 3, no output) if logits differ by more than the tolerance: None (the
    default) whenever two float32 copies of the model fit in half the available memory, True
    always, False never."""
    verify_tolerance: float | None = None
    """Largest allowed absolute logit difference (default 1e-4 for fp32 outputs, 2e-2 for
    fp16/bf16)."""
    load_iteration: int | None = None
    """Iteration of a Megatron source, or global step of a DeepSpeed one, to read (default:
    latest_checkpointed_iteration.txt / latest)."""
    overwrite: bool = False
    """Replace a non-empty save directory."""
    make_vocab_size_divisible_by: int = 128
    """Megatron outputs pad the vocabulary to a multiple of this times the TP size (default
    128)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest HF safetensors shard before the output is split with an index."""
    gguf_type: str | None = None
    """ggml type of a --save-format gguf output's matrices and token embedding (norms stay F32;
    default: F32/F16/BF16 by --dtype); Q8_0 and Q4_0 round the weights, so the automatic parity
    check is skipped for them."""
    quantize: str | None = None
    """With --save-format quantized (required by it, only valid with it): weight-only
    round-to-nearest quantization of the decoder layers' Linear weights (norms kept; the token
    embedding and output head int8 with one scale per row unless --keep-embedding): int8 one
    symmetric scale per output channel, int4 one per --group-size inputs; the checkpoint records
    its scheme; serving computes on the codes, other stages read it dequantized."""
    group_size: int | None = None
    """Inputs sharing one scale (default: per output channel for int8, 128 for int4)."""
    quantize_affine: bool = False
    """Affine codes (a zero point per group over [min, max]) instead of symmetric ones."""
    keep_embedding: bool = False
    """--keep-embedding: with --quantize, keep the token embedding and output head in --dtype
    instead of int8 codes with one scale per row."""
    quantize_method: str = "rtn"
    """--quantize-method: how the layers' codes are chosen, "rtn" (round to nearest) or "gptq"
    (calibrated on --calibration-data, layer by layer; kernels/gptq.py)."""
    calibration_data: Path | None = None
    """--calibration-data: the token shard GPTQ calibrates on, a Megatron indexed dataset prefix
    (PREFIX.bin / PREFIX.idx, as `meshline preprocess` writes) tokenized for this model."""
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    """--calibration-samples: windows of --calibration-seq-len tokens GPTQ runs through the model
    (spread evenly over the shard)."""
    calibration_seq_len: int = DEFAULT_CALIBRATION_SEQ_LEN
    """--calibration-seq-len: tokens per calibration window (at most the model's context)."""
    gptq_act_order: bool = False
    """--gptq-act-order: GPTQ rounds columns by decreasing input energy (groups' scales fixed
    from the original weights)."""
    gptq_damp: float = DEFAULT_PERCDAMP
    """--gptq-damp: dampening added to the Hessian's diagonal, as a fraction of its mean."""
    tokenizer_model: Path | None = None
    """--tokenizer-model (Megatron convert.py): a SentencePiece `tokenizer.model` whose vocabulary
    must fit the model's embedding; carried into the output when the source carries no tokenizer,
    and otherwise equal to the source's own (CLI only: a service request names no such file)."""
    lora_target_modules: tuple[str, ...] = ()
    """--lora-target-modules (ModelLink's merge): the modules the --lora-load adapter adapts, in
    Megatron or HF spelling; an adapter module outside them is an error, since ModelLink's merge
    would not load it."""
    ppo_model: str | None = None
    """--ppo-model: of a `meshline train --stage ppo` checkpoint (native), which model to write:
    policy (the trained language model; None means it too) or critic (the value model: a
    reward-model-style network with a scalar head, written as HF ...ForSequenceClassification
    with one label, or native/megatron). Given with a source that is no PPO checkpoint, it is
    refused (CLI only so far: no service request field)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Free-form notes (ignored by the conversion)."""

    def __post_init__(self) -> None:
        self.load_dir, self.save_dir = Path(self.load_dir), Path(self.save_dir)
        if self.lora_dir is not None:
            self.lora_dir = Path(self.lora_dir)
        get_format(self.load_format, "--load-format", LOAD_FORMATS)
        target = get_format(self.save_format, "--save-format", FORMATS)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected one of {list(DTYPES)}")
        sharded = [key for key in FORMATS if get_format(key).model_parallel]
        for flag, value in (
            ("--target-tensor-parallel-size", self.target_tp),
            ("--target-pipeline-parallel-size", self.target_pp),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
            if value > 1 and not target.model_parallel:
                raise ValueError(
                    f"{flag} {value}: only {' and '.join(sharded)} outputs are saved per "
                    f"tensor/pipeline rank (a {self.save_format} output loads into any layout); "
                    f"use --save-format {sharded[0]}"
                )
        if self.layers_per_virtual_stage is not None and (
            self.layers_per_virtual_stage < 1 or self.target_pp < 2
        ):
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage needs a value >= 1 and "
                "--target-pipeline-parallel-size > 1"
            )
        for flag, lora_value in (("--lora-r", self.lora_r), ("--lora-alpha", self.lora_alpha)):
            if lora_value is not None and (lora_value <= 0 or self.lora_dir is None):
                raise ValueError(f"{flag} needs a value > 0 and --lora-load, got {lora_value}")
        if self.gguf_type is not None and (
            self.save_format != "gguf" or self.gguf_type not in GGUF_TYPES
        ):
            raise ValueError(
                f"--gguf-type {self.gguf_type!r} needs --save-format gguf and one of "
                f"{list(GGUF_TYPES)}"
            )
        if (self.quantize is not None) != (self.save_format == "quantized"):
            raise ValueError(
                f"--quantize {self.quantize} and --save-format quantized go together (got "
                f"--save-format {self.save_format}); choose --quantize one of "
                f"{list(QUANTIZE_CHOICES)} with --save-format quantized"
            )
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(
                f"--quantize {self.quantize!r}: expected one of {list(QUANTIZE_CHOICES)}"
            )
        if self.group_size is not None and (self.group_size < 1 or self.quantize is None):
            raise ValueError(
                f"--group-size needs a value >= 1 and --quantize, got {self.group_size}"
            )
        if self.quantize_affine and self.quantize is None:
            raise ValueError("--quantize-affine needs --quantize")
        if self.ppo_model is not None and self.ppo_model not in PPO_MODELS:
            raise ValueError(f"--ppo-model {self.ppo_model!r}: choose one of {list(PPO_MODELS)}")
        if self.ppo_model is not None and self.load_format != "native":
            raise ValueError(
                f"--ppo-model {self.ppo_model} with --load-format {self.load_format}: a --stage "
                "ppo checkpoint is a native one (the trainer's --save); use --load-format native"
            )
        if self.keep_embedding and self.quantize is None:
            raise ValueError("--keep-embedding needs --quantize")
        self._check_calibration()
        if self.verify_tolerance is not None and self.verify_tolerance <= 0:
            raise ValueError(f"--verify-tolerance must be > 0, got {self.verify_tolerance}")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("--make-vocab-size-divisible-by must be >= 1")
        load, save = self.load_dir.resolve(), self.save_dir.resolve()
        if save == load or load in save.parents:
            raise ValueError(
                f"--save-dir {self.save_dir} lies inside --load-dir {self.load_dir}; write the "
                "output elsewhere (it would be read as part of the source)"
            )

    def _check_calibration(self) -> None:
        """--quantize-method and the calibration flags (bounds before any file is opened)."""
        if self.quantize_method not in QUANTIZE_METHODS:
            raise ValueError(
                f"--quantize-method {self.quantize_method!r}: expected one of "
                f"{list(QUANTIZE_METHODS)}"
            )
        gptq = self.quantize_method == "gptq"
        if gptq and self.quantize is None:
            raise ValueError("--quantize-method gptq needs --quantize int8|int4")
        if gptq and self.calibration_data is None:
            raise ValueError(
                "--quantize-method gptq needs --calibration-data PREFIX (a Megatron token shard, "
                "PREFIX.bin/.idx, tokenized for this model)"
            )
        defaults = ConvertOptions.__dataclass_fields__
        for flag, name in (
            ("--calibration-data", "calibration_data"),
            ("--calibration-samples", "calibration_samples"),
            ("--calibration-seq-len", "calibration_seq_len"),
            ("--gptq-act-order", "gptq_act_order"),
            ("--gptq-damp", "gptq_damp"),
        ):
            if not gptq and getattr(self, name) != defaults[name].default:
                raise ValueError(f"{flag} needs --quantize-method gptq")
        if self.calibration_data is not None:
            self.calibration_data = Path(self.calibration_data)
        if not 1 <= self.calibration_samples <= MAX_CALIBRATION_SAMPLES:
            raise ValueError(
                f"--calibration-samples must be in [1, {MAX_CALIBRATION_SAMPLES}], got "
                f"{self.calibration_samples}"
            )
        if not 2 <= self.calibration_seq_len <= MAX_CALIBRATION_SEQ_LEN:
            raise ValueError(
                f"--calibration-seq-len must be in [2, {MAX_CALIBRATION_SEQ_LEN}], got "
                f"{self.calibration_seq_len}"
            )
        tokens = self.calibration_samples * self.calibration_seq_len
        if tokens > MAX_CALIBRATION_TOKENS:
            raise ValueError(
                f"--calibration-samples {self.calibration_samples} × --calibration-seq-len "
                f"{self.calibration_seq_len} = {tokens} tokens; at most {MAX_CALIBRATION_TOKENS} "
                "(their hidden states are held in memory)"
            )
        if not 0.0 < self.gptq_damp <= 1.0:
            raise ValueError(f"--gptq-damp must be in (0, 1], got {self.gptq_damp}")


@dataclass
class Progress:
    """Where a running conversion is."""

    stage: str
    tensors_done: int
    tensors_total: int
    layers_done: int
    layers_total: int
    current_tensor: str = ""


@dataclass
class ConvertReport:
    """What a finished conversion wrote."""

    output_dir: Path
    files: list[str]
    num_parameters: int
    num_tensors: int
    verify: VerifyReport | None = None
    verify_skipped: str | None = None
    """Why an automatic parity check did not run (None when it ran or was switched off)."""
