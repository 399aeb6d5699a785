"""`run_preprocess`: one preprocessing job from config to published, manifest-described outputs.

Called by `meshline preprocess` and by the gRPC servicer. Everything is written inside a hidden
staging directory next to the outputs and moved into place only when complete, the manifest
last; an error, a cancellation or a kill leaves no file under a final name (an interrupted run
leaves at most a hidden `.{name}.partial-*` directory, removed by the next job for the same
output or the next service start: `staging`).
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.common.paths import resolve_under_roots
from services.common.safe_fs import open_dir
from services.preprocess import provenance, staging
from services.preprocess.arrow_sink import ArrowSink
from services.preprocess.handlers import Handler, HandlerOptions, get_handler_class
from services.preprocess.handlers.base import output_keys_of
from services.preprocess.job_config import PreprocessConfig
from services.preprocess.manifest import (
    MANIFEST_SUFFIX,
    build_manifest,
    file_entry,
    manifest_path,
    read_manifest,
    write_manifest,
)
from services.preprocess.outputs import (
    Document,
    MmapSink,
    OutputShard,
    Packer,
    Sink,
    dataset_dtype,
)
from services.preprocess.progress import Progress, ProgressPrinter
from services.preprocess.readers import (
    InputPlan,
    Record,
    input_fingerprints,
    read_records,
    resolve_input,
)
from services.preprocess.sharding import shard_plans, shard_range
from services.preprocess.workers import OrderedWorkers, WorkerSpec, build_handler, chunked

__all__ = [
    "PreprocessCancelled",
    "PreprocessConfig",
    "PreprocessResult",
    "Progress",
    "run_preprocess",
]

_MAX_BAD_EXAMPLES = 20


class PreprocessCancelled(Exception):
    """The job was cancelled; nothing was published."""


@dataclass
class PreprocessResult:
    """What a finished run produced (mirrors meshline.preprocess.v1.PreprocessResult)."""

    outputs: list[OutputShard] = field(default_factory=list)
    """The published datasets (final paths)."""
    manifest_path: str = ""
    """The run's manifest."""
    documents: int = 0
    """Documents written (packs, with --pack)."""
    tokens: int = 0
    """Tokens written (of the first output key)."""
    bytes_read: int = 0
    """Input bytes read."""
    skipped_records: int = 0
    """Malformed records skipped."""
    dropped_records: int = 0
    """Records that produced no tokens."""
    elapsed_seconds: float = 0.0
    """Wall time of the run."""


def _check_output_dir(prefix: Path) -> Path:
    directory = prefix.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--output-prefix {prefix}: cannot create directory {directory} ({exc.strerror}); "
            "choose a writable location"
        ) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"--output-prefix {prefix}: directory {directory} is not writable; "
            "choose a writable location or fix its permissions"
        )
    return directory


