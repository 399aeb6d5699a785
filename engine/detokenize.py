"""Incremental text of a generated sequence: stop strings and what a stream may emit so far.

The whole new-token list is decoded at each step (tokenizers join pieces differently at word
boundaries, so per-token decoding would drift). Text is held back while it ends in an incomplete
UTF-8 character (U+FFFD) or in a prefix of a stop string, so a stream never emits text that the
final result later drops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextTracker:
    """Decoded text of one sequence and the part of it already emitted."""

    def __init__(self, decode: Callable[[Sequence[int]], str] | None, stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self.emitted = ""

    def stop_index(self, token_ids: Sequence[int]) -> int | None:
        """Where the earliest stop string starts in the text of `token_ids` (None: no match)."""
        if self._decode is None or not self._stop:
            return None
        text = self._decode(token_ids)
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def update(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Text to emit after the sequence became `token_ids`, and whether a stop string matched.

        On a match the text is cut before the stop string; `final` flushes everything held.
        """
        if self._decode is None:
            return "", False
        text = self._decode(token_ids)
        cut = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        matched = bool(cut)
        if matched:
            text = text[: min(cut)]
        elif not final:
            text = text[: len(text) - self._held_back(text)]
        if not text.startswith(self.emitted):
            # The tokenizer re-joined earlier pieces differently; keep the stream append-only.
            text = self.emitted + text[len(self.emitted) :]
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta, matched

    def _held_back(self, text: str) -> int:
        """Trailing characters that may still change: a partial character or stop-string prefix."""
        held = 0
        if text.endswith(REPLACEMENT):
            held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    held = max(held, k)
                    break
        return held
