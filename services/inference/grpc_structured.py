"""`GenerateRequest.structured_output` -> the grammar the engine masks the output with.

The same builders, bounds and checks as the HTTP fields (services/inference/openai_structured.py),
answered as INVALID_ARGUMENT naming `structured_output.<field>`.
"""

from __future__ import annotations

from engine.grammar import json_schema_grammar
from meshline.inference.v1 import inference_pb2
from services.common.errors import InvalidArgument
from services.inference.openai_protocol import ApiError
from services.inference.openai_structured import (
    bounded_regex_grammar,
    checked_constraint,
    choices_grammar,
    schema_grammar,
)
from services.inference.serving import ServingEngine

FIELD = "structured_output"


def requested_grammar(request: inference_pb2.GenerateRequest) -> tuple[str, str] | None:
    """(field, llguidance grammar) of the request's constraint, None for free text;
    InvalidArgument naming the field when it is malformed or out of bounds."""
    if not request.HasField(FIELD):
        return None
    constraint = request.structured_output
    kind = constraint.WhichOneof("constraint")
    if kind is None:
        raise InvalidArgument(FIELD, "set one of json_schema, json_object, regex or choice")
    param = f"{FIELD}.{kind}"
    try:
        if kind == "json_object":
            if not constraint.json_object:
                raise InvalidArgument(
                    param, "must be true (leave structured_output unset for text)"
                )
            return param, json_schema_grammar({"type": "object"})
        if kind == "json_schema":
            return param, schema_grammar(param, constraint.json_schema)
        if kind == "regex":
            return param, bounded_regex_grammar(param, constraint.regex)
        return param, choices_grammar(param, list(constraint.choice.values))
    except ApiError as exc:
        raise InvalidArgument(param, exc.message.removeprefix(f"{param}: ")) from None


def checked_grammar(engine: ServingEngine, request: inference_pb2.GenerateRequest) -> str | None:
    """The grammar of the request, checked against this server (its tokenizer, its layout);
    runs llguidance's checks, so call it off the event loop."""
    constraint = requested_grammar(request)
    if constraint is None:
        return None
    try:
        checked_constraint(engine, constraint)
    except ApiError as exc:
        raise InvalidArgument(
            constraint[0], exc.message.removeprefix(f"{constraint[0]}: ")
        ) from None
    return constraint[1]
