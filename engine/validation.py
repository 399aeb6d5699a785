"""One request validation for every front: the problems of a request, as (field, reason) pairs.

The gRPC servicer maps them to INVALID_ARGUMENT (fields `params.<name>`), the OpenAI HTTP front
to HTTP 400 in OpenAI's error shape (fields under OpenAI's names), and `Engine.submit` raises
`InvalidRequest` with them, so a request is judged by the same rules whichever way it came.

Fields are named as `SamplingConfig` spells them, plus `prompt`. Numeric ranges keep every value
the engine computes with finite and normal: a temperature below `MIN_TEMPERATURE` divides logits
into infinities, a repetition penalty outside
[`MIN_REPETITION_PENALTY`, `MAX_REPETITION_PENALTY`] does the same, `length ** length_penalty`
overflows past `MAX_LENGTH_PENALTY`, and a top_k past int32 overflows the int64 tensor the
warper builds (any top_k at or above the vocabulary already keeps every token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.sampling import MAX_SEED, SamplingConfig

MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-30
"""Smallest non-zero temperature (0 is greedy): logits divided by it stay finite in float32
(|logit| up to 1e8 gives at most 1e38); 1e-45, a float32 denormal, makes them infinite."""
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_LENGTH_PENALTY = 10.0
"""Largest |length_penalty|: length**10 stays finite for any context length."""
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20
"""Most alternatives per position a request may ask for (OpenAI's limit for top_logprobs)."""


@dataclass(frozen=True)
class Problem:
    """One reason a request cannot run."""

    field: str
    """The field at fault, as SamplingConfig spells it, or "prompt"."""
    reason: str
    """What is wrong and what would be right."""


class InvalidRequest(ValueError):
    """A request with problems; `problems` lists them all."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{p.field}: {p.reason}" for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class RequestLimits:
    """The bounds a server puts on one request (its flags) and the engine's capacity."""

    max_new_tokens: int = 1 << 20
    """Largest max_new_tokens (--max-new-tokens-limit)."""
    max_num_beams: int = 1 << 10
    """Largest num_beams and num_return_sequences (--max-num-beams)."""
    max_stop_strings: int = 1 << 10
    """Most stop strings (--max-stop-strings)."""
    max_stop_string_chars: int = 1 << 16
    """Longest stop string in characters (--max-stop-string-chars)."""
    max_prompt_chars: int = 1 << 30
    """Longest prompt text in characters, and most prompt ids (--max-text-chars)."""
    max_model_len: int | None = None
    """Tokens per sequence, prompt + new (--max-model-len); None: not checked."""
    max_rows: int | None = None
    """Cache rows one request may take (--max-batch-rows); None: not checked."""
    vocab_size: int | None = None
    """Prompt ids must be below it; None: not checked."""


def _finite_in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


class _Problems(list[Problem]):
    """The problems found so far."""

    def require(self, ok: bool, name: str, reason: str) -> bool:
        """Record `reason` against `name` unless `ok`; returns `ok`."""
        if not ok:
            self.append(Problem(name, reason))
        return ok


def sampling_problems(config: SamplingConfig, limits: RequestLimits) -> list[Problem]:
    """Every field of `config` that is out of range, of the wrong combination or over a limit."""
    out = _Problems()
    _check_ranges(config, limits, out)
    _check_sequences(config, limits, out)
    _check_stops(config, limits, out)
    return list(out)


def _check_ranges(config: SamplingConfig, limits: RequestLimits, out: _Problems) -> None:
    """The numeric settings, each in its finite range."""
    out.require(
        1 <= config.max_new_tokens <= limits.max_new_tokens,
        "max_new_tokens",
        f"must be in [1, {limits.max_new_tokens}], got {config.max_new_tokens}",
    )
    t = config.temperature
    out.require(
        t == 0 or _finite_in(t, MIN_TEMPERATURE, MAX_TEMPERATURE),
        "temperature",
        f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}",
    )
    out.require(
        0 <= config.top_k <= MAX_TOP_K,
        "top_k",
        f"must be in [0, {MAX_TOP_K}] (0 disables), got {config.top_k}",
    )
    out.require(
        _finite_in(config.top_p, 0, 1) and config.top_p > 0,
        "top_p",
        f"must be in (0, 1], got {config.top_p}",
    )
    out.require(
        _finite_in(config.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        "repetition_penalty",
        f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1.0 disables), got "
        f"{config.repetition_penalty}",
    )
    out.require(
        _finite_in(config.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
        "length_penalty",
        f"must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got {config.length_penalty}",
    )
    out.require(
        0 <= config.seed <= MAX_SEED,
        "seed",
        f"must be in [0, 2**63 - 1] (sequence i uses seed + i), got {config.seed}",
    )


def _check_sequences(config: SamplingConfig, limits: RequestLimits, out: _Problems) -> None:
    """Beams, log-probabilities and returned sequences, alone and in combination."""
    beams = config.num_beams
    beams_ok = out.require(
        1 <= beams <= limits.max_num_beams,
        "num_beams",
        f"must be in [1, {limits.max_num_beams}], got {beams}",
    )
    if out.require(
        0 <= config.logprobs <= MAX_LOGPROBS,
        "logprobs",
        f"must be in [0, {MAX_LOGPROBS}], got {config.logprobs}",
    ):
        out.require(
            config.logprobs == 0 or beams == 1,
            "logprobs",
            "per-token log-probabilities are not reported with beam search (num_beams > 1)",
        )
    n = config.num_return_sequences
    if not out.require(
        1 <= n <= limits.max_num_beams,
        "num_return_sequences",
        f"must be in [1, {limits.max_num_beams}], got {n}",
    ):
        return
    if beams > 1 and beams_ok:
        out.require(
            n <= beams,
            "num_return_sequences",
            f"must be <= num_beams ({beams}) with beam search, got {n}",
        )
    elif beams == 1 and not config.sampling:
        out.require(
            n == 1,
            "num_return_sequences",
            f"greedy decoding returns one sequence; sample or use num_beams >= {n}",
        )


def _check_stops(config: SamplingConfig, limits: RequestLimits, out: _Problems) -> None:
    stops = config.stop
    if out.require(
        len(stops) <= limits.max_stop_strings,
        "stop",
        f"at most {limits.max_stop_strings} stop strings, got {len(stops)}",
    ):
        out.require(all(stops), "stop", "stop strings must not be empty")
        longest = max((len(s) for s in stops), default=0)
        out.require(
            longest <= limits.max_stop_string_chars,
            "stop",
            f"stop strings must be at most {limits.max_stop_string_chars} characters, got "
            f"{longest}",
        )


def prompt_text_problems(text: str, limits: RequestLimits) -> list[Problem]:
    """A prompt text too long to tokenise (checked before tokenising it)."""
    if len(text) > limits.max_prompt_chars:
        return [
            Problem(
                "prompt",
                f"at most {limits.max_prompt_chars} characters (--max-text-chars), got {len(text)}",
            )
        ]
    return []


def prompt_problems(prompt_ids: list[int], limits: RequestLimits) -> list[Problem]:
    """An empty or over-long prompt, or ids outside the vocabulary."""
    if not prompt_ids:
        return [Problem("prompt", "the prompt is empty (or encodes to no tokens)")]
    if len(prompt_ids) > limits.max_prompt_chars:
        return [
            Problem(
                "prompt",
                f"at most {limits.max_prompt_chars} ids (--max-text-chars), got {len(prompt_ids)}",
            )
        ]
    vocab = limits.vocab_size
    bad = [t for t in prompt_ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        span = f"[0, {vocab})" if vocab is not None else ">= 0"
        return [Problem("prompt", f"token ids {bad[:5]} are outside the vocabulary {span}")]
    return []


def fit_problems(
    prompt_len: int, config: SamplingConfig, limits: RequestLimits, *, whole: bool = True
) -> list[Problem]:
    """A request that does not fit the engine: too long for --max-model-len, too many rows.

    `whole`: prompt + max_new_tokens must fit (the fronts, as vLLM's OpenAI server); else only
    the prompt must leave room for one token and generation ends at the limit (the engine)."""
    out: list[Problem] = []
    limit = limits.max_model_len
    if limit is not None:
        if prompt_len >= limit:
            out.append(
                Problem(
                    "prompt",
                    f"the prompt is {prompt_len} tokens; this server's maximum model length is "
                    f"{limit} tokens (--max-model-len), prompt + at least one new token; "
                    "shorten it",
                )
            )
        elif whole and prompt_len + config.max_new_tokens > limit:
            out.append(
                Problem(
                    "max_new_tokens",
                    f"prompt ({prompt_len} tokens) + max_new_tokens ({config.max_new_tokens}) "
                    f"exceeds this server's maximum model length {limit} (--max-model-len); "
                    f"ask for at most {limit - prompt_len} new tokens or shorten the prompt",
                )
            )
    rows = rows_needed(config)
    if limits.max_rows is not None and rows > limits.max_rows:
        out.append(
            Problem(
                "num_beams" if config.num_beams > 1 else "num_return_sequences",
                f"the request needs {rows} cache rows, the engine has {limits.max_rows} "
                "(--max-batch-rows)",
            )
        )
    return out


def request_problems(
    prompt_ids: list[int], config: SamplingConfig, limits: RequestLimits, *, whole: bool = True
) -> list[Problem]:
    """Every problem of one generation request: sampling fields, prompt, fit (see
    `fit_problems` for `whole`)."""
    problems = sampling_problems(config, limits) + prompt_problems(prompt_ids, limits)
    if not problems:
        problems = fit_problems(len(prompt_ids), config, limits, whole=whole)
    return problems


def rows_needed(config: SamplingConfig) -> int:
    """Cache rows a request takes: one per beam, else one per returned sequence."""
    return config.num_beams if config.num_beams > 1 else config.num_return_sequences


@dataclass(frozen=True)
class RewardLimits:
    """The bounds one reward request meets (the server's flags) and the model's capacity."""

    max_inputs: int
    """Most inputs per request (--max-score-items)."""
    max_tokens: int
    """Most tokens of all inputs together (--max-score-tokens)."""
    max_model_len: int
    """Longest input in tokens (--max-model-len, else the model's context length)."""
    vocab_size: int
    """Every id must be below it."""


def reward_problems(rows: list[list[int]], limits: RewardLimits) -> list[Problem]:
    """Every input of a reward request (token ids, once tokenised) that cannot be scored:
    empty, longer than the model length, ids outside the vocabulary; too many inputs or tokens
    in all. Fields are `inputs` and `inputs[i]`."""
    out: list[Problem] = []
    if not rows:
        return [Problem("inputs", "give at least one input to score")]
    if len(rows) > limits.max_inputs:
        return [
            Problem(
                "inputs",
                f"at most {limits.max_inputs} inputs per request (--max-score-items), "
                f"got {len(rows)}",
            )
        ]
    for i, row in enumerate(rows):
        if not row:
            out.append(Problem(f"inputs[{i}]", "encodes to no tokens; give a non-empty input"))
        elif len(row) > limits.max_model_len:
            out.append(
                Problem(
                    f"inputs[{i}]",
                    f"is {len(row)} tokens, over the server's model length "
                    f"{limits.max_model_len} (--max-model-len)",
                )
            )
        elif min(row) < 0 or max(row) >= limits.vocab_size:
            bad = [t for t in row if not 0 <= t < limits.vocab_size][:5]
            out.append(
                Problem(f"inputs[{i}]", f"token ids {bad} are outside [0, {limits.vocab_size})")
            )
        if len(out) >= 20:  # the error stays readable
            return out
    total = sum(len(r) for r in rows)
    if not out and total > limits.max_tokens:
        out.append(
            Problem(
                "inputs",
                f"the inputs hold {total} tokens in all, at most {limits.max_tokens} per "
                "request (--max-score-tokens); split them over several requests",
            )
        )
    return out
