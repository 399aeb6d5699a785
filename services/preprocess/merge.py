"""`merge_preprocessed`: join finished `meshline preprocess` outputs into one dataset per key.

Megatron's `tools/merge_datasets.py` behaviour: for every output key the parts' `.bin` files are
concatenated in the order given, sequence lengths are appended, byte offsets recomputed and
document indices shifted by the sequences before them; all parts must share one dtype. Merging
the shards of a sharded run (`--num-shards N`) in index order therefore gives `.bin/.idx` files
byte-identical to one process over the same inputs.

Each part must be a finished run (its manifest present); before merging, every part's files are
checked against the sizes and sha256 in its manifest, and the parts must agree on tokenizer,
handler, output keys and dtypes. The shards of a sharded run must add up: all present, in
order, computed over the same input state by the same run (`provenance.check_runs`, naming the
shard and the provenance field that differs). The merged manifest lists every part (prefix, shard index,
inputs, counts, file checksums). Outputs are staged and published like `run_preprocess`'s: the
manifest last, nothing under a final name on error.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.preprocess import staging
from services.preprocess.manifest import (
    build_manifest,
    file_entry,
    manifest_path,
    read_manifest,
    write_manifest,
)
from services.preprocess.outputs import OutputShard
from services.preprocess.provenance import check_runs
from tokendata.indexed import IndexedDatasetWriter, bin_path, idx_path

_COUNTS = ("records", "documents", "tokens", "bytes_read", "skipped_records", "dropped_records")
_MAX_BAD_EXAMPLES = 20
# Flags that change the tokens written; parts of one merge must agree on them.
_TOKEN_FLAGS = ("json_keys", "append_eod", "seq_length", "pack", "prompt_template")
_DIFFER = {
    "tokenizer": "tokenizer differs",
    "handler": "handler differs",
    "flags": "token flags (--json-keys, --append-eod, ...) differ",
}


@dataclass
class MergeResult:
    """What a merge produced."""

    outputs: list[OutputShard] = field(default_factory=list)
    """The merged datasets (final paths)."""
    manifest_path: str = ""
    """The merged manifest."""
    parts: int = 0
    """Parts merged."""
    documents: int = 0
    """Documents of the first output key."""
    tokens: int = 0
    """Tokens of the first output key."""


@dataclass
class _Part:
    prefix: Path
    manifest: dict[str, Any]

    @property
    def outputs(self) -> dict[str, dict[str, Any]]:
        return {out["json_key"]: out for out in self.manifest["outputs"]}

    def dataset(self, key: str) -> Path:
        return self.prefix.parent / Path(self.outputs[key]["path_prefix"]).name


def expand_inputs(inputs: list[str]) -> list[str]:
    """A directory stands for every run prefix in it (`*.manifest.json`, sorted), as Megatron's."""
    prefixes: list[str] = []
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(path.glob("*.manifest.json"))
            if not found:
                raise ValueError(
                    f"--input {spec}: the directory holds no *.manifest.json; pass run prefixes "
                    "(the --output-prefix of each `meshline preprocess` run)"
                )
            prefixes += [str(p)[: -len(".manifest.json")] for p in found]
        else:
            prefixes.append(spec)
    return prefixes


def _load_part(spec: str) -> _Part:
    prefix = Path(spec)
    path = manifest_path(prefix)
    if not path.is_file():
        raise ValueError(
            f"--input {spec}: no manifest {path.name}; merge takes the --output-prefix of finished "
            "`meshline preprocess` runs (a run still going, or one that failed, has none)"
        )
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--input {spec}: cannot read {path.name} ({exc})") from exc
    part = _Part(prefix, manifest)
    if manifest["config"].get("output_format", "mmap") != "mmap":
        raise ValueError(
            f"--input {spec}: output format {manifest['config']['output_format']!r} cannot be "
            "merged; merge joins Megatron .bin/.idx (list Arrow shards as separate data paths)"
        )
    for out in manifest["outputs"]:
        directory = prefix.parent
        for entry in out["files"]:
            file = directory / entry["name"]
            if not file.is_file():
                raise ValueError(f"--input {spec}: {file} is missing; re-run that part")
            if file_entry(file) != entry:
                raise ValueError(
                    f"--input {spec}: {file.name} does not match the size/sha256 in its manifest "
                    "(changed after the run); re-run that part"
                )
    return part


def _identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """What must agree between parts: tokenizer (by content, not path), handler, token flags."""
    config = manifest["config"]
    if "merge" in config:  # a merged dataset carries the flags of its parts
        config = config.get("parts_config", {})
    return {
        "tokenizer": {k: v for k, v in manifest["tokenizer"].items() if k != "path"},
        "handler": manifest["handler"],
        "flags": {k: config.get(k) for k in _TOKEN_FLAGS},
    }


def _check_compatible(parts: list[_Part]) -> None:
    first = parts[0]
    reference = _identity(first.manifest)
    for part in parts[1:]:
        identity = _identity(part.manifest)
        for what in ("tokenizer", "handler", "flags"):
            if identity[what] != reference[what]:
                raise ValueError(
                    f"--input {part.prefix}: {_DIFFER[what]} from --input {first.prefix} "
                    f"({json.dumps(identity[what], sort_keys=True)} vs "
                    f"{json.dumps(reference[what], sort_keys=True)}); merge only parts "
                    "tokenised the same way"
                )
        if list(part.outputs) != list(first.outputs):
            raise ValueError(
                f"--input {part.prefix}: output keys {list(part.outputs)} differ from "
                f"{list(first.outputs)} of --input {first.prefix}; use the same --json-keys"
            )
        for key, out in part.outputs.items():
            if out["dtype"] != first.outputs[key]["dtype"]:
                raise ValueError(
                    f"--input {part.prefix}: dataset {key!r} has dtype {out['dtype']}, --input "
                    f"{first.prefix} has {first.outputs[key]['dtype']}; Megatron's merge needs "
                    "one dtype (re-tokenise with the same tokenizer)"
                )
    check_runs([(str(part.prefix), part.manifest) for part in parts])


