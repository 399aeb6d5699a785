"""OpenAI request fields -> engine requests, and engine results -> OpenAI choice fields.

The HTTP front calls the same `AsyncEngine` the gRPC servicer uses (through
`metrics.metered`), so both protocols share one engine, one batch and one set of metrics.

Mapping (documented in docs/inference.md):
- `temperature` 0 is greedy; unset is 1.0 (sampling), as OpenAI.
- `n` > 1 needs sampling or beam search; `best_of` > `n` without beam search samples `best_of`
  sequences and returns the `n` with the highest cumulative log-probability (not when streaming).
- Beam search is vLLM's form: `use_beam_search: true` with `best_of` beams (default `n`),
  returning the best `n`; `length_penalty` and `early_stopping` as Hugging Face.
- `logprobs` (completions) / `top_logprobs` (chat) report the real top-k alternatives of the
  unmodified model distribution at every position; with `echo` and `max_tokens: 0` a completion
  returns the prompt's log-probabilities only (the first prompt token has none), which is what
  lm-eval's loglikelihood requests read.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.requests import Finish, StepEvent
from engine.sampling import SamplingConfig
from engine.validation import (
    InvalidRequest,
    Problem,
    RequestLimits,
    fit_problems,
    prompt_text_problems,
    sampling_problems,
)
from models.templates import TEMPLATES, Message
from services.inference.config import InferenceServiceConfig
from services.inference.http_config import CHAT_TEMPLATE_AUTO
from services.inference.metrics import metered
from services.inference.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    SamplingFields,
    invalid,
)
from services.inference.serving import ServingEngine, request_limits
from services.inference.tool_calls import (
    ToolPlan,
    call_as_text,
    family_of,
    hermes_system_block,
    template_tools,
)

FINISH_REASONS = {
    Finish.LENGTH: "length",
    Finish.STOP: "stop",
    Finish.STOP_STRING: "stop",
    Finish.CANCELLED: "abort",
}


@dataclass
class Plan:
    """One engine request per prompt, and how its sequences become the answer's choices."""

    config: SamplingConfig
    """What the engine runs (num_return_sequences may exceed `n` for best_of)."""
    n: int
    """Choices per prompt in the answer."""
    top_k: int
    """Alternatives per position to report (0 when none are asked for)."""
    want_logprobs: bool
    """Whether the answer carries log-probabilities at all."""
    adapter: str = ""
    """The LoRA adapter the request runs with (its `model`); "": the base model."""


@dataclass
class ChoiceResult:
    """One finished sequence with what the OpenAI answer needs."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None
    cumulative_logprob: float = 0.0
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    """The text each token added (for text offsets); empty for beam search."""


def resolve_prompts(
    engine: ServingEngine,
    prompt: object,
    limit: int,
    max_chars: int,
    add_special_tokens: bool = True,
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt of a completion request; text is encoded as the
    tokenizer's defaults say (`add_special_tokens`), ids are taken as they are."""
    if isinstance(prompt, str):
        prompts: list[object] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = list(prompt)
    else:
        raise invalid("prompt", "give a string, a list of strings or token ids")
    if not prompts:
        raise invalid("prompt", "give at least one prompt")
    if len(prompts) > limit:
        raise invalid("prompt", f"at most {limit} prompts per request, got {len(prompts)}")
    return [
        (
            p if isinstance(p, str) else None,
            prompt_ids(engine, p, f"prompt[{i}]", max_chars, add_special_tokens),
        )
        for i, p in enumerate(prompts)
    ]


def prompt_ids(
    engine: ServingEngine,
    prompt: object,
    param: str,
    max_chars: int,
    add_special_tokens: bool = True,
) -> list[int]:
    """Ids of one prompt (text or ids), checked against --max-text-chars and the vocabulary."""
    tokens = engine.tokens
    if isinstance(prompt, str):
        problems = prompt_text_problems(prompt, RequestLimits(max_prompt_chars=max_chars))
        if problems:
            raise api_problems(problems, param)
        if tokens.tokenizer is None:
            raise invalid(param, "this server has no tokenizer; send token ids")
        ids = tokens.encode_prompt(prompt, add_special_tokens)
    else:
        ids = list(prompt)  # type: ignore[call-overload]
        if len(ids) > max_chars:
            raise invalid(param, f"at most {max_chars} ids (--max-text-chars), got {len(ids)}")
        bad = [t for t in ids if not 0 <= t < tokens.vocab_size]
        if bad:
            raise invalid(
                param, f"token ids {bad[:5]} are outside the vocabulary [0, {tokens.vocab_size})"
            )
    if not ids:
        raise invalid(param, "the prompt encodes to no tokens")
    return ids


