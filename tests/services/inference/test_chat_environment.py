"""The chat-template environment renders what transformers' `apply_chat_template` renders, for the
template features real families use: Llama 3.x dates its system prompt with `strftime_now`, and
templates stop loops with `{% break %}` (Jinja's loop controls)."""

from __future__ import annotations

from datetime import datetime

import pytest

from services.inference.openai_generation import chat_environment

transformers_templates = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATE = (
    "{{ bos_token }}Today Date: {{ strftime_now('%d %b %Y') }}\n"
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ m | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief <&>."},
    {"role": "user", "content": "hi"},
    {"role": "user", "content": "never rendered: the loop breaks first"},
]


def test_llama3_style_template_renders_as_transformers_does():
    names = {"messages": MESSAGES, "add_generation_prompt": True, "bos_token": "<s>"}
    ours = chat_environment().from_string(TEMPLATE).render(**names)
    theirs = transformers_templates._compile_jinja_template(TEMPLATE).render(**names)
    assert ours == theirs
    assert datetime.now().strftime("%d %b %Y") in ours and "never rendered" not in ours


def test_strftime_now_format_is_bounded():
    template = chat_environment().from_string("{{ strftime_now(fmt) }}")
    with pytest.raises(ValueError, match="at most 256"):
        template.render(fmt="%Y" * 200)
