"""vLLM's `POST /pooling` for a served reward model: the request body and the inputs it names.

vLLM serves reward models (`--runner pooling`, e.g. `internlm2-1_8b-reward`) on `/pooling`,
with a completions-like body (`input`: a text, texts, ids or lists of ids; `add_special_tokens`)
or a chat-like one (`messages`, rendered with the chat template; `add_generation_prompt`,
default false). Each input's result is `{"index", "object": "pooling", "data": [reward]}`: the
value head's score of its last token, no activation (transformers' logits of the HF export).
Fields vLLM has and Meshline does not apply (`truncate_prompt_tokens`, `dimensions`, `task`,
`encoding_format` other than "float", ...) are refused by name (400), as every unknown field is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.inference.openai_protocol import ChatCompletionRequest, ChatMessage, invalid


class PoolingRequest(BaseModel):
    """POST /pooling (vLLM's): `input` or `messages`, one reward per input."""

    model_config = ConfigDict(extra="forbid")  # unknown fields are refused by name

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    """A text, several texts, one id list or several id lists."""
    add_special_tokens: bool = True
    """Texts of `input` get the tokenizer's special tokens (BOS) (vLLM's field)."""
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    """One conversation, rendered with the chat template (the HTTP front's --chat-template)."""
    add_generation_prompt: bool = False
    """End the rendered conversation with the assistant cue (vLLM's default: no)."""
    encoding_format: Literal["float"] = "float"
    """Results as JSON numbers (vLLM's base64 form is not served)."""
    user: str | None = None
    """OpenAI's end-user id; logged nowhere, accepted for clients that always send it."""

    @model_validator(mode="after")
    def _one_form(self) -> PoolingRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input and messages")
        return self


def pooling_texts_or_ids(body: PoolingRequest) -> list[str | list[int]]:
    """The inputs of an `input` body, each a text or an id list (400 naming an empty one)."""
    value = body.input
    assert value is not None
    items: list[Any]
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [list(value)]
    else:
        items = list(value)
    if not items:
        raise invalid("input", "give at least one input to score")
    for i, item in enumerate(items):
        if len(item) == 0:
            raise invalid(f"input[{i}]", "is empty")
    return items


def as_chat(body: PoolingRequest) -> ChatCompletionRequest:
    """The conversation of a `messages` body as the chat route renders it."""
    assert body.messages is not None
    return ChatCompletionRequest(
        messages=body.messages, add_generation_prompt=body.add_generation_prompt
    )


def pooling_response(
    name: str, created: int, request_id: str, rewards: list[float], lengths: list[int]
) -> dict[str, Any]:
    """vLLM's PoolingResponse: one `{"index", "object": "pooling", "data": [reward]}` per input."""
    tokens = sum(lengths)
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": name,
        "data": [
            {"index": i, "object": "pooling", "data": [reward]} for i, reward in enumerate(rewards)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
