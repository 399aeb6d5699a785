"""`serve inference`'s flags, recorded before they were derived from the config dataclasses:
every option string still parses in its --help group, and representative command lines (vLLM's
and Megatron's spellings as the other tests use them) give the same configs as before.

The expected values below were produced by the hand-written parser (main at fb33dd0); only what
it produced is written here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from services.common.dataclass_flags import FlagSpec, attribute_docs
from services.common.service_cli import build_parser
from services.inference.__main__ import CLI
from services.inference.config import FLAG_SPECS, FLAGS, InferenceServiceConfig, from_args
from services.inference.http_config import FLAG_SPECS as HTTP_FLAG_SPECS
from services.inference.http_config import HttpConfig, http_config_from_args

GROUPS = {
    "server": ["--host", "--port", "--max-concurrent-rpcs", "--max-message-mb", "--grace-period",
               "--auth-token-file", "--tls-cert", "--tls-key", "--tls-client-ca", "--state-dir",
               "--log-level", "--log-format", "--metrics-port", "--metrics-secure"],
    "inference service": [
        "--load", "--load-format", "--tokenizer", "--dtype", "--lora-load", "--enable-lora",
        "--lora-modules", "--max-loras", "--max-lora-rank", "--data-root",
        "--tensor-parallel-size", "--pipeline-parallel-size", "--max-batch-rows",
        "--max-model-len", "--kv-cache-memory", "--gpu-memory-utilization", "--batch-wait-ms",
        "--cpu-linear", "--compile-decode", "--decode-step", "--enforce-eager",
        "--speculative-config", "--block-size", "--enable-prefix-caching",
        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", "--max-new-tokens-limit", "--max-num-beams",
        "--max-score-items", "--max-stop-strings", "--max-stop-string-chars", "--max-text-chars",
        "--max-score-tokens", "--max-request-mb", "--allow-weight-updates"],
    "OpenAI-compatible HTTP API": [
        "--http-port", "--served-model-name", "--chat-template", "--http-max-request-mb",
        "--http-max-concurrent-requests", "--http-max-prompts"],
}  # fmt: skip
"""Each --help group's option strings, in their order."""

