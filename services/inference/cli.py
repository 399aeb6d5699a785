"""`meshline generate`: generate from a checkpoint without a server (one prompt, ids, or --chat).

    meshline generate --load DIR --prompt "The model" --max-new-tokens 32
    meshline generate --load DIR --input-ids 1,45,7 --num-beams 4 --output-json out.json
    meshline generate --load DIR --chat --prompt-template alpaca     # "You >>" session

Sampling flags carry Hugging Face's names and defaults (greedy unless --do-sample). Output is the
text (or token ids without a tokenizer); `--output-json PATH` (`-` for stdout) writes every
sequence with its ids, text, finish reason, log-probability and seed.

ModelLink's generation scripts run with the entry point renamed: `--fp16`/`--bf16` pick the
dtype, `--tokenizer-name-or-path` is `--tokenizer`, the architecture flags are checked against
the checkpoint before its weights are read, and parallel sizes above 1 are refused
(services/common/megatron_compat.py; docs/coming-from-modellink.md).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.config import EngineConfig, LoadSpec
from services.common import megatron_compat
from services.common.dataclass_flags import FlagSpec, add_fields, config_values
from services.inference.config import DTYPES, LOAD_FORMATS, path_or_none
from services.inference.generate_config import GenerateInput

if TYPE_CHECKING:
    from engine.sampling import SamplingConfig

PROG = "meshline generate"


LOAD_FLAGS = {
    "path": FlagSpec(flag="--load", required=True, metavar="DIR", convert=Path,
                     help="Checkpoint directory."),
    "load_format": FlagSpec(choices=LOAD_FORMATS, help="Layout of --load (auto: detect it)."),
    "lora": FlagSpec(flag="--lora-load", metavar="DIR", convert=path_or_none,
                     help="LoRA adapter to merge."),
    "tokenizer": FlagSpec(aliases=("--tokenizer-name-or-path", "--tokenizer-model"),
                          convert=path_or_none, help="Tokenizer dir or .model file."),
}  # fmt: skip
"""The `LoadSpec` fields' flags (in --help order), as generate spells and explains them."""
DTYPE_FLAG = {"dtype": FlagSpec(choices=DTYPES, help="Compute dtype (auto: the checkpoint's).")}
"""`EngineConfig.dtype`'s flag, the one engine setting generate takes."""
DECODING_FLAGS = {
    "max_new_tokens": FlagSpec(aliases=("--max-new-token",)),
    "stop": FlagSpec(
        help="A stop string: a sequence ends once its text contains one, the text cut before it "
        "(repeatable).",
        extra={"action": "append", "nargs": None},
    ),
    "seed": FlagSpec(
        help="Sampler seed, seed + i for the i-th sequence (default: a random one).",
        extra={"default": None},
    ),
}
"""What the decoding flags add to `SamplingConfig`: ModelLink's --max-new-token, one --stop per
string, a random seed unless one is given."""
REQUEST_ONLY = ("logprobs", "grammar")
"""`SamplingConfig` fields the servers take per request and generate has no flag for."""


