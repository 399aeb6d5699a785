"""What every benchmark task is: data loading, lm-eval-identical prompts, per-sample scoring.

A task turns each evaluation record ("doc") into requests for the model (log-likelihoods of the
choices, or one generation) and turns the model's answers back into per-sample metric values.
Prompts follow lm-evaluation-harness's `ConfigurableTask.fewshot_context`: the task description,
then `num_fewshot` worked examples (question + target delimiter + answer + few-shot delimiter),
then the question; multiple-choice continuations are target delimiter + choice.
"""

from __future__ import annotations

import json
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.paths import confine_to, open_resolved

Doc = dict[str, Any]
MULTIPLE_CHOICE = "multiple_choice"
GENERATE_UNTIL = "generate_until"


@dataclass(frozen=True)
class GenerationSpec:
    """How a generation task asks the model to answer."""

    until: tuple[str, ...]
    """Stop strings: the answer is cut before the first one."""
    max_gen_toks: int = 256
    """Tokens generated at most (lm-eval's default when the task sets none)."""


@dataclass(frozen=True)
class MetricSpec:
    """One metric a task reports: its name and the answer filter it is computed after."""

    name: str
    """Metric name as lm-eval spells it ("acc", "acc_norm", "exact_match", "pass@1")."""
    filter: str = "none"
    """Filter pipeline name ("none", "strict-match", "flexible-extract", ...)."""
    higher_is_better: bool = True
    """Whether a larger value is better (all of ours are)."""


@dataclass
class Task(ABC):
    """A benchmark (sub)task: name, data files, prompt template, and scoring."""

    name: str
    """Registry key, as lm-eval names the task (e.g. "mmlu_anatomy")."""
    summary: str = ""
    """One line for ListTasks."""
    group: str = ""
    """Group it belongs to ("mmlu"); empty for a top-level task."""
    subgroup: str = ""
    """Category inside the group ("mmlu_stem"); empty when the group has none."""
    description: str = ""
    """Text put before the few-shot examples (lm-eval's `description`)."""
    default_num_fewshot: int = 0
    """Few-shot examples when the request sets none."""
    version: str = "1.0"
    """Task version, as lm-eval's `versions` reports it."""
    target_delimiter: str = " "
    """Between a question and its answer."""
    fewshot_delimiter: str = "\n\n"
    """After each few-shot example."""
    metrics: tuple[MetricSpec, ...] = field(default_factory=lambda: (MetricSpec("acc"),))
    """What the task reports."""

    sampler: str = "first_n"
    """Few-shot selection: "first_n" (the pool's head) or "random" (lm-eval's seeded sampler)."""
    exclude_eval_doc: bool = False
    """Random sampler: draw k+1 and drop the evaluated doc (lm-eval does so whenever the task's
    few-shot split equals its test split, which includes tasks that set neither, like BoolQ)."""

    output_type: str = MULTIPLE_CHOICE

    def __post_init__(self) -> None:
        self._rnd = random.Random(1234)

    def reset_sampler(self, seed: int) -> None:
        """Restart the random few-shot sampler (lm-eval seeds it with fewshot_random_seed)."""
        self._rnd = random.Random(seed)

    # -- data -----------------------------------------------------------------------------------

    @abstractmethod
    def load(self, data_path: Path) -> tuple[list[Doc], list[Doc]]:
        """(evaluation docs, few-shot pool) read from the benchmark's published files."""

    # -- prompt ---------------------------------------------------------------------------------

    @abstractmethod
    def doc_to_text(self, doc: Doc) -> str:
        """The question part of the prompt."""

    @abstractmethod
    def doc_to_target(self, doc: Doc) -> Any:
        """Gold answer: a choice index (multiple choice) or a string (generation)."""

    def doc_to_choice(self, doc: Doc) -> list[str] | None:
        """Answer choices of a multiple-choice doc (None for generation tasks)."""
        return None

    def target_text(self, doc: Doc) -> str:
        """The answer as written after a few-shot example's question."""
        target = self.doc_to_target(doc)
        choices = self.doc_to_choice(doc)
        if choices is not None and isinstance(target, int):
            return choices[target]
        if isinstance(target, list):
            return str(target[0])
        return str(target)

    def fewshot_examples(self, doc: Doc, pool: list[Doc], num_fewshot: int) -> list[Doc]:
        """The few-shot docs for `doc`: the first `num_fewshot` of the pool (lm-eval first_n)."""
        if num_fewshot > len(pool):
            raise ValueError(
                f"--num-fewshot {num_fewshot}: task {self.name} has only {len(pool)} few-shot "
                "examples in its few-shot split; ask for fewer"
            )
        if self.sampler == "first_n":
            return pool[:num_fewshot]
        if num_fewshot == 0:
            return []
        if not self.exclude_eval_doc:
            return self._rnd.sample(pool, num_fewshot)
        picks: list[Doc] = []
        if num_fewshot < len(pool):
            picks = [x for x in self._rnd.sample(pool, num_fewshot + 1) if x != doc][:num_fewshot]
        if len(picks) < num_fewshot:
            picks = self._rnd.sample([x for x in pool if x != doc], num_fewshot)
        return picks

    def context(self, doc: Doc, pool: list[Doc], num_fewshot: int) -> str:
        """The full prompt for `doc` with `num_fewshot` worked examples."""
        parts = [self.description] if self.description else []
        for example in self.fewshot_examples(doc, pool, num_fewshot):
            parts.append(
                self.doc_to_text(example)
                + self.target_delimiter
                + self.target_text(example)
                + self.fewshot_delimiter
            )
        parts.append(self.doc_to_text(doc))
        return "".join(parts)

    # -- scoring --------------------------------------------------------------------------------

    def generation(self) -> GenerationSpec | None:
        """Stop strings and length of a generation task (None: multiple choice)."""
        return None

    @abstractmethod
    def process(self, doc: Doc, answers: Any) -> dict[str, float]:
        """Per-sample metric values keyed "metric,filter" from the model's answers.

        Multiple choice: `answers` is a list of (log-likelihood, is_greedy) per choice.
        Generation: a list of generated strings (one per repeat).
        """

    def metric_keys(self) -> list[str]:
        """The "metric,filter" keys `process` returns."""
        return [f"{m.name},{m.filter}" for m in self.metrics]


