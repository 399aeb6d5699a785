"""Structured output fields of an OpenAI request -> the grammar the engine masks the output with.

Accepted, at most one per request (each is a 400 naming it when it cannot be met):
- OpenAI `response_format`: `{"type": "text"}` (free), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's `guided_json`, `guided_regex`, `guided_choice` and their newer spelling
  `structured_outputs: {"json" | "regex" | "choice": ...}`.

The grammar is checked against the served tokenizer here (a worker thread: the first check builds
llguidance's view of the vocabulary), so a bad schema or regex is refused before the engine sees
the request. JSON is generated compactly (no free whitespace).
"""

from __future__ import annotations

import json
from typing import Any

from engine.grammar import (
    choice_grammar,
    grammar_problem,
    json_schema_grammar,
    regex_grammar,
)
from services.inference.openai_protocol import MAX_CHOICES, ApiError, SamplingFields, invalid
from services.inference.serving import ServingEngine

MAX_SCHEMA_CHARS = 65_536
"""A schema's JSON text, at most (a request body is bounded too, but a schema is compiled)."""
MAX_REGEX_CHARS = 4_096
"""A regular expression's length, at most."""
MAX_CHOICE_CHARS = 1_024
"""One alternative of a choice, at most."""


def requested_grammar(request: SamplingFields) -> tuple[str, str] | None:
    """(field name as the request spells it, llguidance grammar) of the request's structured
    output, None when the output is free; ApiError(400) naming the field when it is malformed
    or when more than one is given."""
    found: list[tuple[str, str]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", json_schema_grammar({"type": "object"})))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise invalid("response_format.json_schema", 'required with type "json_schema"')
        schema = fmt.json_schema.schema_
        param = "response_format.json_schema.schema"
        found.append(
            (param, schema_grammar(param, {"type": "object"} if schema is None else schema))
        )
    elif fmt is not None and fmt.json_schema is not None:
        raise invalid(
            "response_format.json_schema", f'only with type "json_schema", not {fmt.type!r}'
        )
    vllm: list[tuple[str, Any]] = [
        ("guided_json", request.guided_json),
        ("guided_regex", request.guided_regex),
        ("guided_choice", request.guided_choice),
    ]
    if request.structured_outputs is not None:
        so = request.structured_outputs
        vllm += [
            ("structured_outputs.json", so.json_),
            ("structured_outputs.regex", so.regex),
            ("structured_outputs.choice", so.choice),
        ]
    for param, value in vllm:
        if value is None:
            continue
        if param.endswith("json"):
            found.append((param, schema_grammar(param, value)))
        elif param.endswith("regex"):
            found.append((param, bounded_regex_grammar(param, value)))
        else:
            found.append((param, choices_grammar(param, value)))
    if request.structured_outputs is not None and not any(
        p.startswith("structured_outputs") for p, _ in found
    ):
        raise invalid("structured_outputs", "give one of json, regex or choice")
    if len(found) > 1:
        names = [p.split(".")[0] if p.startswith("response") else p for p, _ in found]
        raise invalid(names[1], f"give one structured-output constraint, not {names}")
    return found[0] if found else None


def schema_grammar(param: str, schema: Any) -> str:
    """The grammar of a JSON schema (an object, or its JSON text), bounded and checked
    (ApiError naming `param`)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(param, f"not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise invalid(param, "a JSON schema is an object")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid(param, f"at most {MAX_SCHEMA_CHARS} characters of schema, got {len(text)}")
    try:
        return json_schema_grammar(schema)
    except ValueError as exc:
        raise invalid(param, f"not a usable JSON schema: {exc}") from None


def bounded_regex_grammar(param: str, pattern: str) -> str:
    """The grammar of `pattern`, whose length is bounded (ApiError naming `param`)."""
    if not pattern or len(pattern) > MAX_REGEX_CHARS:
        raise invalid(param, f"give a regular expression of 1 to {MAX_REGEX_CHARS} characters")
    return regex_grammar(pattern)


def choices_grammar(param: str, choices: list[str]) -> str:
    """The grammar of one of `choices`, bounded in count and length (ApiError naming `param`)."""
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise invalid(param, f"give 1 to {MAX_CHOICES} alternatives, got {len(choices)}")
    if not all(1 <= len(c) <= MAX_CHOICE_CHARS for c in choices):
        raise invalid(param, f"each alternative is 1 to {MAX_CHOICE_CHARS} characters")
    return choice_grammar(choices)


def checked_constraint(
    engine: ServingEngine, constraint: tuple[str, str] | None
) -> tuple[str, str] | None:
    """`constraint` ((field, grammar) or None), or ApiError(400) naming the field when this
    server cannot apply it (a bad schema or regex, a tokenizer llguidance cannot read, a
    tensor/pipeline-parallel engine)."""
    if constraint is None:
        return None
    param, grammar = constraint
    if engine.tensor_parallel_size > 1 or engine.pipeline_parallel_size > 1:
        raise invalid(
            param,
            "structured output is not served with --tensor-parallel-size or "
            "--pipeline-parallel-size above 1",
        )
    reason = grammar_problem(grammar, engine.tokens)
    if reason is not None:
        raise ApiError(400, f"{param}: {reason}", param=param, code="invalid_value")
    return constraint
