"""One conversion: open the source, stream units through LoRA merge and dtype cast into the sink,
verify, publish atomically.

The output is written under a hidden temporary name beside `save_dir` and swapped into place only
after every file is written (and the parity check, when asked for, has passed); any failure
removes it, so a `save_dir` that exists is always complete. `output_dir` decides where an output
may go and what `overwrite` may replace (only the converter's own earlier outputs).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from checkpoints.lora import LoraAdapter, open_adapter
from checkpoints.megatron_lora import MegatronLoraAdapter
from checkpoints.native_format import NativeSource
from checkpoints.quantized_format import QuantizedSink
from checkpoints.registry import GGUF_QUANTIZED, SinkOptions, get_format
from checkpoints.units import (
    DTYPES,
    PRE,
    Sink,
    Source,
    Unit,
    check_unit,
    expected_names_cached,
    expected_shapes_cached,
    unit_label,
    units,
)
from kernels.gptq import GptqSettings
from models.config import ModelConfig
from models.gptq_calibration import GptqCalibrator, check_calibratable
from models.parallel_plan import CONVERT_FLAGS, check_model_split
from models.registry import get_config
from models.tokenizer import build_tokenizer
from services.converter.calibration import calibration_tokens
from services.converter.malloc import fix_mmap_threshold
from services.converter.options import (
    FORMATS,
    LOAD_FORMATS,
    STAGES,
    ConversionCancelled,
    ConvertOptions,
    ConvertReport,
    Progress,
    VerificationFailed,
)
from services.converter.output_dir import (
    check_replaceable,
    check_save_dir,
    discard,
    publish,
    source_fingerprint,
    staging_dir,
    write_marker,
)
from services.converter.verify import (
    ModelAssembler,
    VerifyReport,
    available_memory_bytes,
    compare,
    default_tolerance,
    fixed_logits,
    load_model,
    skip_reason,
)

VALUE_HEAD_FORMATS = ("hf", "native", "megatron")
"""Output formats that hold a reward model's value head (HF: `...ForSequenceClassification`)."""

_GGUF_FLOAT_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def open_source(options: ConvertOptions, named: ModelConfig | None) -> Source:
    """The source checkpoint of `options`, with `named` (from --model) checked or applied."""
    spec = get_format(options.load_format)
    if not options.load_dir.is_dir() and not (spec.single_file and options.load_dir.is_file()):
        what = "directory or file" if spec.single_file else "directory"
        raise FileNotFoundError(f"--load-dir {options.load_dir} is not an existing {what}")
    iteration = options.load_iteration if spec.iterations else None
    source = spec.open_source(options.load_dir, named, iteration)
    if options.ppo_model is not None:
        if not isinstance(source, NativeSource):  # options refuse other formats; a safeguard
            raise ValueError(f"--ppo-model {options.ppo_model} reads a native checkpoint only")
        source.select_ppo_model(options.ppo_model)
    return source


def open_sink(options: ConvertOptions, directory: Path, source: Source, dtype: torch.dtype) -> Sink:
    """The output writer for `options.save_format`, writing into `directory`."""
    spec = get_format(options.save_format, "--save-format")
    if spec.open_sink is None:
        raise ValueError(f"--save-format {options.save_format}: {spec.label} is read only")
    return spec.open_sink(directory, source, dtype, sink_options(options))


def sink_options(options: ConvertOptions) -> SinkOptions:
    """The output layout settings of `options`."""
    return SinkOptions(
        target_tp=options.target_tp,
        target_pp=options.target_pp,
        layers_per_virtual_stage=options.layers_per_virtual_stage,
        make_vocab_size_divisible_by=options.make_vocab_size_divisible_by,
        max_shard_bytes=options.max_shard_bytes,
        gguf_type=options.gguf_type,
        quantize=options.quantize,
        group_size=options.group_size,
        quantize_affine=options.quantize_affine,
        keep_embedding=options.keep_embedding,
        quantize_method=options.quantize_method,
    )


def check_target_layout(options: ConvertOptions, config: ModelConfig) -> None:
    """ValueError naming --target-tensor/pipeline-parallel-size (or the virtual stage size) when
    the source's model config cannot be split that way: before any weight is read."""
    if not get_format(options.save_format, "--save-format").model_parallel:
        return
    check_model_split(config, tp=options.target_tp, pp=options.target_pp, flags=CONVERT_FLAGS)
    per_virtual = options.layers_per_virtual_stage
    if per_virtual is not None and config.num_layers % (options.target_pp * per_virtual):
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_virtual} × "
            f"--target-pipeline-parallel-size {options.target_pp} does not divide the model's "
            f"num_layers {config.num_layers}; pick sizes whose product divides it"
        )


