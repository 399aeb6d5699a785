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
from pathlib import Path
from typing import Any, TextIO

from services.common import megatron_compat
from services.inference.config import DTYPES, LOAD_FORMATS

PROG = "meshline generate"


def build_parser() -> argparse.ArgumentParser:
    """Flags of `meshline generate`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False
    )
    load = parser.add_argument_group("model")
    load.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory")
    load.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    load.add_argument("--lora-load", default=None, metavar="DIR", help="LoRA adapter to merge")
    load.add_argument(
        "--tokenizer",
        "--tokenizer-name-or-path",
        "--tokenizer-model",
        default=None,
        help="tokenizer dir or .model file",
    )
    load.add_argument("--dtype", default="auto", choices=DTYPES)
    load.add_argument("--fp16", dest="dtype", action="store_const", const="float16")
    load.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16")
    what = parser.add_argument_group("input (one of)")
    what.add_argument(
        "--prompt", default=None, help="prompt text (encoded as the tokenizer's defaults say)"
    )
    what.add_argument("--input-ids", default=None, help="prompt token ids, comma separated")
    what.add_argument("--chat", action="store_true", help='interactive "You >>" session')
    what.add_argument("--prompt-template", default="plain", help="chat template (--chat)")
    what.add_argument("--system", default="", help="system message for --chat")
    sampling = parser.add_argument_group("decoding (HF names)")
    sampling.add_argument("--max-new-tokens", "--max-new-token", type=int, default=64)
    sampling.add_argument("--do-sample", action="store_true")
    sampling.add_argument("--temperature", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--num-beams", type=int, default=1)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--length-penalty", type=float, default=1.0)
    sampling.add_argument("--early-stopping", action="store_true")
    sampling.add_argument("--num-return-sequences", type=int, default=1)
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--seed", type=int, default=None, help="sampler seed (default: random)")
    parser.add_argument("--output-json", default=None, metavar="PATH", help="results as JSON")
    megatron_compat.add_flags(parser, skip=("--fp16", "--bf16"))
    return parser


def _sampling(args: argparse.Namespace) -> Any:
    from engine.sampling import SamplingConfig

    return SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_beams=args.num_beams,
        repetition_penalty=args.repetition_penalty,
        length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
        num_return_sequences=args.num_return_sequences,
        stop=tuple(args.stop),
        seed=secrets.randbits(63) if args.seed is None else args.seed,
    )


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
    from engine.validation import request_problems

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
    from models.templates import Message, get_template

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
        from engine.build import LoadSpec, build_engine
        from engine.config import EngineConfig
        from engine.loading import read_config

        compat = megatron_compat.resolve(args)
        megatron_compat.check_model(compat, read_config(Path(args.load), args.load_format))
        spec = LoadSpec(
            Path(args.load),
            args.load_format,
            Path(args.tokenizer) if args.tokenizer else None,
            Path(args.lora_load) if args.lora_load else None,
        )
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
