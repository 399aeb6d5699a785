"""Scores and reports: per-task aggregation, group averages, results.json, samples, the table.

results.json follows lm-evaluation-harness's layout: "results" (one entry per task and group,
metrics keyed "metric,filter" with "metric_stderr,filter" beside them), "groups",
"group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config"
and the dates. Each task's samples go to `samples_{task}.jsonl`. Files are written to a
temporary name and renamed, so a partial report never looks complete.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.safe_fs import open_dir
from services.evaluator.scoring.metrics import mean, mean_stderr, pooled_stderr, weighted_mean
from services.evaluator.tasks import GROUP_VERSIONS
from services.evaluator.tasks.base import Task


@dataclass
class TaskOutcome:
    """One task's scores and samples."""

    task: Task
    num_fewshot: int
    scores: dict[str, float]
    """"metric,filter" -> mean over samples."""
    stderrs: dict[str, float]
    """"metric,filter" -> standard error of that mean."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_samples(self) -> int:
        """Samples scored."""
        return len(self.samples)


@dataclass
class GroupOutcome:
    """A group's size-weighted averages over its subtasks."""

    name: str
    subtasks: list[str]
    scores: dict[str, float]
    stderrs: dict[str, float]
    num_samples: int


def aggregate_task(
    task: Task,
    docs: list[dict],
    num_fewshot: int,
    requests: list[list[tuple[str, Any]]],
    responses: list[list[Any]],
    seconds: float,
) -> TaskOutcome:
    """Per-sample metrics (task.process) and their means for one task."""
    if hasattr(task, "process_many"):
        per_sample = task.process_many(docs, responses)
    else:
        per_sample = [task.process(d, r) for d, r in zip(docs, responses, strict=True)]
    samples = []
    for index, (doc, reqs, resps, metrics) in enumerate(
        zip(docs, requests, responses, per_sample, strict=True)
    ):
        samples.append(
            {
                "doc_id": index,
                "doc": doc,
                "target": task.doc_to_target(doc),
                "arguments": [args for _, args in reqs],
                "resps": resps,
                "metrics": metrics,
            }
        )
    keys = task.metric_keys()
    scores = {k: mean([m[k] for m in per_sample]) for k in keys}
    stderrs = {k: mean_stderr([m[k] for m in per_sample]) for k in keys}
    return TaskOutcome(task, num_fewshot, scores, stderrs, samples, seconds)


def aggregate_groups(outcomes: list[TaskOutcome]) -> list[GroupOutcome]:
    """Averages for every group (and subgroup) with at least one evaluated subtask."""
    members: dict[str, list[TaskOutcome]] = {}
    for outcome in outcomes:
        for name in (outcome.task.subgroup, outcome.task.group):
            if name:
                members.setdefault(name, []).append(outcome)
    groups = []
    for name, items in members.items():
        sizes = [o.num_samples for o in items]
        keys = [k for k in items[0].scores if all(k in o.scores for o in items)]
        groups.append(
            GroupOutcome(
                name,
                [o.task.name for o in items],
                {k: weighted_mean([o.scores[k] for o in items], sizes) for k in keys},
                {k: pooled_stderr([o.stderrs[k] for o in items], sizes) for k in keys},
                sum(sizes),
            )
        )
    return groups


def _metric_entry(scores: dict[str, float], stderrs: dict[str, float]) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    for key, value in scores.items():
        metric, filt = key.split(",", 1)
        entry[key] = value
        stderr = stderrs.get(key, math.nan)
        entry[f"{metric}_stderr,{filt}"] = "N/A" if math.isnan(stderr) else stderr
    return entry


def build_results(
    outcomes: list[TaskOutcome],
    config: dict[str, Any],
    start_time: float,
    end_time: float,
) -> dict[str, Any]:
    """The results.json document."""
    groups = aggregate_groups(outcomes)
    results: dict[str, Any] = {}
    for o in outcomes:
        results[o.task.name] = {"alias": o.task.name, **_metric_entry(o.scores, o.stderrs)}
    group_entries = {
        g.name: {"alias": g.name, **_metric_entry(g.scores, g.stderrs)} for g in groups
    }
    results.update(group_entries)
    return {
        "results": results,
        "groups": group_entries,
        "group_subtasks": {g.name: g.subtasks for g in groups},
        "configs": {
            o.task.name: {
                "task": o.task.name,
                "tag": o.task.group or None,
                "output_type": o.task.output_type,
                "num_fewshot": o.num_fewshot,
                "target_delimiter": o.task.target_delimiter,
                "fewshot_delimiter": o.task.fewshot_delimiter,
                "metric_list": [
                    {"metric": m.name, "filter": m.filter, "higher_is_better": m.higher_is_better}
                    for m in o.task.metrics
                ],
                "generation_kwargs": (
                    {"until": list(spec.until), "max_gen_toks": spec.max_gen_toks}
                    if (spec := o.task.generation()) is not None
                    else None
                ),
                "metadata": {"version": o.task.version},
            }
            for o in outcomes
        },
        "versions": {
            **{o.task.name: o.task.version for o in outcomes},
            **{g.name: GROUP_VERSIONS.get(g.name, "1.0") for g in groups},
        },
        "n-shot": {o.task.name: o.num_fewshot for o in outcomes},
        "higher_is_better": {
            o.task.name: {m.name: m.higher_is_better for m in o.task.metrics} for o in outcomes
        },
        "n-samples": {
            o.task.name: {"original": o.num_samples, "effective": o.num_samples} for o in outcomes
        },
        "config": config,
        "date": start_time,
        "start_time": start_time,
        "end_time": end_time,
        "total_evaluation_time_seconds": str(end_time - start_time),
    }


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temporary name beside `path`, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_results(
    output_path: Path,
    outcomes: list[TaskOutcome],
    config: dict[str, Any],
    start_time: float,
    roots: Sequence[Path] = (),
) -> tuple[Path, dict[str, Any]]:
    """Write samples_{task}.jsonl files, then results.json; returns its path and content.

    Every file is written atomically through `output_path` opened beneath its data root
    (`roots`; none: the path as it resolves now), so a folder swapped for a symlink during the
    evaluation redirects nothing (PermissionDenied naming `output_path` if swapped before).
    """
    with open_dir(output_path, roots, "output_path", create=True) as directory:
        for o in outcomes:
            lines = (json.dumps(s, ensure_ascii=False, default=str) for s in o.samples)
            directory.write_text(f"samples_{o.task.name}.jsonl", "\n".join(lines) + "\n")
        document = build_results(outcomes, config, start_time, time.time())
        text = json.dumps(document, ensure_ascii=False, indent=2, default=str)
        directory.write_text("results.json", text)
    return output_path / "results.json", document


def format_table(document: dict[str, Any]) -> str:
    """lm-eval's markdown table: Tasks | Version | Filter | n-shot | Metric | Value | Stderr."""
    rows = [
        "|Tasks|Version|Filter|n-shot|Metric| |Value| |Stderr|",
        "|---|---|---|---|---|---|---:|---|---:|",
    ]
    versions, nshot = document["versions"], document["n-shot"]
    group_names = set(document["groups"])
    for name, entry in document["results"].items():
        for key, value in entry.items():
            if key == "alias" or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            stderr = entry.get(f"{metric}_stderr,{filt}", "N/A")
            err = "N/A" if isinstance(stderr, str) else f"{stderr:.4f}"
            shots = "" if name in group_names else str(nshot.get(name, ""))
            rows.append(
                f"|{name}|{versions.get(name, '')}|{filt}|{shots}|{metric}|↑|{value:.4f}|±|{err}|"
            )
    return "\n".join(rows)
