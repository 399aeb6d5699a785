"""Pairwise (preference) records: one prompt, a chosen and a rejected response.

Every pairwise handler turns its layout into a conversation prefix (the prompt: system, user and
earlier assistant turns) plus two final assistant replies, renders them through the prompt
template, and writes MindSpeed-LLM's four aligned datasets (`PAIRWISE_KEYS`):
`chosen_input_ids` / `chosen_labels` and `rejected_input_ids` / `rejected_labels`, where each side
is the prompt followed by its reply and the EOS id, and labels equal the ids (unshifted) except
`IGNORE_INDEX` on the prompt: only the responses carry loss (earlier assistant turns of a
multi-turn prompt are context, not targets).

Tokenisation goes through `encode_segments`, the one path instruction data takes: the prompt is
tokenised once, each reply once, so a side is exactly the SFT sample of the same conversation.
With --seq-length each side is cut at that many tokens; a pair left without a response token on
either side, or with both sides equal, is refused naming the record.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from models.templates import Message, PromptTemplate, Segment, get_template
from services.preprocess.handlers.base import (
    IGNORE_INDEX,
    PAIRWISE_KEYS,
    Handler,
    RecordError,
    Sample,
    encode_segments,
)


@dataclass(frozen=True)
class Pair:
    """One preference record, parsed."""

    prompt: list[Message]
    """The conversation the responses answer (ends with a user turn)."""
    chosen: str
    """The preferred reply."""
    rejected: str
    """The dispreferred reply."""
    plain: bool = False
    """Plain text, not a conversation: rendered without a chat template unless
    --prompt-template names one."""
    has_input: bool = False
    """An alpaca record with a non-empty `input` (the template's system text for that case)."""


class PairwiseHandler(Handler):
    """Base of the preference handlers: subclasses turn a record into (prompt, chosen, rejected)."""

    is_pairwise = True
    default_template = "chatml"

    def output_keys(self) -> tuple[str, ...]:
        """The four pairwise datasets."""
        return PAIRWISE_KEYS

    @abstractmethod
    def parse(self, record: dict[str, Any]) -> Pair:
        """The record's prompt and responses (RecordError naming what is wrong)."""

    def process(self, record: dict[str, Any]) -> Sample | None:
        """The pair's aligned ids and labels (RecordError naming what is wrong)."""
        pair = self.parse(record)
        template = self.template
        if pair.plain and self.options.prompt_template is None:
            template = get_template("plain")  # plain text is used as written, as trl does
        return self.encode_pair(
            pair.prompt, pair.chosen, pair.rejected, template, has_input=pair.has_input
        )

    def encode_pair(
        self,
        prompt: list[Message],
        chosen: str,
        rejected: str,
        template: PromptTemplate,
        *,
        has_input: bool = False,
    ) -> Sample:
        """Tokenise the prompt once and each reply once (see the module docstring)."""
        for side, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise RecordError(f"the {side} response is empty")
        if chosen == rejected:
            raise RecordError("chosen and rejected are the same response; a pair must differ")
        if not prompt or prompt[-1].role != "user":
            raise RecordError("the prompt must end with a user turn that the responses answer")
        try:
            rendered = template.render([*prompt, Message("assistant", chosen)], has_input=has_input)
        except ValueError as exc:
            raise RecordError(str(exc)) from exc
        # The reply is the last segment (render adds no separator after the final turn).
        prompt_sample = encode_segments(self, rendered[:-1])
        prompt_ids = prompt_sample.get("packed_input_ids", [])
        sides: Sample = {}
        for side, text in (("chosen", chosen), ("rejected", rejected)):
            reply = Segment(template.assistant_format.format(content=text), True)
            # The sample's framing (BOS where the tokenizer adds one) comes with the prompt only.
            framing = len(self.tokenizer.prefix_ids)
            reply_ids = encode_segments(self, [reply])["packed_input_ids"][framing:]
            ids = prompt_ids + reply_ids
            labels = [IGNORE_INDEX] * len(prompt_ids) + reply_ids
            limit = self.options.seq_length
            if limit is not None and len(ids) > limit:
                ids, labels = ids[:limit], labels[:limit]
            if all(label == IGNORE_INDEX for label in labels):
                raise RecordError(
                    f"the prompt ({len(prompt_ids)} tokens) leaves no room for the {side} "
                    f"response within --seq-length {limit}; raise --seq-length or drop the record"
                )
            sides[f"{side}_input_ids"], sides[f"{side}_labels"] = ids, labels
        if sides["chosen_input_ids"] == sides["rejected_input_ids"]:
            raise RecordError(
                f"chosen and rejected are the same within --seq-length {self.options.seq_length} "
                "tokens; raise --seq-length or drop the record"
            )
        return sides


def side_text(record: dict[str, Any], key: str) -> str:
    """A response given as a string, or as one assistant message ({role/from, content/value})
    or a list holding one (trl's conversational layout)."""
    if key not in record or record[key] is None:
        raise RecordError(f"missing key {key!r}; keys present: {sorted(record)}")
    value = record[key]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        text = value.get("content", value.get("value"))
        role = str(value.get("role", value.get("from", "assistant"))).lower()
        if role not in ("assistant", "gpt", "bot", "chatgpt") or not isinstance(text, str):
            raise RecordError(
                f"field {key!r} must be one assistant message with a string content, got {value!r:.80}"
            )
        return text
    if not isinstance(value, str):
        raise RecordError(
            f"field {key!r} must be a string or one assistant message, got {type(value).__name__}"
        )
    return value
