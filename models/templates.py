"""Prompt and chat templates as data, selectable by name (`--prompt-template`).

A conversation is a list of `Message(role, content)` with roles "system", "user", "assistant".
`PromptTemplate.render(messages)` turns it into text segments flagged with whether they carry
loss: only assistant replies do. Handlers tokenise each segment separately, so the boundary
between masked prompt and trained reply is exact in token space. The tokenizer's EOS id, not a
string, ends every assistant reply (see models/tokenizer.py), so one template serves any
tokenizer.

The strings follow each project's published format: Stanford Alpaca's prompt, BELLE's
"Human:/Assistant:", MOSS's `<|Human|>`/`<eoh>` markers, ChatML (`<|im_start|>`), Llama-2 chat's
`[INST]`/`<<SYS>>`, Vicuna v1.1 and the LeetCode-solution prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {list(ROLES)}")


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text; `loss` is True for assistant replies."""

    text: str
    loss: bool


@dataclass(frozen=True)
class PromptTemplate:
    """Strings that frame a conversation; `{content}` is replaced by the turn's text."""

    name: str
    """Registry key (the `--prompt-template` choice)."""
    description: str
    """One line for `--help` and the docs."""
    system_format: str = "{content}"
    """How a system message is written (emitted before the first user turn)."""
    default_system: str = ""
    """System text used when the conversation has none ("" = no system block)."""
    user_format: str = "{content}"
    """How a user turn is written, including the cue that introduces the reply."""
    assistant_format: str = "{content}"
    """How an assistant reply is written (this text carries loss)."""
    turn_separator: str = ""
    """Text after each assistant reply, before the next user turn (no loss)."""
    input_format: str = "{instruction}\n\n{input}"
    """Joins an instruction and its optional input (alpaca-style records) into one user turn."""
    system_with_input: str | None = None
    """Replaces `default_system` when an instruction record has a non-empty input (alpaca)."""

    def user_content(self, instruction: str, extra_input: str) -> str:
        """The user turn of an instruction record (`input_format` only when `extra_input` is set)."""
        if not extra_input:
            return instruction
        return self.input_format.format(instruction=instruction, input=extra_input)

    def render(self, messages: list[Message], *, has_input: bool = False) -> list[Segment]:
        """Segments of a conversation; assistant replies are the only `loss=True` segments."""
        segments: list[Segment] = []
        system = (
            self.system_with_input if has_input and self.system_with_input else self.default_system
        )
        turns = list(messages)
        if turns and turns[0].role == "system":
            system = turns.pop(0).content
        if system:
            segments.append(Segment(self.system_format.format(content=system), False))
        for index, message in enumerate(turns):
            if message.role == "system":
                raise ValueError(
                    f"template {self.name!r}: a system message may only open the conversation, "
                    f"found one at turn {index + 1}"
                )
            if message.role == "user":
                segments.append(Segment(self.user_format.format(content=message.content), False))
            else:
                segments.append(
                    Segment(self.assistant_format.format(content=message.content), True)
                )
                if self.turn_separator and index + 1 < len(turns):
                    segments.append(Segment(self.turn_separator, False))
        return segments


_ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
)
_ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
)

TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate(
            name="alpaca",
            description="Stanford Alpaca: '### Instruction:' / '### Input:' / '### Response:'",
            default_system=_ALPACA_NO_INPUT,
            system_with_input=_ALPACA_WITH_INPUT,
            user_format="### Instruction:\n{content}\n\n### Response:\n",
            input_format="{instruction}\n\n### Input:\n{input}",
            turn_separator="\n\n",
        ),
        PromptTemplate(
            name="belle",
            description="BELLE multi-turn: 'Human: ...' then 'Assistant: ...'",
            user_format="Human: {content}\n\nAssistant: ",
            turn_separator="\n\n",
        ),
        PromptTemplate(
            name="hh",
            description="Anthropic HH-RLHF dialogues: '\\n\\nHuman: ...' then '\\n\\nAssistant: ...'",
            user_format="\n\nHuman: {content}\n\nAssistant: ",
        ),
        PromptTemplate(
            name="moss",
            description="MOSS: '<|Human|>: ...<eoh>' then '<|MOSS|>: ...<eom>' after a meta instruction",
            system_format="{content}",
            user_format="<|Human|>: {content}<eoh>\n<|MOSS|>: ",
            assistant_format="{content}<eom>\n",
        ),
        PromptTemplate(
            name="chatml",
            description="ChatML (ShareGPT/OpenAI messages): '<|im_start|>role ... <|im_end|>'",
            system_format="<|im_start|>system\n{content}<|im_end|>\n",
            user_format="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
            assistant_format="{content}<|im_end|>\n",
        ),
        PromptTemplate(
            name="llama2-chat",
            description="Llama-2 chat: '[INST] <<SYS>>...<</SYS>> ... [/INST]'",
            system_format="<<SYS>>\n{content}\n<</SYS>>\n\n",
            user_format="[INST] {content} [/INST] ",
            assistant_format="{content} ",
        ),
        PromptTemplate(
            name="vicuna",
            description="Vicuna v1.1: 'USER: ... ASSISTANT: ...'",
            default_system=(
                "A chat between a curious user and an artificial intelligence assistant. The "
                "assistant gives helpful, detailed, and polite answers to the user's questions. "
            ),
            user_format="USER: {content} ASSISTANT: ",
            turn_separator=" ",
        ),
        PromptTemplate(
            name="leetcode",
            description="LeetCode problem -> Python solution, alpaca-style headers",
            default_system=(
                "Below is a programming problem. Write a Python solution that solves it.\n\n"
            ),
            user_format="### Problem:\n{content}\n\n### Python solution:\n",
        ),
        PromptTemplate(
            name="plain",
            description="No framing: user text then assistant text",
        ),
    )
}


def get_template(name: str) -> PromptTemplate:
    """The template registered under `name` (ValueError listing the known names otherwise)."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(
            f"--prompt-template {name!r} is unknown; choose one of {sorted(TEMPLATES)}"
        ) from None


def list_templates() -> list[str]:
    """Registered template names, sorted."""
    return sorted(TEMPLATES)
