"""HumanEval (Chen et al., 2021): complete a Python function; pass@k by running its unit tests.

Data: the published `HumanEval.jsonl(.gz)` (fields `task_id`, `prompt`, `canonical_solution`,
`test`, `entry_point`). As lm-eval's `humaneval`: the prompt is the function header and
docstring, generation stops at a new top-level statement ("\\nclass", "\\ndef", "\\n#", "\\nif",
"\\nprint"). Where lm-eval runs prompt + completion + "\\n" + test + "\\ncheck(entry_point)" in
one process, the completion here runs alone in one OS-level sandbox and the test in another,
the calls of the entry point crossing between them as plain values; the test's process decides
the verdict (`services.evaluator.sandbox.runner.run_check`, docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.evaluator.sandbox.runner import Check, SandboxLimits, run_checks
from services.evaluator.scoring.metrics import pass_at_k
from services.evaluator.tasks.base import (
    GENERATE_UNTIL,
    Doc,
    GenerationSpec,
    MetricSpec,
    Task,
    find_file,
    read_jsonl,
    require_fields,
)

FIELDS = ("task_id", "prompt", "test", "entry_point")


@dataclass
class HumanEval(Task):
    """HumanEval test problems, pass@k over `repeats` completions each."""

    name: str = "humaneval"
    summary: str = "HumanEval Python function completion, pass@1 in a sandbox"
    ks: tuple[int, ...] = (1,)
    """The k of each reported pass@k (each <= repeats)."""
    repeats: int = 1
    """Completions generated per problem (n of the pass@k estimator)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """What each test program may use."""
    workers: int = 2
    """Programs run at the same time."""
    allow_unsafe: bool = False
    """Run completions even where the host cannot isolate them (rlimits and a uid only); the
    operator's `--allow-unsafe-code-execution`."""
    output_type: str = GENERATE_UNTIL

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(k > self.repeats for k in self.ks):
            raise ValueError(f"humaneval: every k in pass@{list(self.ks)} must be <= repeats")
        self.metrics = tuple(MetricSpec(f"pass@{k}", "create_test") for k in self.ks)

    def set_samples(self, num_samples: int) -> None:
        """n completions per problem; reports pass@1, pass@10, pass@100 that fit, and pass@n."""
        self.repeats = num_samples
        self.ks = tuple(sorted({k for k in (1, 10, 100) if k <= num_samples} | {num_samples}))
        self.__post_init__()

    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """The problems (no few-shot pool: HumanEval is zero-shot)."""
        path = find_file(
            data_path,
            ["HumanEval.jsonl", "HumanEval.jsonl.gz", "*HumanEval*.jsonl*"],
            self.name,
            "humaneval",
        )
        docs = read_jsonl(path)
        for number, doc in enumerate(docs, 1):
            require_fields(doc, FIELDS, f"{path}:{number}")
        return docs, []

    def doc_to_text(self, doc: Doc) -> str:
        """The function header and docstring."""
        return str(doc["prompt"])

    def doc_to_target(self, doc: Doc) -> str:
        """The test code run after the completion."""
        return f"{doc['test']}\ncheck({doc['entry_point']})"

    def generation(self) -> GenerationSpec:
        """Stop at the next top-level statement; up to 1024 tokens."""
        return GenerationSpec(("\nclass", "\ndef", "\n#", "\nif", "\nprint"), 1024)

    def program(self, doc: Doc, completion: str) -> str:
        """The single file lm-eval would run for one completion (prompt, completion, test)."""
        return doc["prompt"] + completion + "\n" + self.doc_to_target(doc)

    def check(self, doc: Doc, completion: str) -> Check:
        """What one completion is judged by: its code apart from the test that judges it."""
        return Check(
            prompt=str(doc["prompt"]),
            completion=str(completion),
            test=str(doc["test"]),
            entry_point=str(doc["entry_point"]),
        )

    def process(self, doc: Doc, answers: Any) -> dict[str, float]:
        """pass@k of one problem from its completions, each run in the sandbox."""
        return self.process_many([doc], [answers])[0]

    def process_many(self, docs: list[Doc], answers: list[Any]) -> list[dict[str, float]]:
        """pass@k of many problems, their programs run `workers` at a time."""
        checks = [self.check(d, c) for d, cs in zip(docs, answers, strict=True) for c in cs]
        runs = iter(run_checks(checks, self.limits, self.workers, allow_unsafe=self.allow_unsafe))
        results = []
        for completions in answers:
            passed = sum(next(runs).passed for _ in completions)
            results.append(
                {f"pass@{k},create_test": pass_at_k(len(completions), passed, k) for k in self.ks}
            )
        return results


def tasks() -> list[HumanEval]:
    """The registry entries of this file."""
    return [HumanEval()]
