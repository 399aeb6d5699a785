"""Cost of judging HumanEval completions in the sandbox, one at a time and two at a time.

    python -m bench.bench_sandbox [--repeat 10]

Scores the fixture problems' canonical solutions (each must pass) `--repeat` times through
`HumanEval.process_many`, with 1 and then 2 workers, and prints milliseconds per completion.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from services.evaluator.tasks.humaneval import HumanEval

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "evaluator" / "humaneval"


def main() -> None:
    """Print ms per completion for 1 and 2 workers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    problems = [json.loads(line) for line in (FIXTURES / "HumanEval.jsonl").open()]
    docs = problems * args.repeat
    answers = [[doc["canonical_solution"]] for doc in docs]
    task = HumanEval()
    task.process_many(docs[:1], answers[:1])  # warm-up (and the isolation probe)
    for workers in (1, 2):
        task.workers = workers
        start = time.perf_counter()
        scores = task.process_many(docs, answers)
        per = (time.perf_counter() - start) / len(docs)
        assert all(s["pass@1,create_test"] == 1.0 for s in scores)
        print(f"{len(docs)} completions, {workers} worker(s): {per * 1000:.0f} ms each")


if __name__ == "__main__":
    main()
