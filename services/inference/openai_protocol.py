"""Request bodies of the OpenAI HTTP API as the inference front accepts them, and its errors.

Field names and defaults follow OpenAI's `/v1/completions` and `/v1/chat/completions`; the
extensions vLLM accepts are here under vLLM's names (`top_k`, `repetition_penalty`,
`use_beam_search`, `length_penalty`, `early_stopping`, `guided_*`, `structured_outputs`).
Unknown fields are refused by name (400). Types are checked here (pydantic); sampling values and limits by
`engine.validation` (the gRPC front's rules), answered as one 400 listing every problem.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.validation import MAX_LOGPROBS


class ApiError(Exception):
    """An error answered as OpenAI's JSON error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or _KINDS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def invalid(param: str, message: str) -> ApiError:
    """400 naming the field."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


class _Request(BaseModel):
    # Unknown fields are refused by name (400), never dropped: a field Meshline does not apply
    # (`tools`, `response_format`, ...) must not look accepted.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    """Send a last chunk with the request's token counts."""


MAX_TOOLS = 128
"""Tools per chat request (OpenAI's own limit); a longer list is a 400 naming `tools`."""
MAX_CHOICES = 256
"""Alternatives of `guided_choice` / `structured_outputs.choice`."""
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""Function and schema names, as OpenAI accepts them."""


class JsonSchemaSpec(_Request):
    """`response_format.json_schema`: the schema the answer must validate against."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    """The JSON schema (absent: any JSON object)."""
    strict: bool | None = None
    """Accepted either way: the schema is always enforced (the output is masked by it)."""


class ResponseFormat(_Request):
    """OpenAI `response_format`: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` (its newer spelling of the `guided_*` fields): one of them."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    """A JSON schema (object or its text) the output validates against."""
    regex: str | None = None
    """A regular expression (Rust `regex` syntax) the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""


class SamplingFields(_Request):
    """Decoding fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    """0: greedy. Unset: 1.0 (sampling), as OpenAI."""
    top_p: float | None = None
    top_k: int | None = None
    """vLLM extension; -1 or 0 disables."""
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = None
    """vLLM extension (Hugging Face semantics); 1.0 disables."""
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool = False
    """vLLM extension: beam search with `best_of` beams (default `n`), returning the best `n`."""
    best_of: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    """Structured output, OpenAI's form (services/inference/openai_structured.py)."""
    guided_json: str | dict[str, Any] | None = None
    """vLLM extension: a JSON schema the output validates against."""
    guided_regex: str | None = None
    """vLLM extension: a regular expression the whole output matches."""
    guided_choice: list[str] | None = None
    """vLLM extension: the output is exactly one of these strings."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM extension (its current name for the guided fields)."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    """New tokens per choice; 0 with `echo` returns the prompt's log-probabilities only."""
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True
    """vLLM extension: frame text prompts with the tokenizer's own special tokens (its BOS where
    it adds one), as transformers' `encode` does by default; false: the text's ids alone."""


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's form)."""


class ToolCall(_Request):
    """A call an assistant message made (sent back in a later turn)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Request):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON schema of the arguments (absent: no arguments)."""
    strict: bool | None = None
    """Accepted either way: forced calls always follow the schema; `auto` calls are parsed."""


class Tool(_Request):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming the function that must be called."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant turns: the calls it made."""
    tool_call_id: str | None = None
    """Tool turns: the call this is the result of."""

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    """vLLM extension: end the rendered prompt with the assistant cue."""
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default "auto" with tools, "none" without (services/inference/tool_calls.py)."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per answer; true or unset: one or more."""


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's; lm-eval's remote tokenizer uses it)."""

    prompt: str
    add_special_tokens: bool = True


class LoadLoraAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: str
    """The name requests pick it by (their `model`)."""
    lora_path: str
    """Its peft adapter directory on the server, under a --data-root."""


class UnloadLoraAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str
    lora_int_id: int | None = None
    """vLLM's numeric id; Meshline names adapters only, so it must be absent."""


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    tokens: list[int]