class MissingData(ValueError):
    """The data directory holds no files for a task."""


def task_file(path: Path, data_path: Path) -> Path:
    """`path` resolved, if it stays inside the task folder (PermissionDenied otherwise).

    The folder a request names is confined to the service's roots, but a file in it may be a
    symlink to anywhere (another user's data, the service's own files): every task file found
    under `data_path` goes through this before it is read.
    """
    folder = data_path if data_path.is_dir() else data_path.parent
    return confine_to(path, Path(os.path.realpath(folder)), "task_data_path")


def open_task_file(path: Path, binary: bool = False) -> Any:
    """Opens a `task_file` result, refusing a symlink swapped in since it was resolved."""
    fd = open_resolved(path, "task_data_path")
    return open(fd, "rb") if binary else open(fd, encoding="utf-8", newline="")


def read_jsonl(path: Path) -> list[Doc]:
    """Records of a (optionally gzipped) JSON-lines `task_file`; ValueError names the bad line."""
    import gzip
    import io

    with open_task_file(path, binary=True) as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
        return _parse_jsonl(io.TextIOWrapper(stream, encoding="utf-8"), path)


def _parse_jsonl(lines: Any, path: Path) -> list[Doc]:
    docs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            docs.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return docs


def text_records(
    path: Path,
    fields: tuple[str, ...],
    *,
    max_chars: int,
    need: str,
    non_empty: tuple[str, ...] = (),
) -> Iterator[tuple[str, dict[str, str]]]:
    """(`path:N`, the record's `fields`) for each record of a JSON-lines file of plain-text fields.

    Records are untrusted: each must be an object whose `fields` are strings (non-empty for those
    in `non_empty`) of at most `max_chars` characters; ValueError names the record, the field and
    what the records need (`need`, e.g. "a plain-text prompt").
    """
    for number, record in enumerate(read_jsonl(path), 1):
        where = f"{path}:{number}"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a record must be a JSON object")
        for key in fields:
            text = record.get(key)
            required = key in non_empty
            if not isinstance(text, str) or (required and not text):
                kind = "a non-empty string" if required else "a string"
                raise ValueError(f"{where}: {key!r} must be {kind} (records need {need})")
            if len(text) > max_chars:
                raise ValueError(
                    f"{where}: {key!r} has {len(text)} characters; at most {max_chars} are accepted"
                )
        yield where, {key: record[key] for key in fields}


def find_file(data_path: Path, candidates: list[str], task: str, family: str) -> Path:
    """The first of `candidates` under `data_path` or its `family/` folder (or the file given)."""
    if data_path.is_file():
        return task_file(data_path, data_path)
    for root in (data_path, data_path / family):
        for name in candidates:
            found = sorted(root.glob(name))
            if found:
                return task_file(found[0], data_path)
    raise MissingData(
        f"--task-data-path {data_path}: no data for task {task}; expected one of "
        f"{', '.join(candidates)} under it or under {family}/"
    )


def require_fields(doc: Doc, names: tuple[str, ...], where: str) -> None:
    """ValueError naming the missing fields of a record."""
    missing = [n for n in names if n not in doc]
    if missing:
        raise ValueError(f"{where}: record lacks field(s) {missing}; expected {list(names)}")
