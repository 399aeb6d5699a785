"""Tool-call formats of the model families: each family's answer is parsed into calls, the
forced-call grammar accepts exactly the family's well-formed calls, streamed text is held from
where a call may begin, and the prompt offers the tools through the template or the Hermes block."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from engine.grammar import grammar_tokenizer
from engine.tokens import TokenizerInfo
from models.tokenizer import build_tokenizer
from services.inference.openai_generation import chat_messages
from services.inference.openai_protocol import ChatCompletionRequest
from services.inference.tool_calls import (
    StreamSplitter,
    call_grammar,
    family_of,
    parse_calls,
    tool_plan,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
QWEN_LIKE = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}<tool_call>"
LLAMA_LIKE = "{% if tools %}Environment: ipython{% endif %}<|python_tag|>"
MISTRAL_LIKE = "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS][TOOL_CALLS]"


def _plan(template: str | None, choice: object = "auto", parallel: bool | None = None):
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=parallel,
    )
    return request, tool_plan(request, template)


def test_family_from_template():
    assert family_of(QWEN_LIKE) == "hermes" and family_of(None) == "hermes"
    assert family_of(LLAMA_LIKE) == "llama3" and family_of(MISTRAL_LIKE) == "mistral"


@pytest.mark.parametrize(
    "template, text",
    [
        (
            QWEN_LIKE,
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        (
            LLAMA_LIKE,
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}',
        ),
        (
            MISTRAL_LIKE,
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": "{}"}]',
        ),
    ],
)
def test_each_family_parses_its_calls(template, text):
    _, plan = _plan(template)
    content, calls = parse_calls(plan, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert content == ("Let me check." if plan.family == "hermes" else "")
    _, single = _plan(template, parallel=False)
    assert len(parse_calls(single, text)[1]) == 1


def test_text_without_a_well_formed_call_is_content():
    _, plan = _plan(None)
    for text in (
        "Sunny.",
        '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
        "<tool_call>\n{not json\n</tool_call>",
    ):
        assert parse_calls(plan, text) == (text, [])


def test_stream_holds_text_from_a_possible_call():
    _, plan = _plan(None)
    splitter = StreamSplitter(plan)
    pieces = [
        "Let me ",
        "check.<tool",
        "_call>\n{",
        '"name": "get_time", "arguments": {}}\n</tool_call>',
    ]
    streamed = "".join(splitter.feed(p) for p in pieces)
    rest, calls = splitter.finish()
    assert streamed + rest == "Let me check." and [c.name for c in calls] == ["get_time"]
    prose = StreamSplitter(plan)
    assert prose.feed("It is <b>") == "It is <b>" and prose.finish() == ("", [])


@pytest.fixture(scope="module")
def vocab(hf_tokenizer_dir):
    tokenizer = build_tokenizer("PretrainedFromHF", hf_tokenizer_dir)
    return grammar_tokenizer(TokenizerInfo.from_tokenizer(tokenizer, tokenizer.vocab_size))


def _accepts(vocab, grammar: str, text: str) -> bool:
    matcher = LLMatcher(vocab, grammar, log_level=0)
    return matcher.consume_tokens(vocab.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize(
    "template, good, bad",
    [
        (
            None,
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
            '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
        ),
        (
            LLAMA_LIKE,
            '{"name":"get_weather","parameters":{"city":"Oslo"}}',
            '{"name":"get_weather"}',
        ),
        (MISTRAL_LIKE, '[{"name":"get_weather","arguments":{"city":"Oslo"}}]', "Sunny."),
    ],
)
def test_forced_grammar_accepts_only_calls_of_the_named_function(vocab, template, good, bad):
    _, plan = _plan(template, {"type": "function", "function": {"name": "get_weather"}})
    grammar = call_grammar(plan)
    assert _accepts(vocab, grammar, good)
    assert not _accepts(vocab, grammar, bad)


def test_required_grammar_accepts_any_offered_function_repeated(vocab):
    _, plan = _plan(None, "required")
    one = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _accepts(vocab, call_grammar(plan), f"{one}\n{one}")
    _, single = _plan(None, "required", parallel=False)
    assert not _accepts(vocab, call_grammar(single), f"{one}\n{one}")


def test_prompt_offers_tools_through_the_template_or_the_hermes_block():
    _, plan = _plan(QWEN_LIKE)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ],
        tools=[WEATHER, TIME],
    )
    plain = chat_messages(history, "chatml without tool support", plan)
    assert plain[0]["role"] == "system" and "<tools>" in plain[0]["content"]
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}' in plain[2]["content"]
    assert plain[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}
    native = chat_messages(history, QWEN_LIKE + "{{ m.tool_calls }} 'tool'", plan)
    assert native[0]["role"] == "user", "the template renders the tools itself"
    assert native[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {}}
    assert native[2]["role"] == "tool" and native[2]["tool_call_id"] == "c1"