def _check_save_dir(options: ConvertOptions) -> None:
    reads = [("--load-dir", options.load_dir)]
    if options.lora_dir is not None:
        reads.append(("--lora-load", options.lora_dir))
    check_save_dir(options.save_dir, reads)
    check_replaceable(options.save_dir, options.overwrite)


def open_checked_source(options: ConvertOptions) -> Source:
    """The source of `options`, opened and checked against the output: every refusal a
    conversion makes before it reads a weight. The service runs it before it claims save_dir,
    so a refused request leaves no trace (not even a claim lock file)."""
    _check_save_dir(options)
    named = get_config(options.model) if options.model else None
    source = open_source(options, named)
    check_target_layout(options, source.config)
    if source.config.value_head and options.save_format not in VALUE_HEAD_FORMATS:
        raise ValueError(
            f"--save-format {options.save_format}: the source is a reward model (a scalar value "
            f"head), which only {' and '.join(VALUE_HEAD_FORMATS)} outputs hold so far; write "
            "one of those"
        )
    if source.config.value_head and options.lora_dir is not None:
        raise ValueError(
            "--lora-load with a reward model source: merging adapters into a value-head model "
            "is not built; convert the reward model without --lora-load"
        )
    if options.tokenizer_model is not None:
        carry_tokenizer_model(options.tokenizer_model, source)
    if options.quantize_method == "gptq":
        check_calibratable(source.config)
    target = get_format(options.save_format)
    if target.check_target is not None:
        target.check_target(source, sink_options(options))
    return source


TOKENIZER_MODEL_MAX_BYTES = 64 * 1024 * 1024
"""Largest --tokenizer-model read (SentencePiece files are a few MiB)."""


def carry_tokenizer_model(path: Path, source: Source) -> None:
    """--tokenizer-model: a SentencePiece `tokenizer.model` whose vocabulary fits the model's
    embedding; the output carries it when the source has no tokenizer, and otherwise it must be
    the source's own file (a different tokenizer would silently pair with these weights)."""
    flag = f"--tokenizer-model {path}"
    if path.name != "tokenizer.model" or not path.is_file():
        raise ValueError(f"{flag}: give the SentencePiece file named tokenizer.model")
    if path.stat().st_size > TOKENIZER_MODEL_MAX_BYTES:
        raise ValueError(f"{flag}: larger than {TOKENIZER_MODEL_MAX_BYTES} bytes")
    try:
        vocab = build_tokenizer("SentencePiece", path).vocab_size
    except Exception as exc:  # sentencepiece raises RuntimeError/OSError on a bad file
        raise ValueError(f"{flag}: not a SentencePiece model ({exc})") from exc
    if vocab > source.config.vocab_size:
        raise ValueError(
            f"{flag}: its {vocab} tokens do not fit the model's {source.config.vocab_size}-row "
            "embedding; it belongs to another model"
        )
    own = [f for f in source.tokenizer_files if f.name in ("tokenizer.model", "tokenizer.json")]
    if not own:
        source.tokenizer_files = [*source.tokenizer_files, path]
    elif own[0].name != "tokenizer.model" or own[0].read_bytes() != path.read_bytes():
        raise ValueError(
            f"{flag}: the source carries its own tokenizer ({', '.join(f.name for f in own)}), "
            "which differs; drop --tokenizer-model to keep the source's"
        )


def adapter_kinds(adapter: LoraAdapter | MegatronLoraAdapter) -> dict[str, str]:
    """Module leaf name -> the projection it is (qkv, attention output, MLP in, MLP out)."""
    if isinstance(adapter, MegatronLoraAdapter):
        leaves = {
            module.rpartition(".")[2] for modules in adapter.pairs.values() for module in modules
        }
    else:
        leaves = {module.rpartition(".")[2] for module in adapter.pairs}
    return {leaf: LORA_KINDS.get(leaf, leaf) for leaf in leaves}


LORA_KINDS = {
    **dict.fromkeys(("query_key_value", "W_pack", "qkv_proj", "q_proj", "k_proj", "v_proj"), "qkv"),
    **dict.fromkeys(("dense", "o_proj"), "attention output"),
    **dict.fromkeys(("dense_h_to_4h", "gate_up_proj", "gate_proj", "up_proj"), "MLP input"),
    **dict.fromkeys(("dense_4h_to_h", "down_proj"), "MLP output"),
}
"""Megatron/ModelLink and HF LoRA target names -> the projection they adapt."""


