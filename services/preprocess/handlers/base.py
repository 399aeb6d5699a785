"""The prompt-handler interface: one input record in, token-id lists per output key out.

A handler is built once per worker process with the tokenizer and `HandlerOptions`, then called on
batches of records. Pretraining handlers emit one dataset per `--json-keys` entry
(`{prefix}_{key}_document`); instruction handlers emit ModelLink's three aligned datasets
`packed_input_ids`, `packed_attention_mask` and `packed_labels`, where labels equal input_ids
(unshifted) except `IGNORE_INDEX` on tokens that carry no loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from models.templates import PromptTemplate, Segment, get_template
from models.tokenizer import Tokenizer

IGNORE_INDEX = -100
INSTRUCTION_KEYS = ("packed_input_ids", "packed_attention_mask", "packed_labels")
PAIRWISE_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
"""What pairwise (preference) handlers write: MindSpeed-LLM's json keys (`handlers/pairwise.py`)."""

Sample = dict[str, list[int]]


class RecordError(ValueError):
    """A record the handler cannot use (missing key, wrong type); the message names the fix."""


@dataclass(frozen=True)
class HandlerOptions:
    """Settings every handler receives (mapped from the preprocess flags)."""

    json_keys: tuple[str, ...] = ("text",)
    """Record fields to tokenise (`--json-keys`); pretraining writes one dataset per key."""
    append_eod: bool = False
    """Append the tokenizer's EOD id to every pretraining document (`--append-eod`)."""
    seq_length: int | None = None
    """Truncate instruction samples to this many tokens (`--seq-length`; None = no limit)."""
    prompt_template: str | None = None
    """Template name overriding the handler's default (`--prompt-template`)."""


@dataclass
class Handler(ABC):
    """Base class of prompt handlers; subclasses set `name` and implement `process`."""

    tokenizer: Tokenizer
    options: HandlerOptions = field(default_factory=HandlerOptions)

    name: ClassVar[str] = ""
    is_instruction: ClassVar[bool] = False
    is_pairwise: ClassVar[bool] = False
    default_template: ClassVar[str | None] = None

    def output_keys(self) -> tuple[str, ...]:
        """Names of the datasets this handler writes, in order."""
        return output_keys_of(type(self), self.options.json_keys)

    @property
    def template(self) -> PromptTemplate:
        """The prompt template in use (`--prompt-template`, else the handler's default)."""
        name = self.options.prompt_template or self.default_template or "plain"
        return get_template(name)

    @abstractmethod
    def process(self, record: dict[str, Any]) -> Sample | None:
        """Token ids per output key for one record; None drops it; RecordError if unusable."""

    def process_batch(self, records: Sequence[dict[str, Any]]) -> list[Sample | RecordError | None]:
        """`process` over a batch; errors are returned in place so the caller can skip or fail."""
        results: list[Sample | RecordError | None] = []
        for record in records:
            try:
                results.append(self.process(record))
            except RecordError as exc:
                results.append(exc)
        return results

    def describe(self) -> dict[str, Any]:
        """JSON-safe identity for the manifest."""
        return {
            "name": self.name or type(self).__name__,
            "class": f"{type(self).__module__}:{type(self).__qualname__}",
            "instruction": self.is_instruction,
            "pairwise": self.is_pairwise,
            "template": self.template.name if self.is_instruction or self.is_pairwise else None,
            "output_keys": list(self.output_keys()),
        }


def output_keys_of(handler_class: type[Handler], json_keys: Sequence[str]) -> tuple[str, ...]:
    """The datasets a handler class writes (needs no tokenizer: for --overwrite checks)."""
    if handler_class.is_pairwise:
        return PAIRWISE_KEYS
    return INSTRUCTION_KEYS if handler_class.is_instruction else tuple(json_keys)


def require_text(record: dict[str, Any], *keys: str, optional: bool = False) -> str:
    """The first of `keys` present in `record` as a string (RecordError naming keys otherwise)."""
    for key in keys:
        if key in record and record[key] is not None:
            value = record[key]
            if not isinstance(value, str):
                raise RecordError(f"field {key!r} must be a string, got {type(value).__name__}")
            return value
    if optional:
        return ""
    wanted = repr(keys[0]) if len(keys) == 1 else f"one of {list(keys)}"
    raise RecordError(f"missing key {wanted}; keys present: {sorted(record)}")


def encode_segments(
    handler: Handler, segments: Sequence[Segment], *, eos_after_reply: bool = True
) -> Sample:
    """Tokenise rendered segments into aligned input_ids / attention_mask / labels.

    The sample starts with what the tokenizer puts before a text with its default settings (BOS
    for Llama-style tokenizers, nothing for GPT-2/Qwen-style ones: the served prompt's framing),
    without loss; each segment is then encoded without special tokens (special tokens written in
    the template's text, `<|im_start|>`, become their ids). With `eos_after_reply` every
    loss-carrying segment (an assistant reply) is followed by the EOS id, which also carries loss
    so the model learns to stop; without it (formats whose text marks turn ends itself) one EOS
    ends the sample. Samples longer than `seq_length` are truncated.
    """
    tokenizer = handler.tokenizer
    texts = [segment.text for segment in segments]
    encoded = tokenizer.encode_batch(texts) if texts else []
    input_ids: list[int] = list(tokenizer.prefix_ids)
    labels: list[int] = [IGNORE_INDEX] * len(input_ids)
    for segment, ids in zip(segments, encoded, strict=True):
        if segment.loss:
            if eos_after_reply:
                ids = [*ids, tokenizer.eod_id]
            labels.extend(ids)
        else:
            labels.extend([IGNORE_INDEX] * len(ids))
        input_ids.extend(ids)
    has_text = len(input_ids) > len(tokenizer.prefix_ids)
    if not eos_after_reply and has_text:
        input_ids.append(tokenizer.eod_id)
        labels.append(tokenizer.eod_id)
    limit = handler.options.seq_length
    if limit is not None and len(input_ids) > limit:
        input_ids, labels = input_ids[:limit], labels[:limit]
    if not has_text:
        return {}
    return {
        "packed_input_ids": input_ids,
        "packed_attention_mask": [1] * len(input_ids),
        "packed_labels": labels,
    }
