"""Where a preprocess run's outputs came from, and the merge check that its parts belong together.

Every manifest carries a `provenance` block: the fingerprint of the *whole* resolved `--input`
set (each file's path, size and mtime, in reading order, hashed; a HF dataset by name and
parameters), the shard's index, count and file range in that set, hashes of the tokenizer's
identity (by content, not path) and of the handler with its options, and a run id derived from
all of them and the unsharded `--output-prefix`. The shards of one run, computed in separate
pods, therefore agree on every field but the index and range; a shard computed over a different
input state (a file added, removed, rewritten or listed twice), by another run, or with another
tokenizer or handler options does not.

`check_runs` is what `meshline preprocess merge` applies: the shards of each run must all be
present, once, in index order, agree on every provenance field, and their file ranges must tile
the input set exactly; otherwise it refuses, naming the shard (`--input PREFIX`) and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.preprocess.handlers.base import HandlerOptions
from services.preprocess.readers import InputPlan

PROVENANCE_FORMAT = "meshline.preprocess.provenance/v1"
# Fields every shard of one run must agree on, in the order they are checked (the first that
# differs is the one named).
RUN_FIELDS = (
    "format",
    "num_shards",
    "input_files_total",
    "input_bytes_total",
    "input_fingerprint",
    "tokenizer_sha256",
    "handler_sha256",
    "run_id",
)
_FIELD_MEANING = {
    "format": "made by another meshline version",
    "num_shards": "another --num-shards",
    "input_files_total": "another input file count (files added or removed between shards)",
    "input_bytes_total": "another input size (files changed between shards)",
    "input_fingerprint": "another input state (a file added, removed, rewritten or listed twice)",
    "tokenizer_sha256": "another tokenizer",
    "handler_sha256": "another handler or handler options",
    "run_id": "another run (another --output-prefix)",
}


def canonical_sha256(value: Any) -> str:
    """sha256 of `value` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def input_fingerprint(plans: Sequence[InputPlan]) -> tuple[str, int, int]:
    """(sha256, file count, bytes) of the whole resolved input set, in reading order."""
    entries: list[Any] = []
    total = 0
    for plan in plans:
        for path in plan.files:
            info = os.stat(path)
            entries.append([os.fspath(path), info.st_size, info.st_mtime_ns])
            total += info.st_size
        if plan.hf_dataset is not None:
            entries.append({"hf_dataset": plan.hf_dataset, "params": plan.hf_params})
    files = sum(len(plan.files) for plan in plans)
    return canonical_sha256(entries), files, total


@dataclass(frozen=True)
class RunIdentity:
    """What a preprocess run is, apart from which shard of it this is."""

    output_prefix: str
    """The unsharded --output-prefix (every shard of one run shares it)."""
    num_shards: int
    """--num-shards."""
    tokenizer: dict[str, Any]
    """The tokenizer's identity (`Tokenizer.describe()`; its path is left out of the hash)."""
    handler: dict[str, Any]
    """The handler's identity (`Handler.describe()`)."""
    options: HandlerOptions
    """The handler's options (json keys, EOD, sequence length, template)."""


def build(
    identity: RunIdentity,
    plans: Sequence[InputPlan],
    shard_index: int,
    input_range: tuple[int, int] | None,
) -> dict[str, Any]:
    """The manifest's `provenance` block for shard `shard_index` reading `input_range`."""
    fingerprint, files, size = input_fingerprint(plans)
    tokenizer = {k: v for k, v in identity.tokenizer.items() if k != "path"}
    record = {
        "format": PROVENANCE_FORMAT,
        "num_shards": identity.num_shards,
        "input_files_total": files,
        "input_bytes_total": size,
        "input_fingerprint": fingerprint,
        "tokenizer_sha256": canonical_sha256(tokenizer),
        "handler_sha256": canonical_sha256(
            {"handler": identity.handler, "options": asdict(identity.options)}
        ),
    }
    record["run_id"] = canonical_sha256({**record, "output_prefix": identity.output_prefix})[:16]
    record["shard_index"] = shard_index
    record["input_range"] = list(input_range) if input_range is not None else [0, files]
    return record


def _refuse(prefix: str, message: str) -> ValueError:
    return ValueError(f"--input {prefix}: {message}; merge only the shards of one run, all of them")


def check_runs(parts: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Refuses (ValueError naming the shard and field) sharded parts that do not add up.

    `parts` are (prefix, manifest) in merge order. Unsharded runs and merged datasets stand
    alone; the shards of a run (by the run's --output-prefix and --num-shards) must be complete,
    each once, consecutive, in index order, agree on every `RUN_FIELDS` field, and tile the
    input set.
    """
    runs: dict[tuple[str, int], list[tuple[int, str, dict[str, Any]]]] = {}
    for position, (prefix, manifest) in enumerate(parts):
        shard = manifest.get("shard")
        if not shard:
            continue
        provenance = manifest.get("provenance")
        if not isinstance(provenance, dict):
            raise _refuse(prefix, "the shard's manifest has no provenance (made by an older "
                          "meshline); re-run the shard")  # fmt: skip
        key = (str(shard.get("output_prefix")), int(shard.get("num_shards", 0)))
        provenance = {**provenance, "_inputs": len(manifest.get("inputs") or [])}
        runs.setdefault(key, []).append((position, prefix, provenance))
    for (run_prefix, num_shards), members in runs.items():
        first_prefix, reference = members[0][1], members[0][2]
        for _, prefix, provenance in members[1:]:
            for name in RUN_FIELDS:
                if provenance.get(name) != reference.get(name):
                    raise _refuse(
                        prefix,
                        f"provenance field {name!r} is {provenance.get(name)!r} where shard "
                        f"--input {first_prefix} has {reference.get(name)!r} "
                        f"({_FIELD_MEANING[name]})",
                    )
        indices = [p.get("shard_index") for _, _, p in members]
        positions = [position for position, _, _ in members]
        if indices != list(range(num_shards)):
            missing = sorted(set(range(num_shards)) - set(indices))
            raise ValueError(
                f"--input: shard indices {indices} are not 0..{num_shards - 1} in order for the "
                f"run {run_prefix!r}"
                + (f" (missing {missing})" if missing else "")
                + "; pass every shard of the run, in index order, to get the single-run result"
            )
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError(
                f"--input: the shards of run {run_prefix!r} are not consecutive (another part "
                "sits between them); list a run's shards together, in index order"
            )
        expected_start = 0
        for _, prefix, provenance in members:
            start, stop = provenance.get("input_range") or (None, None)
            if start != expected_start or not isinstance(stop, int) or stop <= start:
                raise _refuse(
                    prefix,
                    f"provenance field 'input_range' is {[start, stop]!r}, but the shards before "
                    f"it end at file {expected_start}: the ranges do not tile the input",
                )
            if provenance["_inputs"] != stop - start:
                raise _refuse(
                    prefix,
                    f"the manifest lists {provenance['_inputs']} input files for its "
                    f"'input_range' {[start, stop]!r}: the shard was not computed over that range",
                )
            expected_start = stop
        if expected_start != reference.get("input_files_total"):
            raise _refuse(
                members[-1][1],
                f"provenance field 'input_range' ends at file {expected_start} of "
                f"{reference.get('input_files_total')}: the shards do not cover the input",
            )