def check_lora_targets(
    targets: tuple[str, ...], adapter: LoraAdapter | MegatronLoraAdapter
) -> None:
    """--lora-target-modules: every module the adapter adapts is among them (by projection)."""
    listed = {LORA_KINDS.get(t, t) for t in targets}
    outside = sorted(leaf for leaf, kind in adapter_kinds(adapter).items() if kind not in listed)
    if outside:
        raise ValueError(
            f"--lora-target-modules {' '.join(targets)}: the adapter also adapts {outside}, "
            "which ModelLink's merge would not load; list them too (or drop the flag: the "
            "adapter's own modules are merged)"
        )


def convert(
    options: ConvertOptions,
    on_progress: Callable[[Progress], None] | None = None,
    cancel: threading.Event | None = None,
) -> ConvertReport:
    """Runs the conversion `options` describes; see the module doc for the guarantees."""
    fix_mmap_threshold()
    source = open_checked_source(options)
    config = source.config
    adapter = _checked_adapter(options, config)
    # GPTQ's calibration windows, read and checked before any weight is
    tokens = (
        calibration_tokens(
            options.calibration_data,
            options.calibration_samples,
            options.calibration_seq_len,
            config,
        )
        if options.calibration_data is not None
        else None
    )
    names = expected_names_cached(config)
    total = sum(len(names[unit]) for unit in units(config))
    report = _Reporter(on_progress, total, config.num_layers)
    # Fingerprinted before reading: the output records the source state it was made from.
    origin = {"load_dir": source_fingerprint(options.load_dir, "--load-dir")}
    if options.lora_dir is not None:
        origin["lora_dir"] = source_fingerprint(options.lora_dir, "--lora-load-dir")
    staging = staging_dir(options.save_dir)
    tmp = staging.path
    sink: Sink | None = None
    try:
        verify, skipped = _verify_choice(options, config)
        reference = ModelAssembler(config) if verify else None
        sink, num_parameters, dtype = _copy_units(
            options, source, adapter, reference, report, tmp, cancel, tokens
        )
        report.stage("save", None)
        files = sink.finish()
        marker = {"format": options.save_format, "load_dir": str(options.load_dir)}
        write_marker(tmp, {**marker, "files": files, "source": origin})
        verify_report = None
        if reference is not None:
            report.stage("verify", None)
            expected = fixed_logits(reference.build())
            del reference  # before the output is loaded: two models never overlap here
            verify_report = _check_parity(options, tmp, expected, dtype)
        publish(staging, options.save_dir, options.overwrite)
    except BaseException:
        if sink is not None:
            sink.abort()
        discard(staging)
        raise
    return ConvertReport(options.save_dir, files, num_parameters, total, verify_report, skipped)


def _checked_adapter(
    options: ConvertOptions, config: ModelConfig
) -> LoraAdapter | MegatronLoraAdapter | None:
    """The --lora-load adapter to merge (its modules checked against --lora-target-modules)."""
    if options.lora_dir is None:
        return None
    adapter = open_adapter(options.lora_dir, config, options.lora_r, options.lora_alpha)
    if options.lora_target_modules:
        check_lora_targets(options.lora_target_modules, adapter)
    return adapter


def _verify_choice(options: ConvertOptions, config: ModelConfig) -> tuple[bool, str | None]:
    """Whether the parity check runs, and why an automatic one does not (None when asked)."""
    if options.verify is not None:
        return options.verify, None
    rounding = (
        f"--gguf-type {options.gguf_type}"
        if options.gguf_type in GGUF_QUANTIZED
        else (f"--quantize {options.quantize}" if options.quantize else None)
    )
    if rounding is not None:
        return False, (
            f"{rounding} rounds the weights; pass --verify with a --verify-tolerance to "
            "compare logits"
        )
    size = sum(math.prod(s) for s in expected_shapes_cached(config).values())
    skipped = skip_reason(size, available_memory_bytes())
    return skipped is None, skipped