def plan(
    request: SamplingFields,
    *,
    max_tokens: int,
    top_k_wanted: int | None,
    prompt_lengths: list[int],
    engine: ServingEngine,
    limits: InferenceServiceConfig,
    constraint: tuple[str, str] | None = None,
) -> Plan:
    """The engine settings of a request, or ApiError(400) naming the field that cannot be met.
    `constraint`: (the field that asked for it, the grammar) of a structured output."""
    if request.presence_penalty or request.frequency_penalty:
        raise invalid(
            "presence_penalty" if request.presence_penalty else "frequency_penalty",
            "not supported; use repetition_penalty (Hugging Face semantics, 1.0 disables)",
        )
    if request.logit_bias:
        raise invalid("logit_bias", "not supported")
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    n = request.n
    temperature = 1.0 if request.temperature is None else request.temperature
    want_logprobs = top_k_wanted is not None
    top_k = top_k_wanted or 0
    common = dict(
        max_new_tokens=max(max_tokens, 1),
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
        stop=tuple(stops),
        seed=request.seed if request.seed is not None else secrets.randbits(63),
        grammar=None if constraint is None else constraint[1],
    )
    if request.use_beam_search:
        beams = request.best_of or n
        if beams < n:
            raise invalid("best_of", f"beam width must be >= n ({n}), got {beams}")
        if want_logprobs:
            raise invalid("logprobs", "per-token log-probabilities are not given with beam search")
        if request.stream:
            raise invalid("stream", "beam search answers once, at the end; set stream false")
        config = SamplingConfig(
            num_beams=beams,
            num_return_sequences=n,
            early_stopping=bool(request.early_stopping),
            **common,  # type: ignore[arg-type]
        )
        return _checked(Plan(config, n, 0, False), prompt_lengths, engine, limits)
    # NaN compares false: it stays the temperature, so validation refuses it.
    sampling = not temperature <= 0
    best_of = request.best_of or n
    if best_of < n:
        raise invalid("best_of", f"must be >= n ({n}), got {best_of}")
    if best_of != n and request.stream:
        raise invalid("best_of", "must equal n when streaming")
    config = SamplingConfig(
        do_sample=sampling,
        temperature=temperature,
        # vLLM's -1 disables top_k, as 0 does; other negatives are refused by validation.
        top_k=0 if request.top_k in (None, -1) else request.top_k,
        top_p=1.0 if request.top_p is None else request.top_p,
        num_return_sequences=best_of,
        # The engine reports at least the chosen token's log-probability when any is wanted.
        logprobs=max(top_k, 1) if want_logprobs else 0,
        **common,  # type: ignore[arg-type]
    )
    return _checked(Plan(config, n, top_k, want_logprobs), prompt_lengths, engine, limits)


OPENAI_NAMES = {
    "max_new_tokens": "max_tokens",
    "num_return_sequences": "n",
    "num_beams": "best_of",
}
"""Engine field names (engine.validation) that OpenAI's API spells otherwise."""


def api_problems(problems: list[Problem], prompt_param: str = "prompt") -> ApiError:
    """HTTP 400 in OpenAI's error shape listing every problem; `param` names the first."""
    names = [
        prompt_param if p.field == "prompt" else OPENAI_NAMES.get(p.field, p.field)
        for p in problems
    ]
    message = "; ".join(f"{name}: {p.reason}" for name, p in zip(names, problems, strict=True))
    too_long = any("--max-model-len" in p.reason for p in problems)
    code = "context_length_exceeded" if too_long else "invalid_value"
    return ApiError(400, message, param=names[0], code=code)


