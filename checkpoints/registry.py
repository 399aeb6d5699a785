"""The checkpoint formats, one registry keyed by the string the CLI and the protos use.

Every list of format names derives from `FORMATS`: `meshline convert --load-format` /
`--save-format` (`READ_FORMATS` / `WRITE_FORMATS`), the serving `--load-format` of `meshline
generate`, `meshline serve` and `meshline evaluate` (`SERVE_FORMATS`, plus "auto"), the
`--load-format auto` detection (`detect_format`) and the proto enum
`meshline.common.v1.CheckpointFormat`, whose value `CHECKPOINT_FORMAT_<KEY>` is each key
upper-cased (mapped in `services/common/checkpoint_formats.py`). The converter job and the
serving loader open readers and writers through an entry's `open_source` / `open_sink`, never
by format name.

Adding a format: one `FormatSpec` entry below (its reader/writer module holds the
`Source` / `Sink` classes of `checkpoints/units.py`) and one enum value in
`proto/meshline/common/v1/checkpoint.proto`; tests/checkpoints/test_registry.py fails until both
exist. The reader and writer modules import torch, so the entries reach them through small
openers that import on call: the CLIs import this module to build their choices without
loading torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from checkpoints.units import Sink, Source
    from kernels.quantization import WeightScheme
    from models.config import ModelConfig

AUTO = "auto"
"""The serving `--load-format` that means: detect the format from the files (`detect_format`)."""


@dataclass(frozen=True)
class SinkOptions:
    """Layout settings of a written checkpoint; each writer reads the ones its format has."""

    target_tp: int = 1
    """Tensor-parallel size of a model-parallel output."""
    target_pp: int = 1
    """Pipeline-parallel size of a model-parallel output."""
    layers_per_virtual_stage: int | None = None
    """Layers per virtual pipeline chunk of a model-parallel output (None: no chunks)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron vocabulary padding multiple (per TP rank)."""
    max_shard_bytes: int | None = None
    """Largest HF safetensors shard (None: the HF writer's default)."""
    gguf_type: str | None = None
    """ggml type of a GGUF output's matrices (F32, F16, BF16, Q8_0, Q4_0; None: from the dtype)."""
    quantize: str | None = None
    """Weight quantization of a quantized output ("int8", "int4"); None: not quantized."""
    group_size: int | None = None
    """Inputs per scale of a quantized output (None: one scale per output channel)."""
    quantize_affine: bool = False
    """Affine (zero point) rather than symmetric codes for a quantized output."""
    keep_embedding: bool = False
    """A quantized output keeps the token embedding and output head in the dtype (default: int8,
    checkpoints.quantized_format.EMBEDDING_SCHEME, where the model's head is a vocabulary head)."""
    quantize_method: str = "rtn"
    """How a quantized output's layer codes are chosen, recorded in it ("rtn", "gptq": the
    converter hands the sink GPTQ's codes)."""


OpenSource = Callable[["Path", "ModelConfig | None", "int | None"], "Source"]
"""(directory, config named by --model or None, iteration or None) -> the format's reader."""
OpenSink = Callable[["Path", "Source", "torch.dtype", SinkOptions], "Sink"]
"""(output directory, the source being converted, dtype, layout) -> the format's writer."""


@dataclass(frozen=True)
class FormatSpec:
    """One checkpoint format: its key, what Meshline does with it, how to spot and open it.

    Every format is read (a conversion source); `open_sink` makes it a conversion target and
    `serves` a serving / evaluation input."""

    key: str
    """CLI spelling (`--load-format KEY`); the proto value is CHECKPOINT_FORMAT_<KEY upper>."""
    label: str
    """Name in messages ("HF", "Megatron")."""
    layout: str
    """The files that make a checkpoint of this format (for help and error messages)."""
    open_source: OpenSource
    """Opens a checkpoint of this format for reading, unit by unit."""
    open_sink: OpenSink | None = None
    """Opens a writer of this format; None: the format is read only."""
    serves: bool = False
    """Loadable for serving and evaluation (`meshline serve/generate/evaluate --load-format`)."""
    iterations: bool = False
    """A directory holds several saves picked by `--load-iteration` (default: its tracker)."""
    model_parallel: bool = False
    """Saved per tensor/pipeline-parallel rank: writing it takes --target-*-parallel-size and
    reading or writing it reshards."""
    detect: Callable[[Path], bool] | None = None
    """True when a directory holds this format (for `--load-format auto`); None: never guessed."""
    detect_rank: int = 0
    """Order of the `detect` checks, lowest first: a directory some tool filled with several
    formats' files is read as the first match."""
    single_file: bool = False
    """The checkpoint is one file: `--load-dir` may name it (or a directory holding it)."""
    check_target: Callable[[Source, SinkOptions], None] | None = None
    """Refuses (ValueError) a source this format cannot write, before any weight is read; None:
    every model is written."""

    @property
    def writes(self) -> bool:
        """The format is a conversion target (`--save-format`)."""
        return self.open_sink is not None


# Openers: each imports its reader/writer module when called (torch stays out of CLI start-up).


def _hf_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.hf_format import HFSource

    return HFSource(directory, named)


def _hf_sink(directory: Path, source: Source, dtype: torch.dtype, layout: SinkOptions) -> Sink:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.hf_format import DEFAULT_MAX_SHARD_BYTES, HFSink

    return HFSink(
        directory,
        source.config,
        dtype,
        source.tokenizer_files,
        layout.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
        getattr(source, "hf_config", None),
    )


def _native_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.native_format import NativeSource

    return NativeSource(directory, named)


def _native_sink(directory: Path, source: Source, dtype: torch.dtype, layout: SinkOptions) -> Sink:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.native_format import NativeSink

    return NativeSink(
        directory, source.config, dtype, source.tokenizer_files, step=source.iteration
    )


def _megatron_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.megatron_format import MegatronSource

    return MegatronSource(directory, named, iteration)


def _megatron_sink(
    directory: Path, source: Source, dtype: torch.dtype, layout: SinkOptions
) -> Sink:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.megatron_writer import MegatronSink

    return MegatronSink(
        directory,
        source.config,
        dtype,
        source.tokenizer_files,
        tp=layout.target_tp,
        pp=layout.target_pp,
        layers_per_virtual_stage=layout.layers_per_virtual_stage,
        iteration=source.iteration,
        make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by,
    )


def _deepspeed_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.deepspeed_format import DeepSpeedSource
    from checkpoints.deepspeed_universal import UniversalSource, universal_tag

    tag = universal_tag(directory, iteration)  # ds_to_universal's output, else a ZeRO checkpoint
    if tag is not None:
        return UniversalSource(tag, named)
    return DeepSpeedSource(directory, named, iteration)


def _fsdp_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.fsdp_format import FSDPSource

    return FSDPSource(directory, named)


def _gguf_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.gguf_format import GGUFSource

    return GGUFSource(directory, named)


def _gguf_sink(directory: Path, source: Source, dtype: torch.dtype, layout: SinkOptions) -> Sink:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.gguf_writer import GGUFSink

    return GGUFSink(directory, source, dtype, layout.gguf_type)


def _gguf_check(source: Source, layout: SinkOptions) -> None:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.gguf_quants import require_gguf
    from checkpoints.gguf_writer import check_config, tokenizer_metadata

    require_gguf()
    check_config(source.config)
    tokenizer_metadata(source.tokenizer_files, source.config.vocab_size)


GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
"""`--gguf-type` choices: the ggml types a GGUF output's matrices are written in."""
GGUF_QUANTIZED = ("Q8_0", "Q4_0")
"""The `GGUF_TYPES` that round weights (a parity check at float tolerance would fail)."""

QUANTIZE_CHOICES = ("int8", "int4")
"""`--quantize` choices: weight-only round-to-nearest int8 (per channel) / int4 (per group)."""
QUANTIZE_METHODS = ("rtn", "gptq")
"""`--quantize-method` choices (checkpoints/quantized_format.py METHODS)."""
DEFAULT_INT4_GROUP = 128
"""`--group-size` of `--quantize int4` when none is given."""


def _weight_scheme(layout: SinkOptions) -> WeightScheme:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from kernels.quantization import WeightScheme

    if layout.quantize not in QUANTIZE_CHOICES:
        raise ValueError(
            f"--save-format quantized needs --quantize {'|'.join(QUANTIZE_CHOICES)} (the scheme "
            "the checkpoint records)"
        )
    bits = 8 if layout.quantize == "int8" else 4
    group = layout.group_size
    if group is None and bits == 4:
        group = DEFAULT_INT4_GROUP
    return WeightScheme(bits, group, not layout.quantize_affine)


def _quantized_source(directory: Path, named: ModelConfig | None, iteration: int | None) -> Source:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.quantized_format import QuantizedSource

    return QuantizedSource(directory, named)


def _embedding_scheme(config: ModelConfig, layout: SinkOptions) -> WeightScheme | None:
    """How a quantized output stores the embedding and head: int8 unless --keep-embedding or
    the model's head is not a vocabulary head (kept then: the default only, no flag asked)."""
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.quantized_format import EMBEDDING_SCHEME, embedding_quantizable

    if layout.keep_embedding or not embedding_quantizable(config):
        return None
    return EMBEDDING_SCHEME


def _quantized_sink(
    directory: Path, source: Source, dtype: torch.dtype, layout: SinkOptions
) -> Sink:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.quantized_format import QuantizedSink

    return QuantizedSink(
        directory, source.config, dtype, source.tokenizer_files, _weight_scheme(layout),
        _embedding_scheme(source.config, layout), layout.quantize_method,
    )  # fmt: skip


def _quantized_check(source: Source, layout: SinkOptions) -> None:
    # formats load on use: the registry imports none (nor gguf, safetensors, torch)
    from checkpoints.quantized_format import check_plan

    check_plan(source.config, _weight_scheme(layout), _embedding_scheme(source.config, layout))


QUANTIZED_SCHEME = "quantization.json"
"""The file that marks a quantized checkpoint (checkpoints/quantized_format.py SCHEME_FILE)."""


def _is_quantized(directory: Path) -> bool:
    return (directory / QUANTIZED_SCHEME).is_file()


MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's file naming the saved iteration (checkpoints/megatron_format.py TRACKER)."""


def _is_hf(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _is_native(directory: Path) -> bool:
    return (directory / "latest").is_file() or (directory / ".metadata").is_file()


def _is_megatron(directory: Path) -> bool:
    return (directory / MEGATRON_TRACKER).is_file()


_ENTRIES = (
    FormatSpec(
        key="hf",
        label="HF",
        layout="config.json + *.safetensors",
        open_source=_hf_source,
        open_sink=_hf_sink,
        serves=True,
        detect=_is_hf,
        detect_rank=2,
    ),
    FormatSpec(
        key="native",
        label="native",
        layout="latest / .metadata",
        open_source=_native_source,
        open_sink=_native_sink,
        serves=True,
        detect=_is_native,
        detect_rank=1,
    ),
    FormatSpec(
        key="megatron",
        label="Megatron",
        layout=MEGATRON_TRACKER,
        open_source=_megatron_source,
        open_sink=_megatron_sink,
        serves=True,
        iterations=True,
        model_parallel=True,
        detect=_is_megatron,
        detect_rank=0,
    ),
    FormatSpec(
        key="deepspeed",
        label="DeepSpeed ZeRO",
        layout="latest + global_stepN/*_model_states.pt",
        open_source=_deepspeed_source,
        iterations=True,
    ),
    FormatSpec(
        key="fsdp",
        label="FSDP",
        layout="a DCP directory or one torch state-dict file of an HF model",
        open_source=_fsdp_source,
    ),
    FormatSpec(
        key="gguf",
        label="GGUF",
        layout="one llama.cpp .gguf file",
        open_source=_gguf_source,
        open_sink=_gguf_sink,
        single_file=True,
        check_target=_gguf_check,
    ),
    FormatSpec(
        key="quantized",
        label="quantized native",
        layout="quantization.json + config.json + model.safetensors",
        open_source=_quantized_source,
        open_sink=_quantized_sink,
        serves=True,
        detect=_is_quantized,
        detect_rank=0,
        check_target=_quantized_check,
    ),
)

FORMATS: dict[str, FormatSpec] = {entry.key: entry for entry in _ENTRIES}
"""Every checkpoint format by key, in proto enum order."""
READ_FORMATS = tuple(FORMATS)
"""`meshline convert --load-format` choices: every format is read."""
WRITE_FORMATS = tuple(key for key, entry in FORMATS.items() if entry.writes)
"""`meshline convert --save-format` choices."""
SERVE_FORMATS = tuple(key for key, entry in FORMATS.items() if entry.serves)
"""Formats the serving loader (engine/loading.py) reads."""
SERVE_CHOICES = (AUTO, *SERVE_FORMATS)
"""`--load-format` choices of `meshline serve`, `meshline generate` and `meshline evaluate`."""


def get_format(key: str, flag: str = "--load-format", choices: tuple[str, ...] = ()) -> FormatSpec:
    """The format `key` names; ValueError naming `flag` and the `choices` (default: all) else."""
    allowed = choices or tuple(FORMATS)
    if key not in allowed:
        raise ValueError(f"{flag} {key!r}: expected one of {list(allowed)}")
    return FORMATS[key]


def detect_format(directory: Path) -> str:
    """The serving format whose files `directory` holds (ValueError when none fits)."""
    detectable = sorted(
        (entry for entry in FORMATS.values() if entry.serves and entry.detect is not None),
        key=lambda entry: entry.detect_rank,
    )
    for entry in detectable:
        assert entry.detect is not None
        if entry.detect(directory):
            return entry.key
    kinds = [f"{entry.label} ({entry.layout})" for entry in FORMATS.values() if entry in detectable]
    raise ValueError(
        f"--load {directory}: no checkpoint of a known format: {', '.join(kinds[:-1])} or "
        f"{kinds[-1]}; pass --load-format or point --load at a checkpoint"
    )
