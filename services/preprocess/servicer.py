"""PreprocessService: validates a StartPreprocess request completely, then runs the job.

Validation runs in the order a user fixes things: malformed fields (INVALID_ARGUMENT, all at
once), paths outside the data roots (PERMISSION_DENIED), inputs or tokenizer missing
(NOT_FOUND), outputs already there without `overwrite` (FAILED_PRECONDITION), another running
job writing the same prefix (ABORTED). The job is `services.preprocess.job.run_preprocess` in a
worker thread, reporting PreprocessMetadata as progress and a PreprocessResult when done.
"""

from __future__ import annotations

import dataclasses
import glob
import re
from pathlib import Path
from typing import Any

import grpc

from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from services.common.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Validator,
    invalid_argument_from,
)
from services.common.field_checks import check_range
from services.common.jobs import JobRunner
from services.common.operation_jobs import OperationHandle
from services.common.operations import OperationsStore
from services.common.operations_servicer import operations_binding
from services.common.paths import resolve_under_roots
from services.common.server import ServiceBinding
from services.preprocess import staging
from services.preprocess.config import PreprocessServiceConfig
from services.preprocess.handlers import handler_choices
from services.preprocess.job import (
    PreprocessCancelled,
    PreprocessResult,
    Progress,
    existing_outputs,
    run_preprocess,
)
from services.preprocess.job_config import PreprocessConfig
from services.preprocess.readers import HF_BUILDERS, resolve_input

SERVICE_NAME = preprocess_pb2.DESCRIPTOR.services_by_name["PreprocessService"].full_name
JOB_KIND = "preprocess"
_JSON_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_MAX_SEQ_LENGTH = 1 << 20
_MAX_SHARDS = 100_000  # shard names carry 5 digits
# Files a finished job publishes beside its manifest (Megatron .bin/.idx or Arrow shards).
OUTPUT_SUFFIXES = (".bin", ".idx", ".arrow")
TokenizerType = preprocess_pb2.TokenizerType


def check_fields(
    request: preprocess_pb2.StartPreprocessRequest, config: PreprocessServiceConfig
) -> None:
    """Raises InvalidArgument naming every malformed field (no file system access)."""
    check = Validator()
    _check_input_fields(request, check)
    _check_tokenizer_fields(request, check)
    _check_record_fields(request, check)
    _check_size_fields(request, config, check)
    _check_shard_fields(request, check)
    check.raise_if_any()


def _check_input_fields(request: preprocess_pb2.StartPreprocessRequest, check: Validator) -> None:
    """Exactly one of input and hf_dataset, none empty; an output prefix that names files."""
    has_hf = request.HasField("hf_dataset")
    check.require(
        bool(request.input) != has_hf,
        "input",
        "give exactly one of input (files, directories, globs) and hf_dataset",
    )
    for i, spec in enumerate(request.input):
        check.require(bool(spec), f"input[{i}]", "must not be empty")
    if has_hf:
        check.require(bool(request.hf_dataset.path), "hf_dataset.path", "must not be empty")
    check.require(bool(request.output_prefix), "output_prefix", "must not be empty")
    check.require(
        not request.output_prefix.endswith("/"),
        "output_prefix",
        "must end in a file name prefix, e.g. /data/wiki/wiki (not a directory)",
    )


def _check_tokenizer_fields(
    request: preprocess_pb2.StartPreprocessRequest, check: Validator
) -> None:
    """A tokenizer type, and the fields that type needs (and only those)."""
    kind = request.tokenizer_type
    if kind == TokenizerType.TOKENIZER_TYPE_SENTENCEPIECE:
        check.require(
            bool(request.tokenizer_model), "tokenizer_model", "required with SENTENCEPIECE"
        )
        check.require(
            not request.tokenizer_not_use_fast,
            "tokenizer_not_use_fast",
            "applies to PRETRAINED_FROM_HF tokenizers only",
        )
    elif kind == TokenizerType.TOKENIZER_TYPE_PRETRAINED_FROM_HF:
        check.require(
            bool(request.tokenizer_name_or_path),
            "tokenizer_name_or_path",
            "required with PRETRAINED_FROM_HF (a tokenizer directory on shared storage)",
        )
    else:
        check.require(False, "tokenizer_type", "set SENTENCEPIECE or PRETRAINED_FROM_HF")