def _existing_outputs(prefix: Path, keys: tuple[str, ...]) -> list[Path]:
    """Files of an earlier run under this prefix: its manifest and the names this run writes.

    Only exact names count (not every `{prefix}_*`), so a sibling run such as `{prefix}_v2` is
    never mistaken for ours, nor deleted by --overwrite.
    """
    directory, name = prefix.parent, prefix.name
    found = [manifest_path(prefix)]
    for key in keys:
        found += [directory / f"{name}_{key}_document{suffix}" for suffix in (".bin", ".idx")]
        found += directory.glob(
            f"{glob.escape(name)}_{key}_document-[0-9][0-9][0-9][0-9][0-9].arrow"
        )
    for arrow_set in ("packed", "pairs"):
        found += directory.glob(f"{glob.escape(name)}_{arrow_set}-[0-9][0-9][0-9][0-9][0-9].arrow")
    try:
        old = read_manifest(manifest_path(prefix))
        found += [directory / f["name"] for out in old["outputs"] for f in out["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no earlier manifest, or not ours: only the exact names above count
    return sorted({p for p in found if p.is_file()})


def existing_outputs(config: PreprocessConfig) -> list[Path]:
    """Files an earlier run left under `config.output_prefix` (what --overwrite would replace).

    Needs no tokenizer: the dataset keys follow from the handler class and --json-keys.
    """
    handler_class = get_handler_class(config.handler_name)
    return _existing_outputs(
        Path(config.shard_output_prefix), output_keys_of(handler_class, config.json_keys)
    )


def _records(plans: list[InputPlan], progress: Progress) -> Iterator[Record]:
    """Records of every plan, keeping the byte/file counters current."""
    done_bytes = 0
    for plan in plans:
        if plan.hf_dataset is not None:
            yield from read_records(plan)
            continue
        for path in plan.files:
            for record in read_records(InputPlan(files=(path,))):
                progress.bytes_read += record.size
                yield record
            done_bytes += path.stat().st_size
            progress.bytes_read = done_bytes
            progress.input_files_done += 1


class _BadRecords:
    """Fail-fast or skip-and-count policy for malformed records."""

    def __init__(self, config: PreprocessConfig) -> None:
        self.skip = config.skip_bad_records
        self.limit = config.max_bad_records
        self.examples: list[dict[str, str]] = []
        self.count = 0

    def __call__(self, location: str, error: str) -> None:
        if not self.skip:
            raise ValueError(f"{location}: {error}; fix the record or pass --skip-bad-records")
        self.count += 1
        if len(self.examples) < _MAX_BAD_EXAMPLES:
            self.examples.append({"location": location, "error": error})
        if self.limit is not None and self.count > self.limit:
            raise ValueError(
                f"--max-bad-records {self.limit}: more malformed records than allowed (the latest, "
                f"{location}: {error}); fix the input or raise the limit"
            )


def _make_sink(config: PreprocessConfig, stage_prefix: Path, handler: Handler) -> Sink:
    keys = handler.output_keys()
    vocab = handler.tokenizer.vocab_size
    if config.output_format == "arrow":
        metadata = {"handler": handler.describe(), "vocab_size": vocab, "pack": config.pack}
        return ArrowSink(stage_prefix, keys, metadata, shard_bytes=config.arrow_shard_mb << 20)
    return MmapSink(stage_prefix, keys, vocab)


def _publish(
    shards: list[OutputShard], stage: staging.Stage, directory: Path, replaced: list[Path]
) -> None:
    # The old manifest goes first: it must never describe a mix of old and new files.
    for old in sorted(replaced, key=lambda p: not p.name.endswith(MANIFEST_SUFFIX)):
        stage.remove_output(old.name)
    for shard in shards:
        # The index last: a reader keys on `.idx`, which must never precede its `.bin`.
        for name in sorted(shard.files, key=lambda n: n.endswith(".idx")):
            stage.publish(name)
        shard.files = [str(directory / name) for name in shard.files]
        shard.path_prefix = str(directory / shard.path_prefix)


def _worker_spec(config: PreprocessConfig) -> WorkerSpec:
    return WorkerSpec(
        tokenizer_type=config.tokenizer_type,
        tokenizer_path=config.tokenizer_path,
        use_fast=not config.tokenizer_not_use_fast,
        handler_name=config.handler_name,
        options=_handler_options(config),
    )


def _check_handler_and_outputs(
    config: PreprocessConfig, handler: Handler, prefix: Path
) -> list[Path]:
    """Refuse --pack for pairs and existing outputs without --overwrite; returns the outputs a
    run would replace."""
    if handler.is_pairwise and config.pack:
        raise ValueError(
            f"--pack with --handler-name {config.handler_name}: preference pairs are not packed "
            "(each row is one pair); drop --pack"
        )
    existing = _existing_outputs(prefix, handler.output_keys())
    if existing and not config.overwrite:
        raise ValueError(
            f"--output-prefix {prefix}: outputs already exist ({existing[0].name}, ...); "
            "pass --overwrite or choose another prefix"
        )
    return existing


def _tokenize(
    config: PreprocessConfig,
    spec: WorkerSpec,
    plans: list[InputPlan],
    sink: Sink,
    first_key: str,
    progress: Progress,
    printer: ProgressPrinter,
    bad: _BadRecords,
    on_progress: Callable[[Progress], None] | None,
    cancel: threading.Event | None,
) -> None:
    """Run the records through the workers in order, packing and writing each document."""
    prefix = Path(config.shard_output_prefix)
    packer = Packer(config.seq_length if config.pack else None)

    def emit(documents: list[Document]) -> None:
        for arrays, lengths in documents:
            sink.add(arrays, lengths)
            progress.documents += 1
            progress.tokens += int(arrays[first_key].size)

    with OrderedWorkers(spec, config.workers) as pool:
        for outcomes in pool.run(chunked(_records(plans, progress), config.chunk_size)):
            if cancel is not None and cancel.is_set():
                raise PreprocessCancelled(f"preprocess of {prefix} cancelled")
            for outcome in outcomes:
                progress.records += 1
                if outcome.error is not None:
                    bad(outcome.location, outcome.error)
                    progress.skipped_records = bad.count
                elif outcome.arrays is None:
                    progress.dropped_records += 1
                else:
                    emit(packer.add(outcome.arrays))
            printer.update(progress)
            if on_progress is not None:
                on_progress(progress)
    emit(packer.flush())
    if cancel is not None and cancel.is_set():
        raise PreprocessCancelled(f"preprocess of {prefix} cancelled")


def _check_wrote_something(config: PreprocessConfig, progress: Progress) -> None:
    # A shard of a sharded mmap run may hold no documents (say, only empty files): it writes
    # an empty dataset, which adds nothing to the merge, instead of failing the whole job.
    empty_shard_ok = config.num_shards > 1 and config.output_format == "mmap"
    if progress.records == 0 and not empty_shard_ok:
        raise ValueError(
            f"--input {' '.join(config.input)}: no records found (empty input); "
            "point --input at data with at least one record"
        )
    if progress.documents == 0 and not empty_shard_ok:
        raise ValueError(
            f"--input {' '.join(config.input)}: all {progress.records} records were skipped or "
            f"empty, nothing to write; check --json-keys {list(config.json_keys)} and "
            f"--handler-name {config.handler_name}"
        )


def run_preprocess(
    config: PreprocessConfig,
    on_progress: Callable[[Progress], None] | None = None,
    cancel: threading.Event | None = None,
    *,
    roots: Sequence[Path] = (),
) -> PreprocessResult:
    """Tokenise `config.input` into shards under `config.output_prefix`; see the module docstring.

    Raises ValueError with a one-line, actionable message for bad input, and PreprocessCancelled
    when `cancel` is set; in both cases nothing is published. With `roots` (a service's data
    roots) the output directory is re-checked when the staging directory is made and right
    before publishing: one swapped for a symlink leaving the roots is PermissionDenied, and
    nothing outside is written, replaced or deleted.
    """
    started = time.monotonic()
    prefix = Path(config.shard_output_prefix)
    if roots:
        resolve_under_roots(str(prefix.parent), roots, "output_prefix")
        open_dir(prefix.parent, roots, "output_prefix", create=True).close()  # no mkdir via a link
    directory = _check_output_dir(prefix)
    resolved = [resolve_input(spec, config.hf_params()) for spec in config.input]
    plans = shard_plans(resolved, config.shard_index, config.num_shards)
    spec = _worker_spec(config)
    handler = build_handler(spec)
    existing = _check_handler_and_outputs(config, handler, prefix)
    progress = Progress(input_files_total=sum(len(plan.files) for plan in plans))
    printer = ProgressPrinter(config.log_interval)
    bad = _BadRecords(config)
    # The output directory is opened beneath its root here, once: staging, publishing and
    # clean-up go through that descriptor, never through the path again.
    stage = staging.create(directory, prefix.name, roots)
    sink: Sink | None = None
    try:
        sink = _make_sink(config, stage.path / prefix.name, handler)
        first_key = handler.output_keys()[0]
        _tokenize(config, spec, plans, sink, first_key, progress, printer, bad, on_progress, cancel)
        _check_wrote_something(config, progress)
        shards = sink.finalize()
        outputs = _output_entries(shards, stage.path, handler)
        result = PreprocessResult(
            documents=progress.documents,
            tokens=progress.tokens,
            bytes_read=progress.bytes_read,
            skipped_records=bad.count,
            dropped_records=progress.dropped_records,
        )
        _publish(shards, stage, directory, existing)
        result.outputs = shards
        result.elapsed_seconds = time.monotonic() - started
        counts = {**progress.snapshot(), "elapsed_seconds": result.elapsed_seconds}
        document = build_manifest(
            config=config.to_dict(),
            inputs=_input_entries(plans),
            tokenizer=handler.tokenizer.describe(),
            handler=handler.describe(),
            outputs=outputs,
            counts=counts,
            bad_records=bad.examples,
            shard=_shard_entry(config, resolved),
            provenance=_provenance(config, resolved, handler),
        )
        write_manifest(document, stage.path / manifest_path(prefix).name)
        stage.publish(manifest_path(prefix).name)
        result.manifest_path = str(manifest_path(prefix))
        printer.finish(progress)
        return result
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    finally:
        staging.release(stage)


def _handler_options(config: PreprocessConfig) -> HandlerOptions:
    return HandlerOptions(
        json_keys=tuple(config.json_keys),
        append_eod=config.append_eod,
        seq_length=config.seq_length,
        prompt_template=config.prompt_template,
    )


def _shard_entry(config: PreprocessConfig, resolved: list[InputPlan]) -> dict[str, Any] | None:
    """Which part of the whole input this run read (None for an unsharded run)."""
    if config.num_shards == 1:
        return None
    start, stop = shard_range(resolved, config.shard_index, config.num_shards)
    return {
        "index": config.shard_index,
        "num_shards": config.num_shards,
        "output_prefix": config.output_prefix,
        "input_files": [start, stop],
        "input_files_total": sum(len(plan.files) for plan in resolved),
        "input_bytes_total": sum(plan.total_bytes() for plan in resolved),
    }


def _provenance(
    config: PreprocessConfig, resolved: list[InputPlan], handler: Handler
) -> dict[str, Any]:
    """The manifest's provenance block (what `meshline preprocess merge` checks)."""
    identity = provenance.RunIdentity(
        output_prefix=config.output_prefix,
        num_shards=config.num_shards,
        tokenizer=handler.tokenizer.describe(),
        handler=handler.describe(),
        options=_handler_options(config),
    )
    span = None
    if config.num_shards > 1:
        span = shard_range(resolved, config.shard_index, config.num_shards)
    return provenance.build(identity, resolved, config.shard_index, span)


def _input_entries(plans: list[InputPlan]) -> list[dict[str, Any]]:
    return [entry for plan in plans for entry in input_fingerprints(plan)]


def _output_entries(
    shards: list[OutputShard], stage: Path, handler: Handler
) -> list[dict[str, Any]]:
    entries = []
    for shard in shards:
        entry = asdict(shard)
        entry["files"] = [file_entry(stage / name) for name in shard.files]
        entry["dtype"] = dataset_dtype(shard.json_key, handler.tokenizer.vocab_size).name
        entries.append(entry)
    return entries
