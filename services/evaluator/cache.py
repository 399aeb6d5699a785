"""Per-request response cache: an interrupted evaluation resumes where it stopped.

One JSON-lines file per task under `{output}/cache/{model fingerprint}/`, one line per answered
request (`{"key": sha256 of the request, "response": ...}`), appended and flushed after every
batch. A torn last line (the process died mid-write) is ignored on reading.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from checkpoints.safe_fs import open_dir_beneath

CACHE_VERSION = 2
"""Bumped when the meaning of a cached answer changes (e.g. tokenisation rules), so that old
answers are not reused."""


def request_key(kind: str, arguments: Any) -> str:
    """Stable key of one request."""
    blob = json.dumps([kind, arguments], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """Answers already computed for one task and model."""

    def __init__(self, root: Path, fingerprint: str, task: str) -> None:
        key = f"v{CACHE_VERSION}|{fingerprint}"
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
        self.path = root / digest / f"{task}.jsonl"
        # Opened once beneath the data root (`MESHLINE_DATA_ROOTS`, else the path as it resolves
        # now): appends go through this descriptor, never through a folder swapped later.
        self._dir = open_dir_beneath(self.path.parent, create=True)
        self._name = self.path.name
        self._answers: dict[str, Any] = {}
        if self._dir.lstat(self._name) is not None:
            with self._dir.fdopen(self._name, encoding="utf-8") as fh:
                text = fh.read()
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self._answers[record["key"]] = record["response"]

    def __contains__(self, key: str) -> bool:
        return key in self._answers

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: str) -> Any:
        """The cached response of `key`."""
        return self._answers[key]

    def close(self) -> None:
        """Closes the cache folder's descriptor (answers stay readable with `get`)."""
        self._dir.close()

    def add(self, pairs: list[tuple[str, Any]]) -> None:
        """Record responses and flush them to disk."""
        with self._dir.fdopen(self._name, "a", encoding="utf-8") as fh:
            for key, response in pairs:
                self._answers[key] = response
                fh.write(json.dumps({"key": key, "response": response}, ensure_ascii=False) + "\n")
            fh.flush()