def _check_record_fields(request: preprocess_pb2.StartPreprocessRequest, check: Validator) -> None:
    """A registered handler and distinct, well-formed record keys."""
    if request.handler_name:
        # Registry names only: `module:Class` would import code named by a remote caller.
        check.require(
            request.handler_name in handler_choices(),
            "handler_name",
            f"unknown handler {request.handler_name!r}; choose one of {handler_choices()}",
        )
    keys = list(request.json_keys)
    for i, key in enumerate(keys):
        check.require(
            _JSON_KEY.fullmatch(key) is not None,
            f"json_keys[{i}]",
            f"{key!r} is not a record key (letters, digits, _ . -)",
        )
    check.require(len(set(keys)) == len(keys), "json_keys", "keys must be distinct")


def _check_size_fields(
    request: preprocess_pb2.StartPreprocessRequest,
    config: PreprocessServiceConfig,
    check: Validator,
) -> None:
    """Workers, sequence length, output format, bad-record limit and log interval in range."""
    check_range(check, request, "workers", 1, config.max_workers, " (the server's --max-workers)")
    check_range(check, request, "seq_length", 1, _MAX_SEQ_LENGTH)
    check.require(
        not request.pack or request.HasField("seq_length"),
        "seq_length",
        "required with pack (the packed row length)",
    )
    check.require(
        request.output_format in preprocess_pb2.OutputFormat.values(),
        "output_format",
        f"unknown value {request.output_format}",
    )
    if request.HasField("max_bad_records"):
        check.require(request.max_bad_records >= 0, "max_bad_records", "must be >= 0")
        check.require(
            request.skip_bad_records, "max_bad_records", "only applies with skip_bad_records"
        )
    if request.HasField("log_interval"):
        check.require(request.log_interval >= 1, "log_interval", "must be >= 1")


def _check_shard_fields(request: preprocess_pb2.StartPreprocessRequest, check: Validator) -> None:
    """num_shards >= 1; shard_index in 0..num_shards-1, required when sharded (no env default)."""
    shards = request.num_shards if request.HasField("num_shards") else 1
    check.require(
        1 <= shards <= _MAX_SHARDS, "num_shards", f"must be in [1, {_MAX_SHARDS}], got {shards}"
    )
    if request.HasField("shard_index"):
        check.require(
            0 <= request.shard_index < max(shards, 1),
            "shard_index",
            f"{request.shard_index} is out of range for num_shards {shards}; "
            f"use 0..{max(shards, 1) - 1}",
        )
    else:
        check.require(shards <= 1, "shard_index", f"required with num_shards {shards}")


def _confined_files(spec: str, field: str, roots: tuple[Path, ...]) -> list[Path]:
    """Input files of one `input` entry, each confined to the roots; NotFound when none exist."""
    resolve_under_roots(spec, roots, field)
    if not glob.has_magic(spec) and not Path(spec).exists():
        raise NotFound(f"{field}: {spec!r} does not exist; give an existing file or directory")
    try:
        plan = resolve_input(spec)
    except ValueError as exc:
        if glob.has_magic(spec):
            raise NotFound(f"{field}: {exc}") from exc
        raise InvalidArgument(field, str(exc)) from exc
    # A directory or glob may reach outside the roots through a symlink below it.
    files = [resolve_under_roots(str(path), roots, field) for path in plan.files]
    if plan.hf_dataset is not None:
        files.append(resolve_under_roots(plan.hf_dataset, roots, field))
    return files


