"""`PreprocessConfig`: the typed form of `meshline preprocess`'s flags (validated when built)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from models.templates import TEMPLATES
from models.tokenizer import TOKENIZER_TYPES
from services.preprocess.sharding import check_shard, shard_prefix

OUTPUT_FORMATS = ("mmap", "arrow")
DATASET_IMPLS = ("mmap",)


@dataclass(frozen=True)
class PreprocessConfig:
    """One preprocessing run; each field is a Megatron/ModelLink `tools/preprocess_data.py` flag."""

    input: tuple[str, ...] = ()
    """--input: files, directories or globs (.json/.jsonl/.jsonl.gz/.parquet/.arrow/.csv/.txt), a HF
    dataset saved with save_to_disk, or a datasets script/dir with --hf-datasets-params."""
    output_prefix: str = ""
    """--output-prefix: outputs are named `{prefix}_{key}_document.bin/.idx` (or Arrow shards), plus
    `{prefix}.manifest.json`."""
    tokenizer_type: str = "PretrainedFromHF"
    """--tokenizer-type: "PretrainedFromHF" (a local HF directory) or "SentencePiece"."""
    tokenizer_name_or_path: str | None = None
    """--tokenizer-name-or-path: the local HF tokenizer directory, no hub downloads (or a .model
    for SentencePiece)."""
    tokenizer_model: str | None = None
    """--tokenizer-model: the SentencePiece .model file."""
    tokenizer_not_use_fast: bool = False
    """--tokenizer-not-use-fast: load HF's slow (Python) tokenizer instead of the Rust one."""
    handler_name: str = "GeneralPretrainHandler"
    """--handler-name: a registered handler, an alias, or module:Class."""
    json_keys: tuple[str, ...] = ("text",)
    """--json-keys: record fields to tokenise for pretraining (one dataset each)."""
    append_eod: bool = False
    """--append-eod: end every pretraining document with the EOD id."""
    prompt_template: str | None = None
    """--prompt-template: override the instruction handler's template (see models/templates.py)."""
    workers: int = 1
    """--workers: tokeniser processes (1 = in the main process)."""
    chunk_size: int = 256
    """--chunk-size: records handed to a worker at a time."""
    log_interval: int = 10000
    """--log-interval: documents between progress log lines when not on a terminal."""
    dataset_impl: str = "mmap"
    """--dataset-impl: Megatron's on-disk format; only "mmap" exists (kept for old scripts)."""
    streaming: bool = False
    """--streaming: stream a HF dataset (local files are always read incrementally)."""
    hf_datasets_params: str | None = None
    """--hf-datasets-params: JSON file with name / split / streaming / data_files for a HF dataset."""
    hf_datasets_options: dict[str, Any] | None = None
    """Inline form of --hf-datasets-params (gRPC callers); takes precedence over the file."""
    seq_length: int | None = None
    """--seq-length: truncate instruction samples to this length; the pack size with --pack."""
    pack: bool = False
    """--pack: greedily group whole samples into documents of at most --seq-length tokens."""
    output_format: str = "mmap"
    """--output-format: "mmap" (Megatron .bin/.idx) or "arrow" (Arrow IPC shards)."""
    arrow_shard_mb: int = 256
    """--arrow-shard-mb: start a new Arrow shard past this many MiB."""
    skip_bad_records: bool = False
    """--skip-bad-records: skip and count malformed records instead of failing on the first."""
    max_bad_records: int | None = None
    """--max-bad-records: with --skip-bad-records, fail once more than this many were skipped."""
    overwrite: bool = False
    """--overwrite: replace existing outputs of the same prefix (otherwise refuse)."""
    num_shards: int = 1
    """--num-shards: split the sorted input files into this many contiguous, size-balanced shards
    (one per pod); a run writes one, under `{prefix}-shard-IIIII-of-NNNNN`."""
    shard_index: int = 0
    """--shard-index: which shard this run writes (0-based; default $JOB_COMPLETION_INDEX, set in
    every pod of a Kubernetes Indexed Job)."""

    def __post_init__(self) -> None:
        def fail(flag: str, message: str) -> None:
            raise ValueError(f"{flag}: {message}")

        if not self.input:
            fail("--input", "no input given; pass a file, directory or glob")
        if not self.output_prefix:
            fail("--output-prefix", "missing; pass e.g. data/corpus (outputs go beside it)")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            fail(
                "--tokenizer-type", f"{self.tokenizer_type!r} is not one of {list(TOKENIZER_TYPES)}"
            )
        if self.tokenizer_type == "SentencePiece" and not (
            self.tokenizer_model or self.tokenizer_name_or_path
        ):
            fail("--tokenizer-model", "SentencePiece needs the .model file")
        if self.tokenizer_type == "PretrainedFromHF" and not self.tokenizer_name_or_path:
            fail("--tokenizer-name-or-path", "PretrainedFromHF needs a local tokenizer directory")
        if not self.json_keys or any(not key for key in self.json_keys):
            fail("--json-keys", f"needs at least one non-empty key, got {list(self.json_keys)}")
        if self.prompt_template is not None and self.prompt_template not in TEMPLATES:
            fail(
                "--prompt-template",
                f"{self.prompt_template!r} is unknown; choose one of {sorted(TEMPLATES)}",
            )
        if self.workers < 1:
            fail("--workers", f"must be >= 1, got {self.workers}")
        if self.chunk_size < 1:
            fail("--chunk-size", f"must be >= 1, got {self.chunk_size}")
        if self.log_interval < 1:
            fail("--log-interval", f"must be >= 1, got {self.log_interval}")
        if self.dataset_impl not in DATASET_IMPLS:
            fail("--dataset-impl", f"{self.dataset_impl!r} is not supported; use 'mmap'")
        if self.seq_length is not None and self.seq_length < 1:
            fail("--seq-length", f"must be >= 1, got {self.seq_length}")
        if self.pack and self.seq_length is None:
            fail("--pack", "needs --seq-length (the size of a pack)")
        if self.output_format not in OUTPUT_FORMATS:
            fail("--output-format", f"{self.output_format!r} is not one of {list(OUTPUT_FORMATS)}")
        if self.arrow_shard_mb < 1:
            fail("--arrow-shard-mb", f"must be >= 1, got {self.arrow_shard_mb}")
        if self.hf_datasets_options is not None and not isinstance(self.hf_datasets_options, dict):
            fail("--hf-datasets-params", "inline options must be a mapping of name/split/...")
        check_shard(self.shard_index, self.num_shards)
        if self.max_bad_records is not None:
            if self.max_bad_records < 0:
                fail("--max-bad-records", f"must be >= 0, got {self.max_bad_records}")
            if not self.skip_bad_records:
                fail("--max-bad-records", "only applies with --skip-bad-records; add that flag")

    @property
    def shard_output_prefix(self) -> str:
        """Where this run's outputs go: --output-prefix, or its `-shard-I-of-N` form when sharded."""
        return shard_prefix(self.output_prefix, self.shard_index, self.num_shards)

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer file/directory for the chosen type."""
        if self.tokenizer_type == "SentencePiece":
            return str(self.tokenizer_model or self.tokenizer_name_or_path)
        return str(self.tokenizer_name_or_path)

    def hf_params(self) -> dict[str, Any] | None:
        """Parsed --hf-datasets-params (with --streaming folded in), or None."""
        if self.hf_datasets_options is not None:
            params = dict(self.hf_datasets_options)
            if self.streaming:
                params["streaming"] = True
            return params
        if self.hf_datasets_params is None:
            return {"streaming": True} if self.streaming and self._input_is_script() else None
        path = Path(self.hf_datasets_params)
        try:
            params = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"--hf-datasets-params {path}: cannot read a JSON object ({exc}); "
                'write e.g. {"name": "default", "split": "train", "streaming": true}'
            ) from exc
        if not isinstance(params, dict):
            raise ValueError(f"--hf-datasets-params {path}: must hold a JSON object")
        if self.streaming:
            params["streaming"] = True
        return params

    def _input_is_script(self) -> bool:
        return len(self.input) == 1 and self.input[0].endswith(".py")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (for the manifest)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in fields(self)
        }
