"""OpenAI response fields from engine results: usage, completion and chat log-probabilities."""

from __future__ import annotations

from typing import Any

from services.inference.openai_generation import (
    ChoiceResult,
    prefix_offsets,
    token_strings,
)
from services.inference.serving import ServingEngine


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chunk_choice(index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One choice of a streamed completion chunk."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


def top_dict(engine: ServingEngine, top: list[tuple[int, float]], k: int) -> dict[str, float]:
    """A completion's `top_logprobs` entry: the first k alternatives keyed by token string."""
    chosen = top[:k]
    names = token_strings(engine, [t for t, _ in chosen])
    return {name: lp for name, (_, lp) in zip(names, chosen, strict=True)}


def echo_logprobs(engine: ServingEngine, echo: ChoiceResult, k: int) -> dict[str, Any]:
    """Completion logprobs of a prompt: the first token has none (nothing precedes it)."""
    ids = echo.token_ids
    return {
        "tokens": token_strings(engine, ids),
        "token_logprobs": [None, *echo.token_logprobs][: len(ids)],
        "top_logprobs": [None, *(top_dict(engine, t, k) for t in echo.top_logprobs)][: len(ids)],
        "text_offset": prefix_offsets(engine, ids),
    }


def gen_logprobs(engine: ServingEngine, gen: ChoiceResult, k: int, start: int) -> dict[str, Any]:
    """Completion logprobs of generated tokens; text offsets count from `start`."""
    offsets, at = [], start
    for i in range(len(gen.token_ids)):
        offsets.append(at)
        at += len(gen.token_texts[i]) if i < len(gen.token_texts) else 0
    return {
        "tokens": token_strings(engine, gen.token_ids),
        "token_logprobs": list(gen.token_logprobs),
        "top_logprobs": [top_dict(engine, t, k) for t in gen.top_logprobs],
        "text_offset": offsets,
    }


def concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Completion logprobs of the echoed prompt followed by those of the generation."""
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}


def chat_logprobs(engine: ServingEngine, gen: ChoiceResult, k: int) -> dict[str, Any]:
    """A chat choice's `logprobs`: per token its log-probability and top alternatives."""
    names = token_strings(engine, gen.token_ids)
    content = []
    for name, lp, top in zip(names, gen.token_logprobs, gen.top_logprobs, strict=True):
        alternatives = top[:k]
        alt_names = token_strings(engine, [t for t, _ in alternatives])
        content.append(
            {
                "token": name,
                "logprob": lp,
                "bytes": list(name.encode()),
                "top_logprobs": [
                    {"token": n, "logprob": v, "bytes": list(n.encode())}
                    for n, (_, v) in zip(alt_names, alternatives, strict=True)
                ],
            }
        )
    return {"content": content}
