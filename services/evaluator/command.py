"""The `meshline evaluate` settings that are no `EvalConfig` field: where the evaluated model
(and rm_win_rate's judges) come from and how the command reports. Its flags are derived from
this dataclass (services/common/dataclass_flags.py), as `EvalConfig`'s are."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from checkpoints.registry import SERVE_CHOICES

LOAD_FORMATS = SERVE_CHOICES
"""`--load-format` choices: auto and the served formats of checkpoints/registry.py."""
DTYPES = ("float32", "bfloat16", "float16")
"""Compute dtypes of a --load model (besides auto)."""
DEFAULT_BATCH_SIZE = 8
"""Requests per batch when neither --batch-size nor --micro-batch-size is given."""


@dataclass
class EvaluateCommand:
    """The models `meshline evaluate` opens and how it reports (EvalConfig holds the run)."""

    list_tasks: bool = False
    """Print the task names and exit."""
    endpoint: str | None = None
    """host:port of a running meshline InferenceService."""
    load: Path | None = None
    """Checkpoint directory to load in-process."""
    load_format: str = "auto"
    """Format of the --load checkpoint (auto: detected from its files)."""
    reference_load: Path | None = None
    """rm_win_rate: the reference causal LM (a checkpoint directory, format detected, tokenizer
    stored in it) that the evaluated model is compared with."""
    reference_endpoint: str | None = None
    """rm_win_rate: host:port of an InferenceService serving the reference."""
    reward_load: Path | None = None
    """rm_win_rate: the reward model (a `meshline train --stage rm` checkpoint directory, format
    detected, tokenizer stored in it) that judges both answers."""
    reward_endpoint: str | None = None
    """rm_win_rate: host:port of an InferenceService serving the reward model."""
    tokenizer: Path | None = None
    """Tokenizer when the checkpoint has none."""
    add_bos_token: Literal["true", "false"] | None = None
    """lm-eval's add_bos_token: true puts BOS before every context and prompt, false encodes
    them without special tokens (default: as the tokenizer's own settings say)."""
    dtype: str | None = None
    """Compute dtype of a --load model (default auto: the checkpoint's)."""
    no_progress: bool = False
    """Never draw a progress bar."""
