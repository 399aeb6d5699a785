"""Legacy on-disk records of operations (one JSON file each), read once into the state database.

Servers before `state_db` kept one JSON file per operation in --state-dir; a server started on
such a directory imports them (`OperationsStore`). A record held the operation twice: readable (protobuf JSON, for people and tools) and as base64
binary, which is what loading uses, so that a record whose metadata/response types are not
imported in the loading process still round-trips exactly.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

from google.protobuf.message import DecodeError

from meshline.common.v1 import operations_pb2

logger = logging.getLogger(__name__)

RECORD_FORMAT = "meshline.operation.v1"
_TMP_PREFIX = ".tmp-"


def record_path(state_dir: Path, name: str) -> Path:
    """Where operation `name` ("operations/train-2f1c9a") is recorded."""
    return state_dir / f"{name.rsplit('/', 1)[-1]}.json"


def read_records(state_dir: Path) -> list[operations_pb2.Operation]:
    """Every readable record in `state_dir`; unreadable ones are logged and skipped.

    Temporary files left by an interrupted write are removed: the previous record they were
    replacing is still in place.
    """
    operations = []
    for tmp in state_dir.glob(f"{_TMP_PREFIX}*"):
        tmp.unlink(missing_ok=True)
    for path in sorted(state_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            if record.get("format") != RECORD_FORMAT:
                raise ValueError(f"format is {record.get('format')!r}, expected {RECORD_FORMAT!r}")
            operation = operations_pb2.Operation.FromString(base64.b64decode(record["binary"]))
            if record_path(state_dir, operation.name) != path:
                raise ValueError(f"holds operation {operation.name!r}, not the one its name says")
        except (OSError, ValueError, KeyError, TypeError, DecodeError) as exc:
            logger.warning("skipping unreadable operation record %s: %s", path, exc)
            continue
        operations.append(operation)
    return operations
