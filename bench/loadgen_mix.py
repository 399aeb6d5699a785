"""The load generator's request mix: ShareGPT-like prompt and output lengths, drawn locally.

Chat logs such as ShareGPT have right-skewed lengths: most prompts are a few hundred tokens
with a long tail of pasted documents, most answers a couple of hundred tokens with a tail of
long ones. A log-normal draw (`median` = e^mu, `sigma` the spread of log-length) reproduces
that shape; each draw is clipped to [minimum, cap]. Nothing is downloaded: the lengths come from
a seeded `random.Random`, the prompt text from Meshline's own documentation (docs/*.md, shipped
with the repository), cut to the drawn length in the served model's tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS_CHARS = 200_000
"""Characters of docs/*.md the prompts are cut from (one /tokenize call of this size)."""


@dataclass(frozen=True)
class LengthShape:
    """A clipped log-normal length distribution, in tokens."""

    median: float
    """Median of the uncapped draw (e^mu)."""
    sigma: float
    """Standard deviation of the log-length (0: every draw is the median)."""
    minimum: int
    """Smallest length kept (draws below are raised to it)."""
    cap: int
    """Largest length kept (draws above are lowered to it)."""

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.cap:
            raise ValueError(
                f"length bounds need 1 <= minimum <= cap; got {self.minimum}, {self.cap}"
            )
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"median must be > 0 and sigma >= 0; got {self.median}, {self.sigma}")

    def draw(self, rng: random.Random) -> int:
        """One length from `rng`."""
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(self.minimum, min(self.cap, round(value)))


@dataclass(frozen=True)
class RequestSpec:
    """One request of the mix, before its prompt text is cut."""

    prompt_tokens: int
    """Prompt length in the served model's tokens."""
    output_tokens: int
    """max_tokens of the request (the server may stop earlier at EOS)."""
    offset: float
    """Where in the corpus its prompt starts, as a fraction of the usable length (0..1)."""


def build_mix(count: int, seed: int, prompt: LengthShape, output: LengthShape) -> list[RequestSpec]:
    """`count` requests drawn from `seed` alone: the same seed gives the same mix everywhere."""
    if count < 1:
        raise ValueError(f"the mix needs at least one request; got {count}")
    rng = random.Random(seed)
    return [RequestSpec(prompt.draw(rng), output.draw(rng), rng.random()) for _ in range(count)]


def corpus_text(limit: int = CORPUS_CHARS) -> str:
    """The first `limit` characters of docs/*.md (sorted by name), blank lines between files."""
    parts: list[str] = []
    size = 0
    for path in sorted((REPO / "docs").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        size += len(text) + 2
        if size >= limit:
            break
    return "\n\n".join(parts)[:limit]


def prompt_slices(specs: list[RequestSpec], corpus_ids: list[int]) -> list[list[int]]:
    """Each request's prompt as a window of `corpus_ids` of its length at its offset."""
    longest = max(s.prompt_tokens for s in specs)
    if len(corpus_ids) < longest:
        raise ValueError(
            f"the corpus holds {len(corpus_ids)} tokens, fewer than the longest prompt "
            f"({longest}); lower --max-prompt-tokens"
        )
    room = len(corpus_ids) - longest
    return [
        corpus_ids[int(s.offset * room) : int(s.offset * room) + s.prompt_tokens] for s in specs
    ]
