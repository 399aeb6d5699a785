"""How many prompt tokens a step may prefill while rows decode: a chunk sized from step times.

A fixed token budget (vLLM's --max-num-batched-tokens) bounds a step's tokens, not its time, and
what a prompt token costs against a decode row depends on the machine and the decode path: on a
one-thread CPU a step of 8 decode rows is already compute-bound, so a 56-token chunk costs ~7
decode steps and the decoding streams' inter-token latency grows by as much (bench/RESULTS.md,
#39); on a GPU the same decode step is memory-bound and a 512-token chunk is nearly free.
Sarathi-Serve sizes the budget so a chunk costs about what the decode step does; here the engine
measures both as it runs and sizes each chunk so that a step carrying one takes at most
`STEP_TIME_FACTOR` times a step of the same decode rows alone.

The model: a chunk of n tokens costs n x (seconds per chunk token), whose running average
includes the forward's fixed cost spread over the chunk; the next chunk is
(STEP_TIME_FACTOR - 1) x decode seconds / seconds per token. This is a fixed-point iteration of
a + b n = target (a the fixed cost, b the cost per token), which converges from either side when
a < target, and shrinks the chunk to one token when the fixed cost alone exceeds the target.
Before any chunk is timed a prompt token is assumed to cost what a decode row does.
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_TIME_FACTOR = 1.5
"""A step carrying a prompt chunk takes at most this many times a decode-only step (#39 asks
that a long prompt raise the streams' inter-token latency p99 by at most 2x; the margin covers
the step-to-step jitter of a shared machine)."""
SMOOTHING = 0.3
"""Weight of the newest measurement in each running average."""


@dataclass
class ChunkBudget:
    """Running averages of decode-step and chunk-token seconds, and the chunk they imply."""

    decode_s: float | None = None
    """Average seconds of a step's decode forward (all its rows), None before the first."""
    token_s: float | None = None
    """Average seconds per prompt token of a chunk computed beside decode rows."""

    def tokens(self, rows: int, cap: int) -> int:
        """Prompt tokens the next step may prefill beside `rows` decoding rows, at most `cap`
        (the token budget less the decode rows): all of `cap` when no row decodes (no stream
        waits on the step) or no decode step was timed yet, else at least one."""
        if rows == 0 or self.decode_s is None:
            return cap
        token_s = self.token_s if self.token_s is not None else self.decode_s / rows
        chunk = int((STEP_TIME_FACTOR - 1) * self.decode_s / max(token_s, 1e-9))
        return max(1, min(cap, chunk))

    def decoded(self, seconds: float) -> None:
        """A step's decode forward took `seconds`."""
        self.decode_s = _average(self.decode_s, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens, computed beside decode rows, took `seconds`."""
        if tokens > 0:
            self.token_s = _average(self.token_s, seconds / tokens)


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * value
