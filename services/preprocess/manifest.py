"""The JSON manifest written beside a run's outputs: `{output_prefix}.manifest.json`.

It records what went in (inputs with sizes and sha256), how (tokenizer identity, handler,
flags, tool version), and what came out (datasets with files, sizes, sha256, document and token
counts, skipped records with the first few reasons). It is published last, so its presence means
every listed output is complete.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "meshline.preprocess.manifest/v1"


def manifest_path(output_prefix: str | os.PathLike[str]) -> Path:
    """Where the manifest of `output_prefix` lives."""
    return Path(f"{os.fspath(output_prefix)}{MANIFEST_SUFFIX}")


def tool_version() -> str:
    """Installed meshline version ("unknown" when run from a bare checkout)."""
    try:
        return metadata.version("meshline")
    except metadata.PackageNotFoundError:
        return "unknown"


def file_entry(path: Path) -> dict[str, Any]:
    """Name, size and sha256 of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def build_manifest(
    *,
    config: dict[str, Any],
    inputs: list[dict[str, Any]],
    tokenizer: dict[str, Any],
    handler: dict[str, Any],
    outputs: list[dict[str, Any]],
    counts: dict[str, Any],
    bad_records: list[dict[str, str]],
    shard: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest document (all arguments already JSON-safe); `shard` only for a sharded run."""
    document = {
        "format": MANIFEST_FORMAT,
        "tool": {"name": "meshline preprocess", "version": tool_version()},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "inputs": inputs,
        "tokenizer": tokenizer,
        "handler": handler,
        "outputs": outputs,
        "counts": counts,
        "bad_records": bad_records,
    }
    if shard is not None:
        document["shard"] = shard
    if provenance is not None:
        document["provenance"] = provenance
    return document


def write_manifest(document: dict[str, Any], path: Path) -> Path:
    """Write `document` to `path` atomically (temporary name, fsync, rename)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    return path


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a manifest (ValueError when it is not one)."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    if document.get("format") != MANIFEST_FORMAT:
        raise ValueError(
            f"{path} is not a meshline preprocess manifest (format {document.get('format')!r})"
        )
    return document
