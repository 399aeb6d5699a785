"""ConverterService: validates a Convert request completely, then starts the conversion job.

Checks run in the order a user fixes things: malformed or contradictory fields
(INVALID_ARGUMENT), paths outside the data roots (PERMISSION_DENIED), a missing source
(NOT_FOUND), an existing output without `overwrite` (FAILED_PRECONDITION), then the source's
config against `model` and the output layout (INVALID_ARGUMENT naming the field) — all before
save_dir is claimed, so a refused request leaves nothing behind. The job itself
(services/converter/job.py) runs as an operation in a worker thread: its metadata reports the
stage and the tensors/layers done; a failed parity check fails it with FAILED_PRECONDITION, a
tensor that cannot be read with INVALID_ARGUMENT naming the field.
Nothing is published unless the whole conversion succeeded.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from checkpoints.registry import FORMATS, READ_FORMATS, WRITE_FORMATS
from meshline.converter.v1 import converter_pb2, converter_pb2_grpc
from services.common.checkpoint_formats import format_keys, format_names
from services.common.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Validator,
)
from services.common.field_checks import check_range
from services.common.jobs import JobRunner
from services.common.operation_jobs import OperationHandle
from services.common.operations import OperationsStore
from services.common.operations_servicer import operations_binding
from services.common.paths import confine_tree, resolve_under_roots
from services.common.server import ServiceBinding
from services.converter.config import ConverterServiceConfig
from services.converter.job import (
    STAGES,
    ConversionCancelled,
    ConvertOptions,
    ConvertReport,
    Progress,
    VerificationFailed,
    convert,
    open_checked_source,
)
from services.converter.output_dir import (
    UnsafeSaveDir,
    check_replaceable,
    check_save_dir,
    sweep_stale,
)

SERVICE_NAME = converter_pb2.DESCRIPTOR.services_by_name["ConverterService"].full_name
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
JOB_KIND = "convert"
FORMAT_KEYS = format_keys(READ_FORMATS)
"""load_format enum value -> registry key (checkpoints/registry.py): every format is read."""
WRITTEN_KEYS = format_keys(WRITE_FORMATS)
"""save_format enum value -> registry key: the formats written."""
_READ_ONLY = tuple(key for key in READ_FORMATS if key not in WRITE_FORMATS)
_ITERATED = tuple(key for key in READ_FORMATS if FORMATS[key].iterations)
_SHARDED = tuple(key for key in WRITE_FORMATS if FORMATS[key].model_parallel)
_DTYPE_NAMES = {
    converter_pb2.DTYPE_FLOAT32: "fp32",
    converter_pb2.DTYPE_FLOAT16: "fp16",
    converter_pb2.DTYPE_BFLOAT16: "bf16",
}
_STAGE_VALUES = {
    name: converter_pb2.ConvertStage.Value(f"CONVERT_STAGE_{name.upper()}") for name in STAGES
}


def check_fields(request: converter_pb2.ConvertRequest, config: ConverterServiceConfig) -> None:
    """Raises InvalidArgument naming every malformed or contradictory field."""
    check = Validator()
    check.require(
        request.load_format in FORMAT_KEYS, "load_format", f"set {format_names(READ_FORMATS)}"
    )
    check.require(
        request.save_format in WRITTEN_KEYS,
        "save_format",
        f"set {format_names(WRITE_FORMATS)} ({format_names(_READ_ONLY, 'and')} are read only)",
    )
    check.require(bool(request.load_dir), "load_dir", "must not be empty")
    check.require(bool(request.save_dir), "save_dir", "must not be empty")
    if request.model:
        check.require(
            _MODEL_NAME.fullmatch(request.model) is not None,
            "model",
            f"{request.model!r} is not a model config name (e.g. llama-7b)",
        )
    _check_layout(check, request, config)
    check.require(
        request.merge_lora == bool(request.lora_load_dir),
        "merge_lora" if request.merge_lora else "lora_load_dir",
        "merge_lora and lora_load_dir go together (the adapter is folded into the weights)",
    )
    check.require(
        WRITTEN_KEYS.get(request.save_format) != "quantized",
        "save_format",
        "QUANTIZED outputs need a quantization scheme, which ConvertRequest does not carry; "
        "use `meshline convert --save-format quantized --quantize int8|int4`",
    )
    check.require(request.dtype in converter_pb2.Dtype.values(), "dtype", "unknown value")
    _check_optional_fields(check, request)
    check.require(
        _converts_something(request),
        "save_format",
        "nothing to convert: same format, no resharding, no LoRA merge and no dtype change",
    )
    check.raise_if_any()


def _check_layout(
    check: Validator, request: converter_pb2.ConvertRequest, config: ConverterServiceConfig
) -> None:
    """The target tensor/pipeline sizes and virtual stages: bounded, for sharded outputs only."""
    sharded_out = WRITTEN_KEYS.get(request.save_format) in _SHARDED
    for field in ("target_tensor_parallel_size", "target_pipeline_parallel_size"):
        if request.HasField(field):
            check_range(check, request, field, 1, config.max_parallel_size)
            check.require(
                sharded_out,
                field,
                f"only {format_names(_SHARDED, 'and')} outputs are saved per tensor/pipeline "
                "rank (other formats load into any layout)",
            )
    if request.HasField("num_layers_per_virtual_pipeline_stage"):
        check.require(
            request.num_layers_per_virtual_pipeline_stage >= 1,
            "num_layers_per_virtual_pipeline_stage",
            "must be >= 1",
        )
        check.require(
            request.target_pipeline_parallel_size > 1,
            "num_layers_per_virtual_pipeline_stage",
            "needs target_pipeline_parallel_size > 1",
        )


def _check_optional_fields(check: Validator, request: converter_pb2.ConvertRequest) -> None:
    """verify_tolerance, load_iteration and the LoRA hyperparameters, where set."""
    if request.HasField("verify_tolerance"):
        check.require(request.verify_tolerance > 0, "verify_tolerance", "must be > 0")
        check.require(
            not request.HasField("verify") or request.verify,
            "verify_tolerance",
            "does not apply with verify=false",
        )
    if request.HasField("load_iteration"):
        check.require(request.load_iteration >= 0, "load_iteration", "must be >= 0")
        check.require(
            FORMAT_KEYS.get(request.load_format) in _ITERATED,
            "load_iteration",
            f"only {format_names(_ITERATED, 'and')} sources have iterations",
        )
    for field in ("lora_r", "lora_alpha"):
        if request.HasField(field):
            check.require(getattr(request, field) > 0, field, "must be > 0")
            check.require(bool(request.lora_load_dir), field, "only applies with lora_load_dir")


def _converts_something(request: converter_pb2.ConvertRequest) -> bool:
    """Whether the output would differ from the source at all."""
    return (
        request.load_format != request.save_format
        or request.HasField("target_tensor_parallel_size")
        or request.HasField("target_pipeline_parallel_size")
        or request.merge_lora
        or request.dtype != converter_pb2.DTYPE_UNSPECIFIED
    )


def check_paths(request: converter_pb2.ConvertRequest, config: ConverterServiceConfig) -> None:
    """Confines the paths to the data roots; the source must exist, the output must not."""
    roots = config.data_roots
    load_dir = resolve_under_roots(request.load_dir, roots, "load_dir")
    save_dir = resolve_under_roots(request.save_dir, roots, "save_dir")
    lora_dir = (
        resolve_under_roots(request.lora_load_dir, roots, "lora_load_dir")
        if request.lora_load_dir
        else None
    )
    if save_dir == load_dir or load_dir in save_dir.parents:
        raise InvalidArgument(
            "save_dir", f"{str(save_dir)!r} lies inside load_dir; write the output elsewhere"
        )
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if save_dir == real_root or save_dir in real_root.parents:
            raise InvalidArgument(
                "save_dir",
                f"{request.save_dir!r} is the data root {str(real_root)!r} (or above it); "
                "write the output to a new directory under it",
            )
    reads = [("load_dir", load_dir)] + ([("lora_load_dir", lora_dir)] if lora_dir else [])
    try:
        check_save_dir(save_dir, reads)
    except UnsafeSaveDir as exc:
        raise InvalidArgument("save_dir", str(exc)) from exc
    if not load_dir.is_dir():
        raise NotFound(f"load_dir: {request.load_dir!r} is not an existing directory")
    if lora_dir is not None and not lora_dir.is_dir():
        raise NotFound(f"lora_load_dir: {request.lora_load_dir!r} is not an existing directory")
    # The sources are read whole: a symlink inside them must not lead outside the roots.
    confine_tree(load_dir, roots, "load_dir")
    if lora_dir is not None:
        confine_tree(lora_dir, roots, "lora_load_dir")
    if save_dir.is_dir() and any(save_dir.iterdir()) and not request.overwrite:
        raise FailedPrecondition(
            f"save_dir: {request.save_dir!r} exists and is not empty; set overwrite=true to "
            "replace it or choose another directory"
        )
    try:
        check_replaceable(save_dir, request.overwrite)
    except FileExistsError as exc:
        raise FailedPrecondition(f"save_dir: {exc}") from exc


def job_options(
    request: converter_pb2.ConvertRequest, config: ConverterServiceConfig
) -> ConvertOptions:
    """The library options of a validated request (paths resolved under the data roots)."""
    roots = config.data_roots
    lora = (
        resolve_under_roots(request.lora_load_dir, roots, "lora_load_dir")
        if request.lora_load_dir
        else None
    )
    layers_per_chunk = (
        request.num_layers_per_virtual_pipeline_stage
        if request.HasField("num_layers_per_virtual_pipeline_stage")
        else None
    )
    try:
        return ConvertOptions(
            load_format=FORMAT_KEYS[request.load_format],
            save_format=WRITTEN_KEYS[request.save_format],
            load_dir=resolve_under_roots(request.load_dir, roots, "load_dir"),
            save_dir=resolve_under_roots(request.save_dir, roots, "save_dir"),
            model=request.model or None,
            target_tp=request.target_tensor_parallel_size or 1,
            target_pp=request.target_pipeline_parallel_size or 1,
            layers_per_virtual_stage=layers_per_chunk,
            lora_dir=lora,
            lora_r=request.lora_r if request.HasField("lora_r") else None,
            lora_alpha=request.lora_alpha if request.HasField("lora_alpha") else None,
            dtype=_DTYPE_NAMES.get(request.dtype),
            verify=request.verify if request.HasField("verify") else None,
            verify_tolerance=(
                request.verify_tolerance if request.HasField("verify_tolerance") else None
            ),
            load_iteration=request.load_iteration if request.HasField("load_iteration") else None,
            overwrite=request.overwrite,
        )
    except ValueError as exc:
        raise InvalidArgument("request", str(exc)) from exc


def result_message(report: ConvertReport) -> converter_pb2.ConvertResult:
    """The operation response of a finished conversion."""
    result = converter_pb2.ConvertResult(
        output_dir=str(report.output_dir),
        files=report.files,
        num_parameters=report.num_parameters,
        num_tensors=report.num_tensors,
    )
    if report.verify is not None:
        result.verify.CopyFrom(_verify_message(report.verify))
    if report.verify_skipped is not None:
        result.verify_skipped = report.verify_skipped
    return result


def _verify_message(report: object) -> converter_pb2.VerifyResult:
    return converter_pb2.VerifyResult(
        max_abs_logit_diff=report.max_abs_logit_diff,  # type: ignore[attr-defined]
        tolerance=report.tolerance,  # type: ignore[attr-defined]
        passed=report.passed,  # type: ignore[attr-defined]
    )


class ConverterServicer(converter_pb2_grpc.ConverterServiceServicer):
    """Starts conversion jobs as operations in `store`, one job per output directory at a time."""

    def __init__(self, config: ConverterServiceConfig, store: OperationsStore) -> None:
        self._config = config
        self._store = store
        self._jobs = JobRunner(store, JOB_KIND, job_noun="conversion")

    async def Convert(
        self, request: converter_pb2.ConvertRequest, context: grpc.aio.ServicerContext
    ) -> converter_pb2.ConvertResponse:
        """Validates the request, then starts the conversion and returns its operation."""
        check_fields(request, self._config)
        check_paths(request, self._config)
        options = job_options(request, self._config)
        # The source's config and the output layout are checked before save_dir is claimed:
        # a claim leaves a lock file next to the output for good (services/common/claims.py).
        await asyncio.to_thread(_check_source, request, options)
        return self._start_job(request, options)

    def _start_job(
        self, request: converter_pb2.ConvertRequest, options: ConvertOptions
    ) -> converter_pb2.ConvertResponse:

        def job(handle: OperationHandle) -> converter_pb2.ConvertResult:
            return self._run(request, options, handle)

        operation = self._jobs.start(
            converter_pb2.ConvertMetadata(request=request),
            job,
            output=options.save_dir,
            field="save_dir",
        )
        return converter_pb2.ConvertResponse(operation=operation)

    @staticmethod
    def _run(
        request: converter_pb2.ConvertRequest, options: ConvertOptions, handle: OperationHandle
    ) -> converter_pb2.ConvertResult:
        def on_progress(progress: Progress) -> None:
            metadata = converter_pb2.ConvertMetadata(
                request=request,
                stage=_STAGE_VALUES[progress.stage],
                tensors_done=progress.tensors_done,
                tensors_total=progress.tensors_total,
                layers_done=progress.layers_done,
                layers_total=progress.layers_total,
                current_tensor=progress.current_tensor,
            )
            handle.progress(
                progress.tensors_done,
                progress.tensors_total,
                unit="tensors",
                message=f"{progress.stage}: {progress.current_tensor}",
                metadata=metadata,
            )

        with _service_errors(request):
            report = convert(options, on_progress, handle.cancel_requested)
        return result_message(report)


def _check_source(request: converter_pb2.ConvertRequest, options: ConvertOptions) -> None:
    """The job's checks before any weight is read, as the service's errors."""
    with _service_errors(request):
        open_checked_source(options)


@contextmanager
def _service_errors(request: converter_pb2.ConvertRequest) -> Iterator[None]:
    """A conversion's errors as the service's, naming the request field at fault."""
    try:
        yield
    except ConversionCancelled as exc:
        raise Cancelled(str(exc)) from exc
    except VerificationFailed as exc:
        raise FailedPrecondition(f"verify: {exc}") from exc
    except FileExistsError as exc:
        raise FailedPrecondition(f"save_dir: {exc}") from exc
    except UnsafeSaveDir as exc:
        raise InvalidArgument("save_dir", str(exc)) from exc
    except FileNotFoundError as exc:
        raise NotFound(f"load_dir: {exc}") from exc
    except ValueError as exc:
        field = "model" if "--model" in str(exc) and request.model else "load_dir"
        raise InvalidArgument(field, str(exc)) from exc


def bindings(config: ConverterServiceConfig, store: OperationsStore) -> list[ServiceBinding]:
    """The converter service and the OperationsService over the same store.

    Staging folders that killed conversions left under the data roots are removed first.
    """
    sweep_stale(config.data_roots)
    servicer = ConverterServicer(config, store)
    return [
        ServiceBinding(
            SERVICE_NAME, servicer, converter_pb2_grpc.add_ConverterServiceServicer_to_server
        ),
        operations_binding(store),
    ]