def check_paths(
    request: preprocess_pb2.StartPreprocessRequest, config: PreprocessServiceConfig
) -> None:
    """Confines every path to the data roots and checks inputs exist and outputs do not."""
    roots = config.data_roots
    for i, spec in enumerate(request.input):
        _confined_files(spec, f"input[{i}]", roots)
    if request.HasField("hf_dataset"):
        hf = request.hf_dataset
        if hf.path in HF_BUILDERS:
            if not hf.data_files:
                raise InvalidArgument(
                    "hf_dataset.data_files", f"required with the {hf.path!r} builder"
                )
        elif not resolve_under_roots(hf.path, roots, "hf_dataset.path").exists():
            raise NotFound(
                f"hf_dataset.path: {hf.path!r} does not exist (the servers have no hub access: "
                f"give a local dataset directory or one of the builders {sorted(HF_BUILDERS)})"
            )
        for i, spec in enumerate(hf.data_files):
            resolve_under_roots(spec, roots, f"hf_dataset.data_files[{i}]")
    if request.tokenizer_type == TokenizerType.TOKENIZER_TYPE_SENTENCEPIECE:
        model = resolve_under_roots(request.tokenizer_model, roots, "tokenizer_model")
        if not model.is_file():
            raise NotFound(f"tokenizer_model: {request.tokenizer_model!r} is not a file")
    else:
        tokenizer = resolve_under_roots(
            request.tokenizer_name_or_path, roots, "tokenizer_name_or_path"
        )
        if not tokenizer.is_dir():
            raise NotFound(
                f"tokenizer_name_or_path: {request.tokenizer_name_or_path!r} is not a directory "
                "(the servers have no hub access: give a local tokenizer directory)"
            )
    prefix = resolve_under_roots(request.output_prefix, roots, "output_prefix")
    if not prefix.parent.is_dir():
        raise NotFound(
            f"output_prefix: the directory {str(prefix.parent)!r} does not exist; create it first"
        )
    with invalid_argument_from(ValueError, field="handler_name"):
        existing = existing_outputs(job_config(request))
    if existing and not request.overwrite:
        raise FailedPrecondition(
            f"output_prefix: {len(existing)} output file(s) already exist (e.g. "
            f"{existing[0].name}); set overwrite=true to replace them or choose another prefix"
        )


def job_config(request: preprocess_pb2.StartPreprocessRequest) -> PreprocessConfig:
    """The library's PreprocessConfig for a validated request (field names are the flags')."""
    tokenizer_types = {
        TokenizerType.TOKENIZER_TYPE_SENTENCEPIECE: "SentencePiece",
        TokenizerType.TOKENIZER_TYPE_PRETRAINED_FROM_HF: "PretrainedFromHF",
    }
    optional = {
        name: getattr(request, name)
        for name in (
            "workers",
            "seq_length",
            "max_bad_records",
            "log_interval",
            "num_shards",
            "shard_index",
        )
        if request.HasField(name)
    }
    with invalid_argument_from(ValueError, field="request"):
        return PreprocessConfig(
            input=(request.hf_dataset.path,)
            if request.HasField("hf_dataset")
            else tuple(request.input),
            output_prefix=request.output_prefix,
            tokenizer_type=tokenizer_types[request.tokenizer_type],
            tokenizer_name_or_path=request.tokenizer_name_or_path or None,
            tokenizer_model=request.tokenizer_model or None,
            tokenizer_not_use_fast=request.tokenizer_not_use_fast,
            handler_name=request.handler_name or PreprocessConfig.handler_name,
            json_keys=tuple(request.json_keys) or PreprocessConfig.json_keys,
            append_eod=request.append_eod,
            streaming=request.streaming,
            pack=request.pack,
            output_format=(
                "arrow" if request.output_format == preprocess_pb2.OUTPUT_FORMAT_ARROW else "mmap"
            ),
            skip_bad_records=request.skip_bad_records,
            overwrite=request.overwrite,
            hf_datasets_options=_hf_options(request),
            **optional,
        )


def confined_job_config(
    request: preprocess_pb2.StartPreprocessRequest, roots: tuple[Path, ...]
) -> PreprocessConfig:
    """`job_config` with every path resolved under `roots`: what the job runs with.

    Local inputs become the resolved files they matched when the request was checked (a file
    added or swapped for a symlink later is not picked up); the output prefix and tokenizer are
    the resolved paths, not the requester's strings.
    """
    config = job_config(request)
    inputs: list[str] = []
    if request.HasField("hf_dataset"):
        inputs = list(config.input)
        if request.hf_dataset.path not in HF_BUILDERS:
            inputs = [str(resolve_under_roots(request.hf_dataset.path, roots, "hf_dataset.path"))]
    else:
        for i, spec in enumerate(request.input):
            plan = resolve_input(spec)
            if plan.hf_dataset is None:
                inputs += [str(path) for path in _confined_files(spec, f"input[{i}]", roots)]
            else:
                inputs.append(str(resolve_under_roots(spec, roots, f"input[{i}]")))

    def resolved(value: str | None, field: str) -> str | None:
        return str(resolve_under_roots(value, roots, field)) if value else None

    return dataclasses.replace(
        config,
        input=tuple(inputs),
        output_prefix=str(resolve_under_roots(config.output_prefix, roots, "output_prefix")),
        tokenizer_model=resolved(config.tokenizer_model, "tokenizer_model"),
        tokenizer_name_or_path=resolved(config.tokenizer_name_or_path, "tokenizer_name_or_path"),
    )


