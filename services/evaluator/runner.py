"""Run tasks against a model: prompts -> batched requests (cached) -> per-sample metrics.

`evaluate(config, model)` is the library entry point used by the CLI, the gRPC servicer and the
demo. Multiple-choice tasks send one log-likelihood request per choice, generation tasks one
greedy generation per repeat, reward tasks (rm_pairs) one reward request per response of a pair;
the win-rate task (rm_win_rate) one greedy generation per prompt from the policy and one from the
reference, then one reward request per answer (`JudgeModels`). Requests go out `batch_size` at a
time, every answered batch is cached, and progress is reported after each batch.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.evaluator.cache import ResponseCache, request_key
from services.evaluator.models.base import GenerationRequest, LanguageModel
from services.evaluator.results import TaskOutcome, aggregate_task
from services.evaluator.sandbox.runner import require_isolation
from services.evaluator.tasks import resolve_with_origin
from services.evaluator.tasks.base import MULTIPLE_CHOICE, MissingData, Task
from services.evaluator.tasks.humaneval import HumanEval
from services.evaluator.tasks.reward_pairs import REWARD_PAIRS, RewardPairs
from services.evaluator.tasks.reward_win_rate import (
    DEFAULT_MAX_NEW_TOKENS,
    REWARD_WIN_RATE,
    RewardWinRate,
)

logger = logging.getLogger(__name__)
DEFAULT_TEMPERATURE = 0.8
"""Sampling temperature of HumanEval's sampled completions (Chen et al. (2021) use 0.8 for
pass@10 and pass@100)."""
Progress = Callable[[str, int, int, int, int], None]
"""(current task, tasks done, tasks total, requests done, requests total)."""


@dataclass
class EvalConfig:
    """One evaluation run."""

    tasks: tuple[str, ...]
    """Task or group names (registry keys)."""
    task_data_path: Path
    """File or directory with the benchmarks' published files."""
    output_path: Path
    """Where results.json, samples_*.jsonl and the request cache go."""
    num_fewshot: int | None = None
    """Few-shot examples; None = each task's default."""
    limit: int | None = None
    """Samples per task at most; None = all."""
    batch_size: int = 8
    """Requests sent to the model together."""
    max_new_tokens: int | None = None
    """Cap on generated tokens; None = each task's default."""
    seed: int = 1234
    """Seed of the random few-shot sampler (lm-eval's fewshot_random_seed)."""
    num_samples: int = 1
    """Completions per HumanEval problem (n of pass@k); above 1 they are sampled."""
    temperature: float = DEFAULT_TEMPERATURE
    """Sampling temperature when num_samples > 1."""
    allow_unsafe_code_execution: bool = False
    """Run HumanEval completions even where the host cannot sandbox them (lm-eval's
    `confirm_run_unsafe_code`); only the operator sets it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings echoed into results.json's "config"."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("--tasks: give at least one task name")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {self.num_samples}")
        if not 0 < self.temperature <= 2:
            raise ValueError(f"--temperature must be in (0, 2], got {self.temperature}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not Path(self.task_data_path).exists():
            raise ValueError(f"--task-data-path {self.task_data_path} does not exist")


@dataclass
class JudgeModels:
    """The two extra models of the win-rate task (rm_win_rate): the policy (the evaluated model)
    is compared with `reference`, both answers judged by `reward`."""

    reference: LanguageModel
    """The causal LM the policy is compared with (`--reference-load` / `--reference-endpoint`)."""
    reward: LanguageModel
    """The reward model that scores both answers (`--reward-load` / `--reward-endpoint`)."""

    def close(self) -> None:
        """Release both models."""
        self.reference.close()
        self.reward.close()


def results_settings(
    model_kind: str, model_args: str, config: EvalConfig, judges: JudgeModels | None
) -> dict[str, Any]:
    """The run's settings as results.json's "config" records them (lm-eval's names)."""
    settings: dict[str, Any] = {
        "model": model_kind,
        "model_args": model_args,
        "batch_size": config.batch_size,
        "limit": config.limit,
        "random_seed": config.seed,
        "fewshot_seed": config.seed,
        "num_samples": config.num_samples,
        "temperature": config.temperature if config.num_samples > 1 else None,
    }
    if judges is not None:
        settings["reference_args"] = judges.reference.name
        settings["reward_args"] = judges.reward.name
    return settings


@dataclass
class PreparedTask:
    """A task's loaded docs and, per doc, its requests as (cache key, arguments)."""

    task: Task
    docs: list[dict]
    num_fewshot: int
    requests: list[list[tuple[str, Any]]]  # per doc: (cache key, arguments)


def prepare_task(task: Task, config: EvalConfig) -> PreparedTask:
    """Load the task's data and build every prompt and request (lm-eval's `arguments`)."""
    data_path = Path(config.task_data_path)
    docs, pool = task.load(data_path)
    if config.limit is not None:
        docs = docs[: config.limit]
    if not docs:
        raise ValueError(f"--task-data-path {data_path}: task {task.name} has no samples")
    shots = task.default_num_fewshot if config.num_fewshot is None else config.num_fewshot
    if isinstance(task, RewardPairs):
        if shots:
            raise ValueError(
                f"--num-fewshot {shots}: task {task.name} scores pairs with a reward model, "
                "which takes no few-shot examples; give 0 or leave it out"
            )
        pairs = [task.requests(doc) for doc in docs]
        keyed = [[(request_key("reward", a), a) for a in doc] for doc in pairs]
        return PreparedTask(task, docs, 0, keyed)
    if isinstance(task, RewardWinRate):
        if shots:
            raise ValueError(
                f"--num-fewshot {shots}: task {task.name} compares answers to bare prompts, "
                "which take no few-shot examples; give 0 or leave it out"
            )
        max_new = config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        settings = {"until": [], "max_gen_toks": max_new}
        both = []
        for doc in docs:
            ask = [task.doc_to_text(doc), settings]
            both.append(
                [
                    (request_key("policy_generate", ask), ask),
                    (request_key("reference_generate", ask), ask),
                ]
            )
        return PreparedTask(task, docs, 0, both)
    task.reset_sampler(config.seed)
    repeats = 1
    if isinstance(task, HumanEval):
        task.allow_unsafe = config.allow_unsafe_code_execution
        task.set_samples(config.num_samples)
        repeats = config.num_samples
    requests: list[list[tuple[str, Any]]] = []
    for doc in docs:
        context = task.context(doc, pool, shots)
        choices = task.doc_to_choice(doc)
        if task.output_type == MULTIPLE_CHOICE:
            assert choices is not None
            args: list[Any] = [[context, task.target_delimiter + c] for c in choices]
            requests.append([(request_key("loglikelihood", a), a) for a in args])
        else:
            spec = task.generation()
            assert spec is not None
            max_new = config.max_new_tokens or spec.max_gen_toks
            kwargs: dict[str, Any] = {"until": list(spec.until), "max_gen_toks": max_new}
            if repeats > 1:
                kwargs.update(do_sample=True, temperature=config.temperature)
            per_doc = []
            for i in range(repeats):
                arg: Any = [context, {**kwargs, "seed": config.seed + i} if repeats > 1 else kwargs]
                per_doc.append((request_key("generate_until", arg), arg))
            requests.append(per_doc)
    return PreparedTask(task, docs, shots, requests)


def _answer(
    prepared: PreparedTask,
    model: LanguageModel,
    cache: ResponseCache,
    batch_size: int,
    on_batch: Callable[[int], None],
    cancelled: Callable[[], bool],
) -> None:
    pending = {key: args for doc in prepared.requests for key, args in doc if key not in cache}
    items = list(pending.items())
    step = batch_size * (4 if prepared.task.output_type == MULTIPLE_CHOICE else 1)
    for start in range(0, len(items), step):
        if cancelled():
            raise InterruptedError("evaluation cancelled")
        batch = items[start : start + step]
        if prepared.task.output_type == MULTIPLE_CHOICE:
            scores = model.loglikelihood([(a[0], a[1]) for _, a in batch])
            responses: list[Any] = [[float(lp), bool(g)] for lp, g in scores]
        elif prepared.task.output_type == REWARD_PAIRS:
            responses = [float(r) for r in model.reward([(a[0], a[1]) for _, a in batch])]
        else:
            responses = _generate(model, batch)
        cache.add([(key, resp) for (key, _), resp in zip(batch, responses, strict=True)])
        on_batch(len(batch))


def _generate(model: LanguageModel, batch: list[tuple[str, Any]]) -> list[str]:
    return model.generate_until(
        [
            GenerationRequest(
                a[0],
                tuple(a[1]["until"]),
                a[1]["max_gen_toks"],
                a[1].get("temperature"),
                a[1].get("seed", 0),
            )
            for _, a in batch
        ]
    )


def _answer_win_rate(
    prepared: PreparedTask,
    policy: LanguageModel,
    judges: JudgeModels,
    cache: ResponseCache,
    batch_size: int,
    on_batch: Callable[[int], None],
    cancelled: Callable[[], bool],
) -> list[list[Any]]:
    """Both models' answers, then the reward of each (prompt, answer); per doc [policy answer,
    reference answer, r(policy), r(reference)]."""
    for side, model in ((0, policy), (1, judges.reference)):
        pending = list({doc[side][0]: doc[side][1] for doc in prepared.requests}.items())
        pending = [(key, args) for key, args in pending if key not in cache]
        for start in range(0, len(pending), batch_size):
            if cancelled():
                raise InterruptedError("evaluation cancelled")
            batch = pending[start : start + batch_size]
            cache.add(list(zip((k for k, _ in batch), _generate(model, batch), strict=True)))
            on_batch(len(batch))
    answered = [
        [(doc[0][1][0], cache.get(doc[0][0])), (doc[1][1][0], cache.get(doc[1][0]))]
        for doc in prepared.requests
    ]
    keyed = [[(request_key("reward", list(pair)), pair) for pair in doc] for doc in answered]
    unique = {key: pair for doc in keyed for key, pair in doc}
    pending_rewards = [(key, pair) for key, pair in unique.items() if key not in cache]
    on_batch(2 * len(keyed) - len(pending_rewards))  # judged already (or the same pair twice)
    for start in range(0, len(pending_rewards), batch_size):
        if cancelled():
            raise InterruptedError("evaluation cancelled")
        batch = pending_rewards[start : start + batch_size]
        rewards = [float(r) for r in judges.reward.reward([p for _, p in batch])]
        cache.add(list(zip((k for k, _ in batch), rewards, strict=True)))
        on_batch(len(batch))
    return [
        [doc[0][1], doc[1][1], cache.get(keys[0][0]), cache.get(keys[1][0])]
        for doc, keys in zip(answered, keyed, strict=True)
    ]


def _prepare_all(config: EvalConfig) -> list[PreparedTask]:
    """Every selected task's requests; a group's subtasks without data are left out (warned)."""
    prepared = []
    skipped: dict[str, list[str]] = {}
    for task, explicit in resolve_with_origin(list(config.tasks)):
        try:
            prepared.append(prepare_task(task, config))
        except MissingData:
            # A group runs over the subtasks whose files are present (e.g. a subset of MMLU);
            # a task named on its own must have its data.
            if explicit:
                raise
            skipped.setdefault(task.group or task.name, []).append(task.name)
    for group, names in skipped.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        logger.warning(
            "%s: %d subtask(s) without data under %s are left out of the group (%s)",
            group, len(names), config.task_data_path, shown,
        )  # fmt: skip
    return prepared


def _task_cache(
    root: Path, name: str, fingerprint: str, judges: JudgeModels | None
) -> ResponseCache:
    """The response cache of task `name`; a judged task's is keyed by all three models."""
    if judges is None:
        return ResponseCache(root, fingerprint, name)
    # The answers depend on all three models: a different one misses the cache.
    key = f"{fingerprint}|{judges.reference.fingerprint}|{judges.reward.fingerprint}"
    return ResponseCache(root, key, name)


def _responses(
    item: PreparedTask,
    model: LanguageModel,
    judges: JudgeModels | None,
    cache: ResponseCache,
    config: EvalConfig,
    on_batch: Callable[[int], None],
    cancelled: Callable[[], bool],
) -> list[list[Any]]:
    """Every request of `item` answered (from `cache` where it can), per doc; `judges` given
    for the win-rate task."""
    if judges is not None:
        return _answer_win_rate(item, model, judges, cache, config.batch_size, on_batch, cancelled)
    _answer(item, model, cache, config.batch_size, on_batch, cancelled)
    return [[cache.get(key) for key, _ in r] for r in item.requests]


def evaluate(
    config: EvalConfig,
    model: LanguageModel,
    *,
    judges: JudgeModels | None = None,
    progress: Progress | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    show_bar: bool | None = None,
) -> list[TaskOutcome]:
    """Evaluate every selected task; returns per-task outcomes (scores and samples). `judges`
    are the reference and reward model of the win-rate task, required by it and refused
    without it."""
    prepared = _prepare_all(config)
    if any(isinstance(item.task, HumanEval) for item in prepared):
        # Refuse before any completion is generated where the code could not be contained.
        require_isolation(config.allow_unsafe_code_execution)
    _check_model_kind(prepared, model)
    _check_judges(prepared, judges)
    if not prepared:
        raise ValueError(
            f"--task-data-path {config.task_data_path}: no data for any task of "
            f"{', '.join(config.tasks)}"
        )
    # A win-rate doc's two generations are followed by two rewards.
    total = sum(
        len(r) * (2 if p.task.output_type == REWARD_WIN_RATE else 1)
        for p in prepared
        for r in p.requests
    )
    cache_root = Path(config.output_path) / "cache"
    fingerprint = model.fingerprint
    bar = _progress_bar(total, show_bar)
    done = 0
    outcomes = []
    for index, item in enumerate(prepared):
        name = item.task.name
        judged = item.task.output_type == REWARD_WIN_RATE and judges is not None
        cache = _task_cache(cache_root, name, fingerprint, judges if judged else None)
        done += sum(1 for r in item.requests for key, _ in r if key in cache)
        bar(done)

        def on_batch(count: int, name: str = name, index: int = index) -> None:
            nonlocal done
            done += count
            bar(done)
            if progress is not None:
                progress(name, index, len(prepared), done, total)

        if progress is not None:
            progress(name, index, len(prepared), done, total)
        start = time.perf_counter()
        try:
            responses = _responses(item, model, judges if judged else None, cache, config,
                                   on_batch, cancelled)  # fmt: skip
        finally:
            cache.close()
        outcomes.append(
            aggregate_task(
                item.task, item.docs, item.num_fewshot, item.requests, responses,
                time.perf_counter() - start,
            )
        )  # fmt: skip
    if progress is not None:
        progress("", len(prepared), len(prepared), done, total)
    bar(None)
    return outcomes


def _check_model_kind(prepared: list[PreparedTask], model: LanguageModel) -> None:
    """Refuse, before any request, tasks the model cannot answer where its kind is known (a
    served model's kind shows in the server's answer to the first request)."""
    reward = [p.task.name for p in prepared if p.task.output_type == REWARD_PAIRS]
    other = [p.task.name for p in prepared if p.task.output_type != REWARD_PAIRS]
    kind = model.is_reward_model
    if kind is True and other:
        raise ValueError(
            f"{model.flag} {model.name} is a reward model (a scalar value head): it answers "
            f"reward tasks only, not {other[:3]}; evaluate those with a causal LM"
        )
    if kind is False and reward:
        raise ValueError(
            f"{model.flag} {model.name} is a causal LM, not a reward model (no scalar value "
            f"head): {reward} need a `meshline train --stage rm` checkpoint"
        )


def _check_judges(prepared: list[PreparedTask], judges: JudgeModels | None) -> None:
    """The win-rate task needs a reference and a reward model, other tasks take neither; a
    reward model as the reference or a causal LM as the judge is refused where its kind is
    known."""
    names = [p.task.name for p in prepared if p.task.output_type == REWARD_WIN_RATE]
    if names and judges is None:
        raise ValueError(
            f"{names} compare the model with a reference under a reward model: give "
            "--reference-load DIR (or --reference-endpoint HOST:PORT) and --reward-load DIR "
            "(or --reward-endpoint HOST:PORT)"
        )
    if judges is None:
        return
    if not names:
        raise ValueError(
            f"{judges.reference.flag} and {judges.reward.flag} are used by rm_win_rate only, "
            "which is not among --tasks; leave them out or add rm_win_rate"
        )
    check_judge_kinds(
        judges.reference.flag,
        judges.reference.name,
        judges.reference.is_reward_model,
        judges.reward.flag,
        judges.reward.name,
        judges.reward.is_reward_model,
    )


def check_judge_kinds(
    reference_flag: str,
    reference: str,
    reference_is_reward: bool | None,
    reward_flag: str,
    reward: str,
    reward_is_reward: bool | None,
) -> None:
    """ValueError naming the flag of a reference that is a reward model or of a judge that is a
    causal LM (None: not known before asking a server)."""
    if reference_is_reward is True:
        raise ValueError(
            f"{reference_flag} {reference} is a reward model (a scalar value head): the "
            "reference answers prompts, so it must be a causal LM (the policy's starting point)"
        )
    if reward_is_reward is False:
        raise ValueError(
            f"{reward_flag} {reward} is a causal LM, not a reward model (no scalar value head): "
            "it must be a `meshline train --stage rm` checkpoint"
        )


def _progress_bar(total: int, show: bool | None) -> Callable[[int | None], None]:
    """A tqdm bar on a terminal (quiet otherwise); call with None to close."""
    if show is None:
        show = sys.stderr.isatty()
    if not show:
        return lambda n: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr)

    def update(n: int | None) -> None:
        if n is None:
            bar.close()
        else:
            bar.n = n
            bar.refresh()

    return update