def _existing(prefix: Path, keys: list[str]) -> list[Path]:
    names = [manifest_path(prefix)]
    for key in keys:
        names += [bin_path(f"{prefix}_{key}_document"), idx_path(f"{prefix}_{key}_document")]
    return [p for p in names if p.is_file()]


def _part_entry(part: _Part) -> dict[str, Any]:
    return {
        "prefix": str(part.prefix),
        "manifest": file_entry(manifest_path(part.prefix)),
        "shard": part.manifest.get("shard"),
        "provenance": part.manifest.get("provenance"),
        "inputs": part.manifest["inputs"],
        "counts": {k: part.manifest["counts"].get(k, 0) for k in _COUNTS},
        "outputs": [
            {k: out[k] for k in ("json_key", "documents", "tokens", "files", "dtype")}
            for out in part.manifest["outputs"]
        ],
    }


def _checked_parts(inputs: list[str], prefix: Path) -> tuple[list[str], list[_Part]]:
    """The expanded input specs and their loaded, mutually compatible runs."""
    specs = expand_inputs(inputs)
    if not specs:
        raise ValueError("--input: nothing to merge; pass the prefixes of finished runs")
    for spec in specs:
        if Path(spec).resolve() == prefix.resolve():
            raise ValueError(f"--input {spec}: is the --output-prefix itself; choose another")
    parts = [_load_part(spec) for spec in specs]
    _check_compatible(parts)
    return specs, parts


def _merge_key(
    key: str, parts: list[_Part], stage_dir: Path, name: str, writers: list[IndexedDatasetWriter]
) -> tuple[OutputShard, dict[str, Any]]:
    """Concatenate every part's `key` dataset into one staged shard; (shard, manifest entry).
    The writer is appended to `writers` first, so a failure can abort it."""
    dtype = parts[0].outputs[key]["dtype"]
    writer = IndexedDatasetWriter(stage_dir / f"{name}_{key}_document", dtype)
    writers.append(writer)
    for part in parts:
        writer.add_index(part.dataset(key))
    bin_file, idx_file = writer.finalize()
    shard = OutputShard(
        json_key=key,
        path_prefix=f"{name}_{key}_document",
        files=[bin_file.name, idx_file.name],
        documents=writer.num_documents,
        tokens=writer.num_tokens,
    )
    entry = asdict(shard)
    entry["files"] = [file_entry(stage_dir / file) for file in shard.files]
    entry["dtype"] = dtype
    return shard, entry


def _merged_manifest(
    specs: list[str], output_prefix: str, parts: list[_Part], entries: list[dict[str, Any]]
) -> dict[str, Any]:
    counts = {k: sum(p.manifest["counts"].get(k, 0) for p in parts) for k in _COUNTS}
    document = build_manifest(
        config={
            "merge": {"inputs": specs, "output_prefix": output_prefix},
            "parts_config": _identity(parts[0].manifest)["flags"],
        },
        inputs=[entry for part in parts for entry in part.manifest["inputs"]],
        tokenizer=parts[0].manifest["tokenizer"],
        handler=parts[0].manifest["handler"],
        outputs=entries,
        counts=counts,
        bad_records=[b for p in parts for b in p.manifest["bad_records"]][:_MAX_BAD_EXAMPLES],
    )
    document["parts"] = [_part_entry(part) for part in parts]
    return document


def _publish_merged(
    stage: staging.Stage, prefix: Path, shards: list[OutputShard], existing: list[Path]
) -> None:
    """Replace the old outputs (manifest first) with the staged shards (each index last)."""
    for old in sorted(existing, key=lambda p: not p.name.endswith(".manifest.json")):
        stage.remove_output(old.name)
    for shard in shards:
        for name in sorted(shard.files, key=lambda n: n.endswith(".idx")):
            stage.publish(name)
        shard.files = [str(prefix.parent / name) for name in shard.files]
        shard.path_prefix = str(prefix.parent / shard.path_prefix)


def merge_preprocessed(
    inputs: list[str], output_prefix: str, *, overwrite: bool = False
) -> MergeResult:
    """Merge the runs under `inputs` (prefixes or directories, in order) into `output_prefix`."""
    prefix = Path(output_prefix)
    specs, parts = _checked_parts(inputs, prefix)
    keys = list(parts[0].outputs)
    existing = _existing(prefix, keys)
    if existing and not overwrite:
        raise ValueError(
            f"--output-prefix {prefix}: outputs already exist ({existing[0].name}, ...); "
            "pass --overwrite or choose another prefix"
        )
    # Staged, published and cleaned up through the output directory opened once (safe_fs).
    stage = staging.create(prefix.parent, prefix.name)
    writers: list[IndexedDatasetWriter] = []
    try:
        shards, entries = [], []
        for key in keys:
            shard, entry = _merge_key(key, parts, stage.path, prefix.name, writers)
            shards.append(shard)
            entries.append(entry)
        document = _merged_manifest(specs, output_prefix, parts, entries)
        _publish_merged(stage, prefix, shards, existing)
        write_manifest(document, stage.path / manifest_path(prefix).name)
        stage.publish(manifest_path(prefix).name)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        staging.release(stage)
    return MergeResult(
        outputs=shards,
        manifest_path=str(manifest_path(prefix)),
        parts=len(parts),
        documents=shards[0].documents,
        tokens=shards[0].tokens,
    )
