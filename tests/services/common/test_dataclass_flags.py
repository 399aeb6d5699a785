"""Flags derived from config dataclasses: a field's type, default, choices and docstring become its
flag, and a command's flags cover its config (no field without a flag, no flag without a field)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Literal

import pytest

from services.common.dataclass_flags import FlagSpec, add_fields, attribute_docs, config_values
from services.preprocess import cli as preprocess_cli
from services.preprocess.job_config import PreprocessConfig


@dataclass(frozen=True)
class Example:
    """A config with one field of each kind."""

    name: str = "x"
    """--name: what to call it."""
    keys: tuple[str, ...] = ("text",)
    """--keys: fields to read."""
    mode: Literal["fast", "slow"] = "fast"
    """How to run."""
    count: int | None = None
    """How many (unset: all)."""
    verbose: bool = False
    """Say more."""


def _parser(specs=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_fields(parser, Example, [f.name for f in fields(Example)], specs)
    return parser


def test_types_defaults_choices_and_help_come_from_the_dataclass():
    parser = _parser()
    assert Example(**config_values(parser.parse_args([]), Example)) == Example()
    args = parser.parse_args(
        ["--keys", "a", "b", "--mode", "slow", "--count", "3", "--verbose", "--name", "y"]
    )
    assert Example(**config_values(args, Example)) == Example("y", ("a", "b"), "slow", 3, True)
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--mode", "medium"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        parser.parse_args(["--count", "many"])
    text = parser.format_help()
    assert "what to call it." in text and "--name: what" not in text  # the flag prefix is dropped
    assert attribute_docs(Example)["count"] == "How many (unset: all)."


def test_specs_add_spellings_and_requirements(capsys):
    parser = _parser({"keys": FlagSpec(aliases=("--key",)), "name": FlagSpec(required=True)})
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "required: --name" in capsys.readouterr().err
    assert parser.parse_args(["--name", "z", "--key", "k"]).keys == ["k"]


def test_preprocess_flags_cover_every_config_field():
    flagged = {name for names in preprocess_cli.GROUPS.values() for name in names}
    grpc_only = {"hf_datasets_options"}  # the inline form of --hf-datasets-params
    assert flagged | grpc_only == {f.name for f in fields(PreprocessConfig)}
    argv = ["--input", "a.jsonl", "b.jsonl", "--output-prefix", "out/x", "--json-key", "body",
            "--append-eod", "--workers", "2", "--tokenizer-type", "SentencePiece",
            "--tokenizer-model", "t.model"]  # fmt: skip
    args = preprocess_cli.build_parser().parse_args(argv)
    config = preprocess_cli.config_from_args(args)
    assert config.input == ("a.jsonl", "b.jsonl") and config.json_keys == ("body",)
    assert config.append_eod and config.workers == 2 and config.chunk_size == 256
    assert config.tokenizer_type == "SentencePiece" and config.shard_index == 0


@dataclass(frozen=True)
class Served:
    """A config whose flags need a spelling, a conversion and a tri-state switch."""

    port: int | None = None
    """Port of the front; 100% optional."""
    size: int | None = None
    """Budget in bytes."""
    caching: bool | None = None
    """Share blocks (default: where it can)."""
    rows: int = 32
    """Rows decoded together."""
    rate: float = 1.0
    """Steps a second."""


SERVED_SPECS = {
    "port": FlagSpec(flag="--front-port"),
    "size": FlagSpec(metavar="SIZE", convert=lambda text: int(text.removesuffix("k")) * 1000),
}


def test_spelling_conversion_tristate_and_defaults_in_help():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_fields(parser, Served, [f.name for f in fields(Served)], SERVED_SPECS, show_defaults=True)
    assert Served(**config_values(parser.parse_args([]), Served, SERVED_SPECS)) == Served()
    args = parser.parse_args(["--front-port", "8", "--size", "2k", "--no-caching"])
    assert args.front_port == 8 and args.size == "2k"  # stored under the spelling, as text
    assert Served(**config_values(args, Served, SERVED_SPECS)) == Served(8, 2000, False)
    assert parser.parse_args(["--caching"]).caching is True
    assert "--port" not in parser._option_string_actions  # the field's name is no spelling
    text = " ".join(parser.format_help().split())
    assert "100% optional." in text  # a docstring's % is text, not a format
    assert "Rows decoded together (default 32)." in text and "Steps a second (default 1)." in text
    assert "Budget in bytes." in text and "(default None)" not in text
