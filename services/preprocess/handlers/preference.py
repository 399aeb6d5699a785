"""The preference layouts people have, each parsed into a `Pair` (see handlers/pairwise.py).

| handler (alias) | record | default template |
| --- | --- | --- |
| PreferencePairwiseHandler (preference) | trl: `prompt`/`chosen`/`rejected` as text or as message lists; without `prompt`, chosen and rejected are whole texts/conversations sharing it | chatml (none for plain text) |
| HHRLHFPairwiseHandler (hh) | Anthropic HH-RLHF: `chosen`/`rejected` full dialogues in "\\n\\nHuman:"/"\\n\\nAssistant:" turns, equal up to the last Assistant turn | hh |
| RMStaticPairwiseHandler (rm-static) | Dahoas/rm-static: `prompt` (an HH dialogue ending "Assistant:"), `chosen`, `rejected` (`response` ignored: it repeats chosen) | hh |
| AlpacaStylePairwiseHandler (alpaca_pairwise) | `instruction`, `input`, `chosen`/`rejected` or `output: [chosen, rejected]`, optional `system`, `history: [[q, a], ...]` (MindSpeed-LLM / LLaMA-Factory) | alpaca |
| SharegptStylePairwiseHandler (sharegpt_pairwise) | `conversations` (or `messages`) ending with a user turn, `chosen`/`rejected` one assistant message each, optional `system` (MindSpeed-LLM / LLaMA-Factory) | chatml |
"""

from __future__ import annotations

import re
from typing import Any

from models.templates import Message
from services.preprocess.handlers.base import RecordError, require_text
from services.preprocess.handlers.conversation import parse_conversation
from services.preprocess.handlers.pairwise import Pair, PairwiseHandler, side_text

_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")


def parse_hh_dialogue(text: str, key: str) -> list[Message]:
    """Messages of an HH-RLHF dialogue ("\\n\\nHuman: ...\\n\\nAssistant: ..."), in order."""
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise RecordError(
            f"field {key!r} is not an HH dialogue: it must start with '\\n\\nHuman:' and "
            "alternate '\\n\\nHuman:' / '\\n\\nAssistant:' turns"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        Message(roles[speaker], body)
        for speaker, body in zip(parts[1::2], parts[2::2], strict=True)
    ]


def split_shared_prompt(
    chosen: list[Message], rejected: list[Message]
) -> tuple[list[Message], str, str]:
    """(shared prompt, chosen reply, rejected reply) of two whole conversations that differ in
    their final assistant turn only."""
    for side, messages in (("chosen", chosen), ("rejected", rejected)):
        if len(messages) < 2 or messages[-1].role != "assistant":
            raise RecordError(f"{side} must end with an assistant turn after a prompt")
    if chosen[:-1] != rejected[:-1]:
        raise RecordError(
            "chosen and rejected must share the prompt up to their last assistant turn; "
            f"they differ before it (chosen has {len(chosen) - 1} prompt turns, rejected "
            f"{len(rejected) - 1})"
        )
    return chosen[:-1], chosen[-1].content, rejected[-1].content


def _messages(value: Any, key: str) -> list[Message]:
    """A list of {role, content} messages (RecordError naming `key` otherwise)."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"field {key!r} must be a non-empty list of messages")
    # parse_conversation wants an assistant turn; a prompt has none, so add and drop one.
    return parse_conversation({"messages": [*value, {"role": "assistant", "content": ""}]})[:-1]


class PreferencePairwiseHandler(PairwiseHandler):
    """trl's preference format, standard or conversational, explicit or implicit prompt."""

    name = "PreferencePairwiseHandler"

    def parse(self, record: dict[str, Any]) -> Pair:
        """See the module table."""
        for key in ("chosen", "rejected"):
            if record.get(key) is None:
                raise RecordError(f"missing key {key!r}; keys present: {sorted(record)}")
        prompt = record.get("prompt")
        if prompt is None:
            return self._implicit(record["chosen"], record["rejected"])
        if isinstance(prompt, str):
            chosen, rejected = side_text(record, "chosen"), side_text(record, "rejected")
            conversational = not (
                isinstance(record["chosen"], str) and isinstance(record["rejected"], str)
            )
            return Pair([Message("user", prompt)], chosen, rejected, plain=not conversational)
        messages = _messages(prompt, "prompt")
        return Pair(messages, side_text(record, "chosen"), side_text(record, "rejected"))

    @staticmethod
    def _implicit(chosen: Any, rejected: Any) -> Pair:
        if isinstance(chosen, str) and isinstance(rejected, str):
            shared = _common_prefix(chosen, rejected)
            if not shared:
                raise RecordError(
                    "without a 'prompt' key, chosen and rejected must start with the same prompt "
                    "text; they share none (add a 'prompt' field)"
                )
            return Pair(
                [Message("user", shared)],
                chosen[len(shared) :],
                rejected[len(shared) :],
                plain=True,
            )
        if isinstance(chosen, list) and isinstance(rejected, list):
            whole_chosen = parse_conversation({"messages": chosen})
            whole_rejected = parse_conversation({"messages": rejected})
            prompt, chosen_text, rejected_text = split_shared_prompt(whole_chosen, whole_rejected)
            return Pair(prompt, chosen_text, rejected_text)
        raise RecordError(
            "chosen and rejected must both be strings or both be message lists, got "
            f"{type(chosen).__name__} and {type(rejected).__name__}"
        )


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


