"""Tool calling in chat completions: the model family's call format, prompt, grammar and parser.

Formats, chosen from the served chat template's own text:
- "hermes" (Qwen2.5/3, SmolLM2, Hermes and any ChatML template): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- "llama3" (Llama-3.1/3.2/3.3 templates, `<|python_tag|>` / `ipython`): the answer is one JSON
  object `{"name": ..., "parameters": {...}}`;
- "mistral" (`[TOOL_CALLS]`): the answer is `[TOOL_CALLS]` then a JSON list of
  `{"name": ..., "arguments": {...}}` (the special token is dropped from decoded text, so the
  parser reads the list either way).

Tools reach the prompt through the template (transformers' convention: a `tools` variable of
OpenAI-shaped entries); a template that never reads `tools` (SmolLM2's, the named templates)
gets the Hermes tool block in its system message instead. `tool_choice` "required" or a named
function constrains the answer with a grammar of the format's calls (arguments validated by each
function's schema), so it always parses; "auto" leaves the model free and parses what it wrote;
"none" renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from engine.grammar import lark_grammar
from services.inference.openai_protocol import ChatCompletionRequest, Tool, invalid

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools."""

    tools: list[Tool]
    """The functions offered (empty: tool calling is off)."""
    choice: str
    """"auto", "required", or the name of the function that must be called."""
    family: str
    """"hermes", "llama3" or "mistral" (the answer's call format)."""
    parallel: bool
    """Whether an answer may hold more than one call."""

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls (a grammar constrains it)."""
        return self.choice != "auto"


@dataclass
class ParsedCall:
    """One call read from the model's answer."""

    name: str
    arguments: str
    """JSON text of the arguments."""
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI's `tool_calls` entry (with `index` in a stream delta)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def family_of(template: str | None) -> str:
    """The call format a chat template's text speaks (hermes unless it says otherwise)."""
    if template and "[TOOL_CALLS]" in template:
        return "mistral"
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3"
    return "hermes"


def tool_plan(request: ChatCompletionRequest, template: str | None) -> ToolPlan | None:
    """How the request uses tools, None when it does not; ApiError(400) naming the field."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise invalid("tool_choice", "needs tools; give tools or set tool_choice none")
        return None
    names = [t.function.name for t in tools]
    duplicate = sorted({n for n in names if names.count(n) > 1})
    if duplicate:
        raise invalid("tools", f"function names must differ; {duplicate} appear twice or more")
    if choice == "none":
        return None
    if choice is None or isinstance(choice, str):
        picked = choice or "auto"
    else:
        picked = choice.function.name
        if picked not in names:
            raise invalid("tool_choice", f"function {picked!r} is not one of tools {names}")
    return ToolPlan(tools, picked, family_of(template), request.parallel_tool_calls is not False)


def parameters_of(tool: Tool) -> dict[str, Any]:
    """A function's argument schema (no parameters: an empty object)."""
    return tool.function.parameters if tool.function.parameters is not None else _NO_ARGUMENTS


def template_tools(plan: ToolPlan) -> list[dict[str, Any]]:
    """`tools` as chat templates read them (transformers' convention: OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.function.name,
                "description": t.function.description or "",
                "parameters": parameters_of(t),
            },
        }
        for t in plan.tools
    ]


def hermes_system_block(plan: ToolPlan) -> str:
    """The tool instructions for a template that does not render tools itself."""
    lines = "\n".join(json.dumps(t) for t in template_tools(plan))
    return (
        "# Tools\n\nYou may call one or more functions to help with the user's request. "
        "The functions are described inside <tools></tools>:\n<tools>\n"
        f"{lines}\n</tools>\n\nTo call a function, answer with a JSON object holding its name "
        "and arguments inside <tool_call></tool_call>:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n'
        "</tool_call>"
    )


def call_as_text(family: str, calls: list[dict[str, Any]]) -> str:
    """An earlier assistant turn's calls in the family's format (templates that lack
    `tool_calls`); `calls` are (name, arguments dict) mappings."""
    if family == "llama3":
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls
        )
    if family == "mistral":
        return "[TOOL_CALLS]" + json.dumps(calls)
    return "\n".join(f"{HERMES_OPEN}\n{json.dumps(c)}\n{HERMES_CLOSE}" for c in calls)


def call_grammar(plan: ToolPlan) -> str:
    """The grammar of an answer that is calls only, in the family's format: the named function
    once, or (required) one or more of any (just one when parallel calls are off)."""
    key = "parameters" if plan.family == "llama3" else "arguments"
    offered = [t for t in plan.tools if plan.choice in ("required", t.function.name)]
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, key: parameters_of(t)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in offered
    ]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    many = plan.parallel and plan.choice == "required"
    call = f"call: %json {json.dumps(schema)}"
    if plan.family == "llama3":
        return lark_grammar(f"start: call\n{call}")
    if plan.family == "mistral":
        rest = '(", " call)*' if many else ""
        return lark_grammar(f'start: "[" call {rest} "]"\n{call}')
    one = f'"{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"'
    body = 'tc ("\\n" tc)*' if many else "tc"
    return lark_grammar(f"start: {body}\ntc: {one}\n{call}")


def parse_calls(plan: ToolPlan, text: str) -> tuple[str, list[ParsedCall]]:
    """(content left, calls) of an answer; text that holds no well-formed call of an offered
    function is all content."""
    names = {t.function.name for t in plan.tools}
    if plan.family == "hermes":
        start = text.find(HERMES_OPEN)
        if start < 0:
            return text, []
        found = [_load(m.group(1)) for m in _HERMES_CALL.finditer(text, start)]
        items = [i for f in found for i in (f if isinstance(f, list) else [f])]
        content = text[:start].strip()
    else:
        body = text.strip().removeprefix("[TOOL_CALLS]").strip()
        loaded = _load(body)
        if loaded is None and plan.family == "llama3":
            loaded = [_load(part) for part in body.split(";")]
        items = loaded if isinstance(loaded, list) else [loaded]
        content = ""
    calls = []
    for item in items:
        call = _as_call(item, names)
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    return content, calls if plan.parallel else calls[:1]


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_call(item: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _load(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class StreamSplitter:
    """Streams an answer's text as content until it may be starting a call; from there it is
    held, and parsed once the answer ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0
        """Characters of `text` already streamed as content."""

    def feed(self, piece: str) -> str:
        """Add generated text; returns the content that may be streamed now."""
        self.text += piece
        if self.plan.forced:
            return ""
        if self.plan.family == "hermes":
            start = self.text.find(HERMES_OPEN, self.sent)
            if start >= 0:
                keep = start
            else:  # hold a tail that may be the marker's beginning
                keep = len(self.text)
                for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
                    if HERMES_OPEN.startswith(self.text[-k:]):
                        keep = len(self.text) - k
                        break
        else:  # the answer is calls only when it begins with JSON: hold until it cannot
            head = self.text.lstrip()
            could_call = not head or head[0] in "{[" or "[TOOL_CALLS]".startswith(head[:12])
            keep = self.sent if could_call and self.sent == 0 else len(self.text)
        keep = max(keep, self.sent)
        out, self.sent = self.text[self.sent : keep], keep
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet streamed, calls) once the answer ended."""
        content, calls = parse_calls(self.plan, self.text)
        if not calls:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        unsent = content[self.sent :] if len(content) > self.sent else ""
        return unsent, calls