def build_parser() -> argparse.ArgumentParser:
    """Flags of `meshline generate`, derived from `LoadSpec` and `EngineConfig.dtype` (the
    model), `GenerateInput` and `SamplingConfig` (decoding)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False
    )
    load = parser.add_argument_group("model")
    add_fields(load, LoadSpec, LOAD_FLAGS, LOAD_FLAGS)
    add_fields(load, EngineConfig, DTYPE_FLAG, DTYPE_FLAG)
    # ModelLink's precision switches; the last of --dtype/--fp16/--bf16 given wins.
    for switch, dtype in (("--fp16", "float16"), ("--bf16", "bfloat16")):
        load.add_argument(
            switch, dest="dtype", action="store_const", const=dtype, help=f"--dtype {dtype}."
        )
    inputs = [f.name for f in fields(GenerateInput) if f.name != "output_json"]
    add_fields(parser.add_argument_group("input (one of)"), GenerateInput, inputs)
    # torch (engine/sampling.py) once the parser is built, not when the command's module is
    # imported (tests/checkpoints/test_registry.py keeps that light).
    from engine.sampling import SamplingConfig

    decoding = [f.name for f in fields(SamplingConfig) if f.name not in REQUEST_ONLY]
    sampling = parser.add_argument_group("decoding (HF names)")
    add_fields(sampling, SamplingConfig, decoding, DECODING_FLAGS, show_defaults=True)
    add_fields(parser, GenerateInput, ["output_json"], {"output_json": FlagSpec(metavar="PATH")})
    megatron_compat.add_flags(parser, skip=("--fp16", "--bf16"))
    return parser


def _sampling(args: argparse.Namespace) -> SamplingConfig:
    from engine.sampling import SamplingConfig  # torch, as in build_parser

    values = config_values(args, SamplingConfig, DECODING_FLAGS)
    if values["seed"] is None:
        values["seed"] = secrets.randbits(63)
    return SamplingConfig(**values)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--input-ids {text!r}: expected comma-separated integers") from None


def _result_json(results: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "token_ids": r.token_ids,
            "text": r.text,
            "finish_reason": r.finish.value,
            "cumulative_logprob": r.cumulative_logprob,
            "seed": r.seed,
        }
        for r in results
    ]


def _write_json(path: str, payload: Any) -> None:
    text = json.dumps(payload, indent=2, ensure_ascii=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)


def _check(engine: Any, ids: list[int], config: Any, prompt_flag: str) -> None:
    """ValueError naming each flag at fault (engine.validation's rules, as the servers apply)."""
    from engine.validation import request_problems  # torch: only once a model is loaded

    problems = request_problems(ids, config, engine.request_limits())
    if problems:
        raise ValueError(
            "; ".join(
                f"{prompt_flag if p.field == 'prompt' else '--' + p.field.replace('_', '-')}: "
                f"{p.reason}"
                for p in problems
            )
        )


def chat(engine: Any, args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> list[dict]:
    """The interactive loop: read a line after "You >> ", answer, until EOF / exit / quit."""
    from models.templates import Message, get_template  # only for --chat

    tokens = engine.tokens
    tokens.require()
    template = get_template(args.prompt_template)
    history = [Message("system", args.system)] if args.system else []
    transcript = []
    while True:
        stdout.write("You >> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("exit", "quit"):
            break
        if not line.strip():
            continue
        history.append(Message("user", line.rstrip("\n")))
        ids = list(tokens.require().prefix_ids)  # what the tokenizer puts before a text
        for segment in template.render(history):
            ids += tokens.require().encode(segment.text)
            if segment.loss and tokens.eos_id is not None:
                ids.append(tokens.eos_id)
        config = _sampling(args)
        _check(engine, ids, config, "--chat")
        [results] = engine.generate([ids], [config])
        reply = results[0].text.strip()
        stdout.write(f"Meshline >> {reply}\n")
        history.append(Message("assistant", reply))
        transcript.append({"user": history[-2].content, "assistant": reply})
    return transcript


def main(argv: list[str] | None = None, stdin: TextIO | None = None) -> int:
    """Entry point of `meshline generate`; returns the exit code."""
    args = build_parser().parse_args(argv)
    given = sum(x is not None and x is not False for x in (args.prompt, args.input_ids, args.chat))
    if given != 1:
        print(f"{PROG}: give exactly one of --prompt, --input-ids and --chat", file=sys.stderr)
        return 2
    try:
        from engine.build import build_engine  # the model stack, once the flags are valid
        from engine.loading import read_config

        compat = megatron_compat.resolve(args)
        spec = LoadSpec(**config_values(args, LoadSpec, LOAD_FLAGS))
        megatron_compat.check_model(compat, read_config(spec.path, spec.load_format))
        _, engine = build_engine(spec, EngineConfig(dtype=args.dtype))
        tokens = engine.tokens
        if args.chat:
            transcript = chat(engine, args, stdin or sys.stdin, sys.stdout)
            if args.output_json:
                _write_json(args.output_json, {"chat": transcript})
            return 0
        ids = _parse_ids(args.input_ids) if args.input_ids else tokens.encode_prompt(args.prompt)
        config = _sampling(args)
        _check(engine, ids, config, "--input-ids" if args.input_ids else "--prompt")
        [results] = engine.generate([ids], [config])
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.output_json:
        _write_json(args.output_json, {"prompt_token_ids": ids, "sequences": _result_json(results)})
    if args.output_json != "-":
        for result in results:
            print(result.text if tokens.tokenizer is not None else result.token_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
