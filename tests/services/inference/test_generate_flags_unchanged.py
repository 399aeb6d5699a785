"""`meshline generate`'s flags, recorded before they were derived from the config dataclasses:
every option string still parses in its --help group, and representative command lines (HF and
ModelLink spellings) parse to the same values. The expected values were produced by the
hand-written parser (main at fb33dd0); only what it produced is written here."""

from __future__ import annotations

from typing import Any

import pytest

from services.inference.cli import build_parser

GROUPS = {
    "options": ["-h", "--help", "--output-json"],
    "model": ["--load", "--load-format", "--lora-load", "--tokenizer", "--tokenizer-name-or-path",
              "--tokenizer-model", "--dtype", "--fp16", "--bf16"],
    "input (one of)": ["--prompt", "--input-ids", "--chat", "--prompt-template", "--system"],
    "decoding (HF names)": ["--max-new-tokens", "--max-new-token", "--do-sample", "--temperature",
                            "--top-k", "--top-p", "--num-beams", "--repetition-penalty",
                            "--length-penalty", "--early-stopping", "--num-return-sequences",
                            "--stop", "--seed"],
}  # fmt: skip
SWITCHES = {"-h", "--help", "--fp16", "--bf16", "--chat", "--do-sample", "--early-stopping"}
VALUES = {"--load-format": "hf", "--dtype": "float16", "--temperature": "0.5", "--top-p": "0.5",
          "--repetition-penalty": "1.5", "--length-penalty": "0.5"}  # fmt: skip

DEFAULTS = {
    "chat": False, "do_sample": False, "dtype": "auto", "early_stopping": False,
    "input_ids": None, "length_penalty": 1.0, "load": "ck", "load_format": "auto",
    "lora_load": None, "max_new_tokens": 64, "num_beams": 1, "num_return_sequences": 1,
    "output_json": None, "prompt": None, "prompt_template": "plain", "repetition_penalty": 1.0,
    "seed": None, "stop": [], "system": "", "temperature": 1.0, "tokenizer": None, "top_k": 0,
    "top_p": 1.0,
}  # fmt: skip
CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "defaults": (["--prompt", "hi"], {"prompt": "hi"}),
    "modellink": (
        ["--tokenizer-name-or-path", "tok", "--fp16", "--max-new-token", "8", "--input-ids",
         "1,2", "--seed", "5", "--num-layers", "2"],
        {"dtype": "float16", "input_ids": "1,2", "max_new_tokens": 8, "seed": 5,
         "tokenizer": "tok", "megatron__num_layers": "2"},
    ),
    "hf sampling": (
        ["--load-format", "hf", "--lora-load", "ad", "--tokenizer-model", "t.model", "--dtype",
         "float32", "--bf16", "--chat", "--prompt-template", "alpaca", "--system", "be brief",
         "--max-new-tokens", "9", "--do-sample", "--temperature", "0.5", "--top-k", "3",
         "--top-p", "0.9", "--num-beams", "2", "--repetition-penalty", "1.1",
         "--length-penalty", "0.8", "--early-stopping", "--num-return-sequences", "2",
         "--stop", "a", "--stop", "b c", "--output-json", "-"],
        {"chat": True, "do_sample": True, "dtype": "bfloat16", "early_stopping": True,
         "length_penalty": 0.8, "load_format": "hf", "lora_load": "ad", "max_new_tokens": 9,
         "num_beams": 2, "num_return_sequences": 2, "output_json": "-",
         "prompt_template": "alpaca", "repetition_penalty": 1.1, "stop": ["a", "b c"],
         "system": "be brief", "temperature": 0.5, "tokenizer": "t.model", "top_k": 3,
         "top_p": 0.9},
    ),
}  # fmt: skip


def test_every_option_string_is_still_in_its_group() -> None:
    now = {
        g.title: [s for a in g._group_actions for s in a.option_strings]
        for g in build_parser()._action_groups
    }
    for title, options in GROUPS.items():
        assert [o for o in now[title] if o in options] == options, title


@pytest.mark.parametrize("option", [o for options in GROUPS.values() for o in options])
def test_every_option_string_still_parses(option: str) -> None:
    if option in ("-h", "--help"):
        return  # prints and exits
    value = [] if option in SWITCHES else [VALUES.get(option, "7")]
    build_parser().parse_args(["--load", "ck", option, *value])


@pytest.mark.parametrize("case", sorted(CASES))
def test_command_lines_parse_to_the_same_values(case: str) -> None:
    argv, changed = CASES[case]
    parsed = vars(build_parser().parse_args(["--load", "ck", *argv]))
    given = {k: v for k, v in parsed.items() if not k.startswith("megatron__") or v}
    assert given == {**DEFAULTS, **changed}


@pytest.mark.parametrize(
    "argv",
    [[], ["--load", "ck", "--dtype", "float64"], ["--load", "ck", "--top-k", "x"],
     ["--load", "ck", "--load-format", "zip"], ["--load", "ck", "--stop"]],
)  # fmt: skip
def test_malformed_values_are_still_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and "error: " in capsys.readouterr().err
