"""`--speculative-config`: how a server drafts tokens for speculative decoding (torch-free).

The flag takes vLLM's JSON spelling, so a vLLM command line carries over:

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    --speculative-config '{"model": "/ckpt/draft", "num_speculative_tokens": 4}'

Every key is applied or refused by name; the draft model's directory is checked here, its
vocabulary when it is loaded (engine/speculative.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLAG = "--speculative-config"
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
"""Largest `num_speculative_tokens`: a verification forward runs k+1 positions, and past ~8
the acceptance of k in a row falls off faster than the forward's cost grows."""
MAX_LOOKUP = 64
"""Largest `prompt_lookup_max`: n-grams longer than this add search time and no matches."""
NGRAM_DEFAULT_LOOKUP = 5
"""vLLM's `prompt_lookup_min`/`_max` when neither is given."""
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """One server's speculative decoding: what drafts, and how many tokens a step."""

    method: str
    """"ngram" (prompt lookup: the tokens that followed the sequence's last n-gram earlier in
    prompt + output) or "draft_model" (a small model with the same vocabulary)."""
    num_speculative_tokens: int
    """k: tokens drafted per step, verified in one target forward over k+1 positions."""
    prompt_lookup_max: int = NGRAM_DEFAULT_LOOKUP
    """ngram: the longest suffix n-gram looked up (tried first)."""
    prompt_lookup_min: int = NGRAM_DEFAULT_LOOKUP
    """ngram: the shortest suffix n-gram looked up (no draft below it)."""
    model: Path | None = None
    """draft_model: the draft checkpoint directory (any format --load reads)."""
    disable_by_batch_size: int | None = None
    """Steps with at least this many active rows decode without speculation (vLLM's key);
    None: every step speculates."""

    def describe(self) -> str:
        """One line for the start-up log."""
        what = (
            f"prompt lookup n={self.prompt_lookup_min}..{self.prompt_lookup_max}"
            if self.method == "ngram"
            else f"draft model {self.model}"
        )
        off = (
            ""
            if self.disable_by_batch_size is None
            else f", off from {self.disable_by_batch_size} rows"
        )
        return f"speculative decoding: {what}, k={self.num_speculative_tokens}{off}"


def _int(raw: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{FLAG}: {key!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The config a `--speculative-config` JSON object asks for; ValueError naming the key."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{FLAG}: not JSON ({exc.msg} at character {exc.pos}); give an object such as "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\''
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG}: expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"{FLAG}: unknown key(s) {unknown}; Meshline applies {sorted(_KEYS)}")
    method = raw.get("method")
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"{FLAG}: 'model' must be a checkpoint directory, got {model!r}")
    if method is None:
        method = "draft_model" if model is not None else None
    if method == "[ngram]":  # vLLM's older spelling
        method = "ngram"
    if method not in METHODS:
        raise ValueError(
            f"{FLAG}: 'method' must be one of {list(METHODS)} (or give 'model' for a draft "
            f"model), got {method!r}"
        )
    k = _int(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError(f"{FLAG}: 'num_speculative_tokens' is required (e.g. 4)")
    lookup_max = _int(raw, "prompt_lookup_max", 1, MAX_LOOKUP)
    lookup_min = _int(raw, "prompt_lookup_min", 1, MAX_LOOKUP)
    disable = _int(raw, "disable_by_batch_size", 1, 2**31 - 1)
    if method == "ngram":
        if model is not None:
            raise ValueError(f"{FLAG}: 'model' is for method 'draft_model', not 'ngram'")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = NGRAM_DEFAULT_LOOKUP
        lookup_max = lookup_max if lookup_max is not None else lookup_min
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        assert lookup_min is not None and lookup_max is not None
        if lookup_min > lookup_max:
            raise ValueError(
                f"{FLAG}: 'prompt_lookup_min' ({lookup_min}) must be <= 'prompt_lookup_max' "
                f"({lookup_max})"
            )
        return SpeculativeConfig("ngram", k, lookup_max, lookup_min, disable_by_batch_size=disable)
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if key in raw:
            raise ValueError(f"{FLAG}: {key!r} is for method 'ngram', not 'draft_model'")
    if model is None:
        raise ValueError(f"{FLAG}: method 'draft_model' needs 'model': the draft checkpoint")
    path = Path(model).resolve()
    if not path.is_dir():
        raise ValueError(f"{FLAG}: 'model' {model!r} is not an existing checkpoint directory")
    return SpeculativeConfig("draft_model", k, model=path, disable_by_batch_size=disable)
