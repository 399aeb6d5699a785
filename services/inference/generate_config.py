"""`meshline generate`'s own settings (what it generates from, where the results go), each a
flag derived by services/common/dataclass_flags.py; the model and decoding flags come from the
engine's `LoadSpec`, `EngineConfig` and `SamplingConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerateInput:
    """What `meshline generate` generates from (one of prompt, input_ids and chat) and where its
    results go."""

    prompt: str | None = None
    """Prompt text (encoded as the tokenizer's defaults say)."""
    input_ids: str | None = None
    """Prompt token ids, comma separated."""
    chat: bool = False
    """Interactive "You >>" session."""
    prompt_template: str = "plain"
    """Chat template (--chat)."""
    system: str = ""
    """System message for --chat."""
    output_json: str | None = None
    """Results as JSON (- for stdout)."""