class HHRLHFPairwiseHandler(PairwiseHandler):
    """Anthropic HH-RLHF: two whole dialogues differing in the last Assistant turn."""

    name = "HHRLHFPairwiseHandler"
    default_template = "hh"

    def parse(self, record: dict[str, Any]) -> Pair:
        """See the module table."""
        chosen = parse_hh_dialogue(require_text(record, "chosen"), "chosen")
        rejected = parse_hh_dialogue(require_text(record, "rejected"), "rejected")
        prompt, chosen_text, rejected_text = split_shared_prompt(chosen, rejected)
        return Pair(prompt, chosen_text, rejected_text)


class RMStaticPairwiseHandler(PairwiseHandler):
    """Dahoas/rm-static (DeepSpeed-Chat's step-2 data): HH prompt plus chosen/rejected replies."""

    name = "RMStaticPairwiseHandler"
    default_template = "hh"

    def parse(self, record: dict[str, Any]) -> Pair:
        """See the module table."""
        messages = parse_hh_dialogue(require_text(record, "prompt"), "prompt")
        if messages[-1].role != "assistant" or messages[-1].content.strip():
            raise RecordError(
                "field 'prompt' must end with an empty '\\n\\nAssistant:' turn (rm-static's layout)"
            )
        chosen = require_text(record, "chosen").removeprefix(" ")
        rejected = require_text(record, "rejected").removeprefix(" ")
        return Pair(messages[:-1], chosen, rejected)


class AlpacaStylePairwiseHandler(PairwiseHandler):
    """Alpaca-style pairs (MindSpeed-LLM's AlpacaStylePairwiseHandler layout)."""

    name = "AlpacaStylePairwiseHandler"
    default_template = "alpaca"

    def parse(self, record: dict[str, Any]) -> Pair:
        """See the module table."""
        instruction = require_text(record, "instruction")
        extra = require_text(record, "input", optional=True)
        if "chosen" in record or "rejected" in record:
            chosen, rejected = side_text(record, "chosen"), side_text(record, "rejected")
        else:
            output = record.get("output")
            if not (isinstance(output, list) and len(output) == 2):
                raise RecordError(
                    "needs 'chosen' and 'rejected', or 'output' as [chosen, rejected]; "
                    f"keys present: {sorted(record)}"
                )
            chosen, rejected = side_text({"o": output[0]}, "o"), side_text({"o": output[1]}, "o")
        messages = (
            [Message("system", s)] if (s := require_text(record, "system", optional=True)) else []
        )
        history = record.get("history") or []
        if not isinstance(history, list):
            raise RecordError("field 'history' must be a list of [question, answer] pairs")
        for number, turn in enumerate(history):
            if not (
                isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn)
            ):
                raise RecordError(f"history[{number}] must be [question, answer] strings")
            messages += [Message("user", turn[0]), Message("assistant", turn[1])]
        messages.append(Message("user", self.template.user_content(instruction, extra)))
        return Pair(messages, chosen, rejected, has_input=bool(extra))


class SharegptStylePairwiseHandler(PairwiseHandler):
    """ShareGPT-style pairs (MindSpeed-LLM's SharegptStylePairwiseHandler layout)."""

    name = "SharegptStylePairwiseHandler"

    def parse(self, record: dict[str, Any]) -> Pair:
        """See the module table."""
        key = next((k for k in ("conversations", "messages") if k in record), None)
        if key is None:
            raise RecordError(
                f"missing key 'conversations' (or 'messages'); keys present: {sorted(record)}"
            )
        messages = _messages(record[key], key)
        system = require_text(record, "system", optional=True)
        if system and messages[0].role != "system":
            messages.insert(0, Message("system", system))
        return Pair(messages, side_text(record, "chosen"), side_text(record, "rejected"))
