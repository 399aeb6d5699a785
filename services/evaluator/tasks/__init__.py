"""The eval task registry: task and group names (the CLI's and ListTasks' choices) -> tasks.

Names follow lm-evaluation-harness: "boolq", "mmlu_anatomy", "gsm8k_cot", "humaneval",
"agieval_lsat_ar", "bbh_fewshot_navigate", "ceval-valid_law". A group name ("mmlu",
"mmlu_stem", "agieval", "bbh", "ceval-valid") selects all its subtasks.
"""

from __future__ import annotations

import functools

from services.evaluator.tasks import (
    agieval,
    bbh,
    boolq,
    ceval,
    gsm8k,
    humaneval,
    mmlu,
    reward_pairs,
    reward_win_rate,
)
from services.evaluator.tasks.base import Task

_MODULES = (boolq, mmlu, gsm8k, humaneval, agieval, bbh, ceval, reward_pairs, reward_win_rate)
GROUP_VERSIONS = {"mmlu": "2", "agieval": "0.0", "bbh": "3.0", "ceval-valid": "2.0"}


@functools.cache
def _registry() -> dict[str, Task]:
    return {task.name: task for module in _MODULES for task in module.tasks()}


def list_tasks() -> list[str]:
    """Every task name."""
    return list(_registry())


def groups() -> dict[str, list[str]]:
    """Group and subgroup names -> their task names."""
    found: dict[str, list[str]] = {}
    for task in _registry().values():
        for name in (task.group, task.subgroup):
            if name:
                found.setdefault(name, []).append(task.name)
    return found


def get_task(name: str) -> Task:
    """A fresh copy of the task `name` (ValueError listing the known names)."""
    import copy

    task = _registry().get(name)
    if task is None:
        raise ValueError(
            f"unknown task {name!r}; known tasks: {', '.join(sorted(_registry()))}; groups: "
            f"{', '.join(sorted(groups()))}"
        )
    fresh = copy.deepcopy(task)
    fresh.__post_init__()
    return fresh


def resolve(names: list[str]) -> list[Task]:
    """Tasks for task or group names, each once, in the order given (ValueError on unknowns)."""
    return [task for task, _ in resolve_with_origin(names)]


def resolve_with_origin(names: list[str]) -> list[tuple[Task, bool]]:
    """(task, named explicitly) for task or group names; a task named both ways is explicit."""
    known_groups = groups()
    unknown = [n for n in names if n not in _registry() and n not in known_groups]
    if unknown:
        raise ValueError(
            f"unknown task name(s) {unknown}; known tasks: {', '.join(sorted(_registry()))}; "
            f"groups: {', '.join(sorted(known_groups))}"
        )
    selected: dict[str, bool] = {}
    for name in names:
        for task_name in known_groups.get(name, [name]):
            selected[task_name] = selected.get(task_name, False) or task_name == name
    return [(get_task(n), explicit) for n, explicit in selected.items()]