def _hf_options(request: preprocess_pb2.StartPreprocessRequest) -> dict[str, Any] | None:
    """`datasets.load_dataset` options of the request's hf_dataset (None without one)."""
    if not request.HasField("hf_dataset"):
        return None
    hf = request.hf_dataset
    options: dict[str, Any] = {"split": hf.split or "train"}
    if hf.name:
        options["name"] = hf.name
    if hf.data_files:
        options["data_files"] = list(hf.data_files)
    return options


def result_message(result: PreprocessResult) -> preprocess_pb2.PreprocessResult:
    """The proto form of the library's PreprocessResult."""
    return preprocess_pb2.PreprocessResult(
        outputs=[
            preprocess_pb2.OutputShard(
                json_key=shard.json_key,
                path_prefix=shard.path_prefix,
                files=list(shard.files),
                documents=shard.documents,
                tokens=shard.tokens,
            )
            for shard in result.outputs
        ],
        manifest_path=result.manifest_path,
        documents=result.documents,
        tokens=result.tokens,
        bytes_read=result.bytes_read,
        skipped_records=result.skipped_records,
        elapsed_seconds=result.elapsed_seconds,
    )


class PreprocessServicer(preprocess_pb2_grpc.PreprocessServiceServicer):
    """Runs preprocessing jobs as operations in `store`, one job per output prefix at a time."""

    def __init__(self, config: PreprocessServiceConfig, store: OperationsStore) -> None:
        self._config = config
        self._store = store
        self._jobs = JobRunner(store, JOB_KIND)

    async def StartPreprocess(
        self, request: preprocess_pb2.StartPreprocessRequest, context: grpc.aio.ServicerContext
    ) -> preprocess_pb2.StartPreprocessResponse:
        """Validates the request, then starts the job and returns its operation."""
        check_fields(request, self._config)
        check_paths(request, self._config)
        return self._start_job(request)

    def _start_job(
        self, request: preprocess_pb2.StartPreprocessRequest
    ) -> preprocess_pb2.StartPreprocessResponse:
        roots = self._config.data_roots
        config = confined_job_config(request, roots)

        def job(handle: OperationHandle) -> preprocess_pb2.PreprocessResult:
            return self._run(request, config, handle, roots)

        operation = self._jobs.start(
            preprocess_pb2.PreprocessMetadata(request=request),
            job,
            # The prefix this run writes: a sharded run's `-shard-I-of-N` prefix, so a plain run
            # on that very prefix is the same claim.
            output=Path(config.shard_output_prefix),
            field="output_prefix",
            path_noun="prefix",
        )
        return preprocess_pb2.StartPreprocessResponse(operation=operation)

    @staticmethod
    def _run(
        request: preprocess_pb2.StartPreprocessRequest,
        config: PreprocessConfig,
        handle: OperationHandle,
        roots: tuple[Path, ...],
    ) -> preprocess_pb2.PreprocessResult:
        def on_progress(progress: Progress) -> None:
            metadata = preprocess_pb2.PreprocessMetadata(
                request=request,
                documents=progress.documents,
                tokens=progress.tokens,
                bytes_read=progress.bytes_read,
                skipped_records=progress.skipped_records,
                input_files_done=progress.input_files_done,
                input_files_total=progress.input_files_total,
            )
            handle.progress(
                progress.documents,
                unit="documents",
                message=f"{progress.documents} documents, {progress.tokens} tokens",
                metadata=metadata,
            )

        try:
            result = run_preprocess(config, on_progress, handle.cancel_requested, roots=roots)
        except PreprocessCancelled as exc:
            raise Cancelled(str(exc)) from exc
        except ValueError as exc:
            # Bad data found while reading (a malformed record, an empty input).
            raise InvalidArgument("input", str(exc)) from exc
        return result_message(result)


def bindings(config: PreprocessServiceConfig, store: OperationsStore) -> list[ServiceBinding]:
    """The preprocess service and the OperationsService over the same store.

    Staging directories that killed jobs left under the data roots are removed first.
    """
    staging.sweep(config.data_roots)
    servicer = PreprocessServicer(config, store)
    return [
        ServiceBinding(
            SERVICE_NAME, servicer, preprocess_pb2_grpc.add_PreprocessServiceServicer_to_server
        ),
        operations_binding(store),
    ]