def _checked(
    result: Plan,
    prompt_lengths: list[int],
    engine: ServingEngine,
    limits: InferenceServiceConfig,
) -> Plan:
    """The plan, or ApiError(400) listing what engine.validation finds in it."""
    bounds = request_limits(limits, engine)
    problems = sampling_problems(result.config, bounds)
    if not problems:
        problems = fit_problems(max(prompt_lengths), result.config, bounds)
    if problems:
        raise api_problems(problems)
    return result


async def generate(engine: ServingEngine, prompt: list[int], current: Plan) -> list[ChoiceResult]:
    """Run one prompt to completion; its `n` choices, best first when best_of > n."""
    results = [ChoiceResult() for _ in range(current.config.num_return_sequences)]
    try:
        # Answered once, at the end: the engine posts this request's events once it finishes.
        async for event in metered(
            engine.front, prompt, current.config, "http", hold=True, adapter=current.adapter
        ):
            fold(results[event.index], event)
    except InvalidRequest as exc:
        raise api_problems(exc.problems) from None
    if len(results) > current.n:
        results = sorted(results, key=lambda r: -r.cumulative_logprob)[: current.n]
    return results


def fold(result: ChoiceResult, event: StepEvent) -> None:
    """Add one engine event to a choice."""
    result.token_ids += event.token_ids
    result.text += event.text
    result.cumulative_logprob = event.cumulative_logprob
    result.token_logprobs += event.token_logprobs
    result.top_logprobs += event.top_logprobs
    if len(event.token_ids) == 1:
        result.token_texts.append(event.text)
    if event.finish is not None:
        result.finish = event.finish


async def prompt_logprobs(
    engine: ServingEngine, prompts: list[list[int]], top_k: int
) -> list[ChoiceResult]:
    """Log-probabilities of every prompt token after the ones before it (one batched Score)."""
    items = [(p[:1], p[1:]) for p in prompts if len(p) > 1]
    pad = engine.tokens.pad_id or 0
    k = max(top_k, 1)
    scored = iter(
        await engine.front.run(lambda: engine.engine.score(items, pad, k)) if items else []
    )
    out = []
    for p in prompts:
        result = ChoiceResult(token_ids=list(p))
        if len(p) > 1:
            score = next(scored)
            result.token_logprobs = list(score.token_logprobs)
            result.top_logprobs = [list(t) for t in score.top_logprobs]
        out.append(result)
    return out


def chat_source(engine: ServingEngine, template: str) -> str | None:
    """The Jinja chat template a chat is rendered with (None for a named prompt template)."""
    if template != CHAT_TEMPLATE_AUTO:
        return None
    source = chat_template_of(engine)
    if source is None:
        raise ApiError(
            400,
            "messages: the served tokenizer has no chat template; restart the server with "
            f"--chat-template NAME (one of {sorted(TEMPLATES)}) or use /v1/completions",
            param="messages",
            code="chat_template_missing",
        )
    return source


def render_chat(
    engine: ServingEngine,
    request: ChatCompletionRequest,
    template: str,
    max_chars: int,
    tools: ToolPlan | None = None,
) -> list[int]:
    """Prompt ids of a chat: the tokenizer's own template ("auto") or a named prompt template;
    the messages' text together is at most `max_chars` (--max-text-chars), as a gRPC prompt.
    With `tools`, the functions are offered as the template's tool format says
    (services/inference/tool_calls.py)."""
    chars = sum(len(m.text()) for m in request.messages)
    if chars > max_chars:
        raise invalid(
            "messages", f"at most {max_chars} characters in all (--max-text-chars), got {chars}"
        )
    tokens = engine.tokens
    if tokens.tokenizer is None:
        raise invalid("messages", "this server has no tokenizer, so it cannot render a chat")
    source = chat_source(engine, template)
    messages = chat_messages(request, source, tools)
    if source is not None:
        extra = {}
        if tools is not None and "tools" in source:
            extra["tools"] = template_tools(tools)
        try:
            text = _render_jinja(engine, source, messages, request.add_generation_prompt, extra)
        except Exception as exc:  # the template's own checks (raise_exception, ...)
            raise invalid("messages", f"the chat template refused them: {exc}") from None
        ids = tokens.require().encode(text)
    else:
        plain = [Message(m["role"], m["content"]) for m in messages]
        try:
            segments = TEMPLATES[template].render(plain)
        except ValueError as exc:
            raise invalid("messages", str(exc)) from None
        ids = tokens.encode_prompt("".join(s.text for s in segments))
    if not ids:
        raise invalid("messages", "the conversation renders to no tokens")
    return ids


