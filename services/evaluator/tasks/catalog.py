"""Benchmark metadata shipped with Meshline: subject lists and the published few-shot exemplars.

`catalog.json` holds MMLU's 57 subjects with their category, C-Eval's 52 subjects with their
Chinese task description, BBH's 27 tasks with their description and 3 answer-only exemplars, the
8 chain-of-thought exemplars of GSM8K (Wei et al., 2022), and AGIEval's 21 subtasks with their
language ("en"/"zh") and format ("multiple_choice"/"cloze") — the data lm-evaluation-harness
0.4 ships in its task configs, so that prompts match it without network access.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

CATALOG = Path(__file__).with_name("catalog.json")


@functools.cache
def catalog() -> dict[str, Any]:
    """The parsed catalog (read once)."""
    return json.loads(CATALOG.read_text(encoding="utf-8"))