SWITCHES = {
    "--metrics-secure", "--enable-lora", "--compile-decode", "--enforce-eager",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--allow-weight-updates"}  # fmt: skip
CHOICES = {
    "--load-format": ["auto", "hf", "native", "megatron", "quantized"],
    "--dtype": ["auto", "float32", "bfloat16", "float16"],
    "--cpu-linear": ["auto", "dense", "packed", "packed+gemv", "colmajor"],
    "--decode-step": ["auto", "lean", "module"],
    "--log-level": ["debug", "info", "warning", "error"],
    "--log-format": ["text", "json"],
}
"""The values the restricted flags accepted (each one must still parse)."""
VALUES = {"--lora-modules": ["a=x", '{"name": "b", "path": "y"}'], "--data-root": ["/"],
          "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 2}'],
          "--kv-cache-memory": ["2GiB"], "--gpu-memory-utilization": ["0.5"],
          "--batch-wait-ms": ["2.5"], "--http-max-request-mb": ["2.5"],
          "--grace-period": ["1.5"], "--chat-template": ["chatml"],
          "--served-model-name": ["m"], "--host": ["0.0.0.0"]}  # fmt: skip
"""A value for flags whose value is not a small integer or a path."""
PATHS = {"--load", "--tokenizer", "--lora-load", "--auth-token-file", "--tls-cert", "--tls-key",
         "--tls-client-ca", "--state-dir"}  # fmt: skip


def serve_parser() -> argparse.ArgumentParser:
    """The `serve` parser of `python -m services.inference` (server + service + HTTP flags)."""
    parser = build_parser(CLI)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_option_string_is_still_in_its_group() -> None:
    parser = serve_parser()
    now = {
        g.title: [s for a in g._group_actions for s in a.option_strings]
        for g in parser._action_groups
    }
    for title, options in GROUPS.items():
        assert [o for o in now[title] if o in options] == options, title


@pytest.mark.parametrize("option", [o for options in GROUPS.values() for o in options])
def test_every_option_string_still_parses(option: str) -> None:
    parser = serve_parser()
    if option in SWITCHES:
        values = [[]]
    elif option in CHOICES:
        values = [[choice] for choice in CHOICES[option]]
    elif option in VALUES:
        values = [VALUES[option]]
    elif option in PATHS:
        values = [["some/dir"]]
    else:
        values = [["7"]]
    for value in values:
        parser.parse_args([option, *value])


def _adapter(directory: Path) -> Path:
    directory.mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def _plain(value: Any, tmp: Path) -> Any:
    """`value` with dataclasses as dicts, sequences as lists, paths as strings under '<tmp>'."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name), tmp) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v, tmp) for v in value]
    if isinstance(value, Path):
        return str(value).replace(str(tmp), "<tmp>")
    return value


DEFAULT_SERVICE = {
    "data_roots": ["<cwd>"], "load": None, "load_format": "auto", "tokenizer": None,
    "dtype": "auto", "lora_load": None, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
    "max_batch_rows": 32, "max_model_len": None, "kv_cache_memory": None,
    "gpu_memory_utilization": None, "batch_wait_ms": 1.0, "cpu_linear": "auto",
    "compile_decode": False, "decode_step": "auto", "enforce_eager": False,
    "speculative_config": None, "block_size": 16, "enable_prefix_caching": None,
    "enable_chunked_prefill": None, "max_num_batched_tokens": None,
    "max_new_tokens_limit": 4096, "max_num_beams": 16, "max_score_items": 1024,
    "max_stop_strings": 16, "max_stop_string_chars": 256, "max_text_chars": 1000000,
    "max_score_tokens": 65536, "max_request_mb": 16, "allow_weight_updates": False,
    "enable_lora": False, "lora_modules": [], "max_loras": None, "max_lora_rank": None,
}  # fmt: skip
DEFAULT_HTTP = {"http_port": None, "served_model_name": None, "chat_template": "auto",
                "max_request_mb": 16.0, "max_concurrent_requests": 64, "max_prompts": 256}  # fmt: skip

# (command line with {tmp} for the test's directory, service fields, HTTP fields) that differ
# from the defaults above.
CASES: dict[str, tuple[list[str], dict[str, Any], dict[str, Any]]] = {
    "no model": ([], {}, {}),
    "checkpoint": (["--load", "{tmp}/ckpt"], {"load": "<tmp>/ckpt"}, {}),
    "vllm engine": (
        ["--load", "{tmp}/ckpt", "--load-format", "hf", "--dtype", "bfloat16",
         "--max-model-len", "64", "--kv-cache-memory", "1.5GiB", "--max-batch-rows", "3",
         "--cpu-linear", "packed", "--decode-step", "module", "--enforce-eager",
         "--block-size", "32", "--no-enable-prefix-caching", "--enable-chunked-prefill",
         "--max-num-batched-tokens", "512", "--batch-wait-ms", "0",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
        {"load": "<tmp>/ckpt", "load_format": "hf", "dtype": "bfloat16", "max_model_len": 64,
         "kv_cache_memory": 1610612736, "max_batch_rows": 3, "cpu_linear": "packed",
         "decode_step": "module", "enforce_eager": True, "block_size": 32,
         "enable_prefix_caching": False, "enable_chunked_prefill": True,
         "max_num_batched_tokens": 512, "batch_wait_ms": 0.0,
         "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                "prompt_lookup_max": 5, "prompt_lookup_min": 5, "model": None,
                                "disable_by_batch_size": None}},
        {},
    ),
    "lora": (
        ["--load", "{tmp}/ckpt", "--lora-modules", "a={tmp}/a",
         '{"name": "b", "path": "{tmp}/b", "base_model_name": "base"}', "--max-loras", "3",
         "--max-lora-rank", "8", "--data-root", "{tmp}", "--data-root", "{tmp}/ckpt",
         "--enable-prefix-caching", "--no-enable-chunked-prefill"],
        {"load": "<tmp>/ckpt", "data_roots": ["<tmp>", "<tmp>/ckpt"], "max_loras": 3,
         "max_lora_rank": 8, "enable_prefix_caching": True, "enable_chunked_prefill": False,
         "lora_modules": [{"name": "a", "path": "<tmp>/a", "base_model_name": None},
                          {"name": "b", "path": "<tmp>/b", "base_model_name": "base"}]},
        {},
    ),
    "enable lora": (
        ["--load", "{tmp}/ckpt", "--enable-lora", "--max-lora-rank", "64"],
        {"load": "<tmp>/ckpt", "enable_lora": True, "max_lora_rank": 64},
        {},
    ),
    "megatron parallel": (
        ["--load", "{tmp}/ckpt", "--load-format", "megatron", "--tokenizer", "{tmp}/tok.model",
         "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
         "--gpu-memory-utilization", "0.5", "--dtype", "float16"],
        {"load": "<tmp>/ckpt", "load_format": "megatron", "tokenizer": "<tmp>/tok.model",
         "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "gpu_memory_utilization": 0.5,
         "dtype": "float16"},
        {},
    ),
    "limits and updates": (
        ["--load", "{tmp}/ckpt", "--lora-load", "{tmp}/a", "--max-new-tokens-limit", "10",
         "--max-num-beams", "2", "--max-score-items", "3", "--max-stop-strings", "4",
         "--max-stop-string-chars", "5", "--max-text-chars", "6", "--max-score-tokens", "7",
         "--max-request-mb", "8", "--allow-weight-updates", "--cpu-linear", "colmajor",
         "--compile-decode", "--decode-step", "lean"],
        {"load": "<tmp>/ckpt", "lora_load": "<tmp>/a", "max_new_tokens_limit": 10,
         "max_num_beams": 2, "max_score_items": 3, "max_stop_strings": 4,
         "max_stop_string_chars": 5, "max_text_chars": 6, "max_score_tokens": 7,
         "max_request_mb": 8, "allow_weight_updates": True, "cpu_linear": "colmajor",
         "compile_decode": True, "decode_step": "lean"},
        {},
    ),
    "http": (
        ["--http-port", "0", "--served-model-name", "m", "--chat-template", "chatml",
         "--http-max-request-mb", "2.5", "--http-max-concurrent-requests", "3",
         "--http-max-prompts", "7", "--max-request-mb", "4"],
        {"max_request_mb": 4},
        {"http_port": 0, "served_model_name": "m", "chat_template": "chatml",
         "max_request_mb": 2.5, "max_concurrent_requests": 3, "max_prompts": 7},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_command_lines_give_the_same_configs(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "tok.model").write_bytes(b"")
    _adapter(tmp_path / "a")
    _adapter(tmp_path / "b")
    monkeypatch.chdir(tmp_path / "ckpt")
    tmp = tmp_path.resolve()
    argv, service, http = CASES[case]
    args = serve_parser().parse_args([a.replace("{tmp}", str(tmp)) for a in argv])
    expected = {**DEFAULT_SERVICE, "data_roots": ["<tmp>/ckpt"], **service}
    assert _plain(from_args(args), tmp) == expected
    assert _plain(http_config_from_args(args), tmp) == {**DEFAULT_HTTP, **http}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-memory", "2 lots"], "--kv-cache-memory '2 lots': give a size in bytes"),
        (["--lora-modules", "nameonly"], "--lora-modules 'nameonly': give name=DIR"),
        (["--speculative-config", "{"], "--speculative-config"),
        (["--data-root", "/"], "--data-root bounds adapter directories loaded at run time"),
        (["--max-lora-rank", "8"], "--max-lora-rank needs --enable-lora or --lora-modules"),
        (["--http-port", "70000"], "--http-port must be in [0, 65535]"),
    ],
)
def test_user_errors_still_name_the_flag(argv: list[str], message: str) -> None:
    args = serve_parser().parse_args(argv)
    with pytest.raises(ValueError) as info:
        from_args(args)
        http_config_from_args(args)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "argv",
    [["--dtype", "float64"], ["--load-format", "zip"], ["--cpu-linear", "x"],
     ["--decode-step", "fast"], ["--max-batch-rows", "many"], ["--http-port", "x"],
     ["--lora-modules"], ["--enable-lora", "yes"]],
)  # fmt: skip
def test_malformed_values_are_still_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        serve_parser().parse_args(argv)
    assert info.value.code == 2
    assert "error: " in capsys.readouterr().err


def test_every_config_field_has_its_flag() -> None:
    """Both configs are the flags' one source: no field without a flag, whose help is the
    field's docstring."""
    assert set(FLAGS) == {f.name for f in dataclasses.fields(InferenceServiceConfig)}
    helps = {a.dest: a.help for a in serve_parser()._actions}
    for cls, specs in ((InferenceServiceConfig, FLAG_SPECS), (HttpConfig, HTTP_FLAG_SPECS)):
        for name, doc in attribute_docs(cls).items():
            if name != "data_roots":  # the --data-root flag every job service shares
                dest = specs.get(name, FlagSpec()).dest(name)
                assert helps[dest].startswith(doc.rstrip(".").replace("%", "%%")), name