def chat_messages(
    request: ChatCompletionRequest, source: str | None, tools: ToolPlan | None
) -> list[dict[str, Any]]:
    """The messages as the template reads them. Turns a template cannot show (calls made,
    tool results, tools offered) are written in the Hermes form inside ordinary turns: a
    template that reads `tool_calls` / the "tool" role / `tools` gets them as they are."""
    family = family_of(source)
    reads_calls = source is not None and "tool_calls" in source
    reads_tool_role = source is not None and ("'tool'" in source or '"tool"' in source)
    messages: list[dict[str, Any]] = []
    for m in request.messages:
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                for c in m.tool_calls
            ]
            if reads_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": call}
                    for c, call in zip(m.tool_calls, calls, strict=True)
                ]
            else:
                text = call_as_text(family, calls)
                entry["content"] = f"{entry['content']}\n{text}" if entry["content"] else text
        if role == "tool":
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if not reads_tool_role:
                entry = {
                    "role": "user",
                    "content": f"<tool_response>\n{m.text()}\n</tool_response>",
                }
        messages.append(entry)
    if tools is not None and (source is None or "tools" not in source):
        block = hermes_system_block(tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages


def _arguments(text: str) -> Any:
    """A call's arguments as templates want them (a mapping; the text when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_template_of(engine: ServingEngine) -> str | None:
    """The served tokenizer's Jinja chat template: transformers' attribute, else
    `chat_template.jinja` or `chat_template` in tokenizer_config.json of its directory."""
    tokenizer = engine.tokens.tokenizer
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None and isinstance(getattr(hf, "chat_template", None), str):
        return hf.chat_template
    directory = getattr(tokenizer, "path", None)
    if not isinstance(directory, Path) or not directory.is_dir():
        return None
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _special_text(engine: ServingEngine, name: str) -> str | None:
    """`bos_token` / `eos_token` as tokenizer_config.json spells it (None when it does not)."""
    directory = getattr(engine.tokens.tokenizer, "path", None)
    config = directory / "tokenizer_config.json" if isinstance(directory, Path) else None
    if config is None or not config.is_file():
        return None
    value = json.loads(config.read_text()).get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _render_jinja(
    engine: ServingEngine,
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    extra: dict[str, Any] | None = None,
) -> str:
    """Render a chat template as transformers does (sandboxed Jinja, `raise_exception`)."""
    env = chat_environment()
    names = {}
    for name, token_id in (
        ("bos_token", engine.tokens.bos_id),
        ("eos_token", engine.tokens.eos_id),
    ):
        text = _special_text(engine, name)
        if text is None and token_id is not None:
            text = token_strings(engine, [token_id])[0]
        if text is not None:
            names[name] = text
    return env.from_string(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **names, **(extra or {})
    )


def chat_environment() -> Any:
    """The sandboxed Jinja environment chat templates are written for: what transformers'
    `apply_chat_template` defines (`raise_exception`, `strftime_now`, loop controls, a `tojson`
    without HTML escapes), so templates such as Llama 3.x's, which date their system prompt with
    `strftime_now`, render here as they do there."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _strftime_now(format: str) -> str:
    """The current local time in `format` (transformers' `strftime_now`); the format is bounded,
    since a template is input too."""
    if not isinstance(format, str) or len(format) > 256:
        raise ValueError("strftime_now takes a format string of at most 256 characters")
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's `tojson` as transformers' chat rendering defines it (plain JSON, no HTML escapes)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def token_strings(engine: ServingEngine, ids: list[int]) -> list[str]:
    """Token strings (tokenizer pieces) of `ids`; "token_id:<id>" without a tokenizer."""
    if engine.tokens.tokenizer is None:
        return [f"token_id:{i}" for i in ids]
    return engine.tokens.pieces(ids)


def prefix_offsets(engine: ServingEngine, ids: list[int]) -> list[int]:
    """Character offset of each token of `ids` in their decoded text."""
    decode = engine.tokens.decode
    if decode is None:
        return [0] * len(ids)
    return [len(decode(ids[:i])) for i in range(len(ids))]