def _copy_units(
    options: ConvertOptions,
    source: Source,
    adapter: LoraAdapter | MegatronLoraAdapter | None,
    reference: ModelAssembler | None,
    report: _Reporter,
    tmp: Path,
    cancel: threading.Event | None,
    tokens: torch.Tensor | None = None,
) -> tuple[Sink, int, torch.dtype]:
    """Every unit read, checked, LoRA-merged, kept for the parity check and written (with
    `tokens`, GPTQ's calibration windows, its layers' codes chosen by GPTQ), one at a time;
    returns the sink (to finish), the parameters written and their dtype."""
    config = source.config
    calibrator: GptqCalibrator | None = None
    reshards = (
        get_format(options.save_format).model_parallel
        or get_format(options.load_format).model_parallel
    )
    sink: Sink | None = None
    num_parameters = 0
    try:
        for unit in units(config):
            if cancel is not None and cancel.is_set():
                raise ConversionCancelled("conversion cancelled; no output was written")
            report.stage("load", unit)
            tensors = source.read_unit(unit)
            check_unit(tensors, unit, config, f"--load-dir {options.load_dir}")
            if adapter is not None:
                report.stage("merge_lora", unit)
                tensors = adapter.merge_unit(tensors, config)
            if reference is not None:
                reference.add(tensors)
            if sink is None:
                first = next(iter(tensors.values()))
                dtype = DTYPES[options.dtype] if options.dtype else first.dtype
                sink = open_sink(options, tmp, source, dtype)
                if tokens is not None:
                    calibrator = _calibrator(options, config, tokens, sink)
            tensors = {n: t.to(dtype) for n, t in tensors.items()}
            report.stage("reshard" if reshards else "save", unit)
            if calibrator is not None:
                _write_calibrated(calibrator, sink, unit, tensors)
            else:
                sink.write_unit(unit, tensors)
            num_parameters += sum(t.numel() for t in tensors.values())
            report.done(unit, tensors)
            del tensors  # before the next read, so two units never overlap here
        if adapter is not None:
            adapter.check_all_merged()
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    assert sink is not None
    return sink, num_parameters, dtype


def _check_parity(
    options: ConvertOptions, tmp: Path, expected: torch.Tensor, dtype: torch.dtype
) -> VerifyReport:
    """The written output's logits against the source's (`expected`); VerificationFailed when
    they differ by more than the tolerance."""
    # a GGUF output's matrices are rounded to --gguf-type, not to --dtype
    written = _GGUF_FLOAT_TYPES.get(options.gguf_type or "", dtype)
    tolerance = options.verify_tolerance or default_tolerance(written)
    verify_report = compare(expected, load_model(_open_output(options, tmp)), tolerance)
    if not verify_report.passed:
        raise VerificationFailed(verify_report)
    return verify_report


def _calibrator(
    options: ConvertOptions, config: ModelConfig, tokens: torch.Tensor, sink: Sink
) -> GptqCalibrator:
    """The GPTQ calibrator of a quantized output, rounding under the sink's schemes."""
    assert isinstance(sink, QuantizedSink)  # options pair GPTQ with --quantize only
    settings = GptqSettings(percdamp=options.gptq_damp, act_order=options.gptq_act_order)
    return GptqCalibrator(
        config, tokens, sink.scheme.weights, settings, embedding=sink.scheme.embedding
    )


def _write_calibrated(
    calibrator: GptqCalibrator, sink: Sink, unit: Unit, tensors: dict[str, torch.Tensor]
) -> None:
    """Carries the calibration states through `unit` and writes it with GPTQ's layer codes."""
    assert isinstance(sink, QuantizedSink)
    if isinstance(unit, int):
        rounded = calibrator.quantize_layer(unit, tensors, sink.layer_weights(unit))
        sink.write_unit(unit, tensors, rounded)
        return
    if unit == PRE:
        calibrator.embed(tensors)
    sink.write_unit(unit, tensors)


def _open_output(options: ConvertOptions, directory: Path) -> Source:
    """The just-written output, opened with its own recorded config."""
    return get_format(options.save_format).open_source(directory, None, None)


class _Reporter:
    """Turns unit boundaries into `Progress` callbacks."""

    def __init__(
        self, callback: Callable[[Progress], None] | None, total: int, layers: int
    ) -> None:
        self.callback = callback
        self.progress = Progress("load", 0, total, 0, layers)

    def stage(self, stage: str, unit: object) -> None:
        self.progress.stage = stage
        if unit is not None:
            self.progress.current_tensor = unit_label(unit)  # type: ignore[arg-type]
        self._emit()

    def done(self, unit: object, tensors: dict[str, torch.Tensor]) -> None:
        self.progress.tensors_done += len(tensors)
        if isinstance(unit, int):
            self.progress.layers_done += 1
        self.progress.current_tensor = next(reversed(tensors)) if tensors else ""
        self._emit()

    def _emit(self) -> None:
        if self.callback is not None:
            self.callback(Progress(**vars(self.progress)))


__all__ = [
    "FORMATS",
    "LOAD_FORMATS",
    "STAGES",
    "ConversionCancelled",
    "ConvertOptions",
    "ConvertReport",
    "Progress",
    "VerificationFailed",
    "convert",
]
