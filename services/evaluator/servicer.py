"""EvaluatorService: validates evaluation requests, starts them, and reads back their results.

StartEvaluation runs `services.evaluator.runner.evaluate` in a worker thread as an "evaluate"
operation (EvaluationMetadata as progress, EvaluationResult once SUCCEEDED); results.json and
the samples go to `output_path` (default: `<output root>/<operation id>`).
"""

from __future__ import annotations

import difflib
import logging
import re
import time
from pathlib import Path
from typing import Any

import grpc

from checkpoints.registry import SERVE_FORMATS
from meshline.common.v1 import checkpoint_pb2, operations_pb2
from meshline.evaluator.v1 import evaluator_pb2, evaluator_pb2_grpc
from services.common.checkpoint_formats import KEYS, format_keys, format_names
from services.common.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Validator,
)
from services.common.field_checks import check_range, check_ranges
from services.common.jobs import JobRunner, operation_id
from services.common.operation_jobs import OperationHandle
from services.common.operations import OperationsStore
from services.common.operations_servicer import operations_binding
from services.common.paths import confine_tree, resolve_under_roots
from services.common.server import ServiceBinding
from services.evaluator.config import EvaluatorServiceConfig
from services.evaluator.models.base import LanguageModel
from services.evaluator.models.kind import checkpoint_is_reward
from services.evaluator.results import TaskOutcome, aggregate_groups, write_results
from services.evaluator.runner import (
    DEFAULT_TEMPERATURE,
    EvalConfig,
    JudgeModels,
    Progress,
    check_judge_kinds,
    evaluate,
    results_settings,
)
from services.evaluator.sandbox.runner import (
    UNSAFE_FLAG,
    SandboxError,
    SandboxUnavailable,
    isolation,
    require_isolation,
)
from services.evaluator.tasks import get_task, groups, list_tasks, resolve

logger = logging.getLogger(__name__)
SERVICE_NAME = evaluator_pb2.DESCRIPTOR.services_by_name["EvaluatorService"].full_name
JOB_KIND = "evaluate"
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEED = 1234
_LOAD_FORMATS = format_keys(SERVE_FORMATS)
"""local.load_format enum value -> registry key: the served formats (checkpoints/registry.py)."""
_TASK_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_HOST_PORT = re.compile(r"(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d{1,5})")
_MAX_FEWSHOT = 64
_MAX_NUM_SAMPLES = 200
"""Largest HumanEval num_samples (Chen et al. (2021) report pass@k from n = 200)."""
State = operations_pb2.OperationState


def check_fields(
    request: evaluator_pb2.StartEvaluationRequest, config: EvaluatorServiceConfig
) -> None:
    """Raises InvalidArgument naming every malformed field."""
    check = Validator()
    tasks = list(request.tasks)
    _check_task_names(check, tasks)
    check.require(bool(request.task_data_path), "task_data_path", "must not be empty")
    check_ranges(
        check,
        request,
        {
            "num_fewshot": (0, _MAX_FEWSHOT),
            "limit": (1, None),
            "batch_size": (1, config.max_batch_size),
            "max_new_tokens": (1, config.max_new_tokens_limit),
        },
    )
    _check_sampling(check, request, tasks)
    which = request.WhichOneof("model")
    if which is None:
        check.require(False, "model", "set endpoint (host:port) or local (load_dir + load_format)")
    else:
        _check_model(check, request, which, "")
    _check_judges(check, request, "rm_win_rate" in tasks)
    check.raise_if_any()


def _check_task_names(check: Validator, tasks: list[str]) -> None:
    """At least one task, each a well-formed name, none twice (known names: `_start_job`)."""
    check.require(bool(tasks), "tasks", "give at least one task name (ListTasks lists them)")
    for i, task in enumerate(tasks):
        check.require(
            _TASK_NAME.fullmatch(task) is not None,
            f"tasks[{i}]",
            f"{task!r} is not a task name (lower case letters, digits, _ . -)",
        )
    check.require(len(set(tasks)) == len(tasks), "tasks", "task names must be distinct")


def _check_sampling(
    check: Validator, request: evaluator_pb2.StartEvaluationRequest, tasks: list[str]
) -> None:
    """num_samples and temperature: HumanEval's sampled completions only."""
    if request.HasField("num_samples"):
        check_range(check, request, "num_samples", 1, _MAX_NUM_SAMPLES)
        check.require(
            request.num_samples <= 1 or "humaneval" in tasks,
            "num_samples",
            'only HumanEval samples several completions; add "humaneval" to tasks or leave '
            "num_samples unset",
        )
    if request.HasField("temperature"):
        check.require(
            0 < request.temperature <= 2,
            "temperature",
            f"must be in (0, 2], got {request.temperature:g}",
        )
        check.require(
            request.num_samples > 1,
            "temperature",
            "only applies to sampled completions (num_samples > 1); leave it unset for greedy "
            "decoding",
        )


def _check_judges(
    check: Validator, request: evaluator_pb2.StartEvaluationRequest, win_rate: bool
) -> None:
    """rm_win_rate's reference and reward model: both required by it, refused without it."""
    for role, why in (
        ("reference", "the causal LM the evaluated model is compared with"),
        ("reward", "the reward model that judges both answers"),
    ):
        chosen = request.WhichOneof(role)
        if chosen is None:
            check.require(
                not win_rate,
                role,
                f"task rm_win_rate needs {why}: set {role}_endpoint or {role}_local",
            )
        elif not win_rate:
            check.require(
                False,
                chosen,
                'only task rm_win_rate uses it; add "rm_win_rate" to tasks or leave it unset',
            )
        else:
            _check_model(check, request, chosen, f"{role}_")


def _check_model(
    check: Validator, request: evaluator_pb2.StartEvaluationRequest, which: str, prefix: str
) -> None:
    """The `{prefix}endpoint` or `{prefix}local` field `which` (one model of the request)."""
    if which == f"{prefix}endpoint":
        endpoint = getattr(request, which)
        match = _HOST_PORT.fullmatch(endpoint)
        check.require(
            match is not None and 1 <= int(match["port"]) <= 65535,
            which,
            f"{endpoint!r} is not host:port of an inference service",
        )
        return
    local = getattr(request, which)
    check.require(bool(local.load_dir), f"{which}.load_dir", "must not be empty")
    load_format = local.load_format
    if load_format == checkpoint_pb2.CHECKPOINT_FORMAT_UNSPECIFIED:
        why = ""
    elif load_format in KEYS:
        why = f" ({load_format} is {KEYS[load_format].upper()}: convert it first)"
    else:
        why = f" ({load_format} is not a CheckpointFormat value)"
    check.require(
        load_format in _LOAD_FORMATS,
        f"{which}.load_format",
        f"set {format_names(SERVE_FORMATS)}{why}",
    )


def check_paths(
    request: evaluator_pb2.StartEvaluationRequest, config: EvaluatorServiceConfig
) -> None:
    """Confines every path to the data roots; inputs must exist."""
    roots = config.data_roots
    data = resolve_under_roots(request.task_data_path, roots, "task_data_path")
    if not data.is_dir():
        raise NotFound(f"task_data_path: {request.task_data_path!r} is not an existing directory")
    for field in ("local", "reference_local", "reward_local"):
        if request.HasField(field):
            _check_local_paths(getattr(request, field), field, roots)
    if request.output_path:
        resolve_under_roots(request.output_path, roots, "output_path")


def _check_local_paths(
    local: evaluator_pb2.LocalModel, field: str, roots: tuple[Path, ...]
) -> None:
    load_dir = resolve_under_roots(local.load_dir, roots, f"{field}.load_dir")
    if not load_dir.is_dir():
        raise NotFound(f"{field}.load_dir: {local.load_dir!r} is not a directory")
    confine_tree(load_dir, roots, f"{field}.load_dir")
    if local.tokenizer_path:
        tokenizer = resolve_under_roots(local.tokenizer_path, roots, f"{field}.tokenizer_path")
        if not tokenizer.exists():
            raise NotFound(f"{field}.tokenizer_path: {local.tokenizer_path!r} does not exist")
        confine_tree(tokenizer, roots, f"{field}.tokenizer_path")


def check_kinds(
    request: evaluator_pb2.StartEvaluationRequest, config: EvaluatorServiceConfig
) -> None:
    """rm_win_rate: a local policy or reference that is a reward model, or a local judge that is
    a causal LM, is refused from its config file before any weight is read (served models say
    their kind when first asked)."""
    if "rm_win_rate" not in request.tasks:
        return

    def kind(field: str) -> bool | None:
        if not request.HasField(field):
            return None
        local = getattr(request, field)
        path = resolve_under_roots(local.load_dir, config.data_roots, f"{field}.load_dir")
        return checkpoint_is_reward(path, _LOAD_FORMATS[local.load_format])

    if kind("local"):
        raise InvalidArgument(
            "local.load_dir",
            f"{request.local.load_dir!r} is a reward model (a scalar value head): rm_win_rate's "
            "evaluated model (the policy) answers prompts, so it must be a causal LM",
        )
    try:
        check_judge_kinds(
            "reference_local.load_dir",
            repr(request.reference_local.load_dir),
            kind("reference_local"),
            "reward_local.load_dir",
            repr(request.reward_local.load_dir),
            kind("reward_local"),
        )
    except ValueError as exc:
        field, _, message = str(exc).partition(" ")
        raise InvalidArgument(field, message) from None


class EvaluatorServicer(evaluator_pb2_grpc.EvaluatorServiceServicer):
    """Starts evaluations as operations in `store` and reads their results back."""

    def __init__(self, config: EvaluatorServiceConfig, store: OperationsStore) -> None:
        self._config = config
        self._store = store
        self._jobs = JobRunner(store, JOB_KIND, job_noun="evaluation")

    async def StartEvaluation(
        self, request: evaluator_pb2.StartEvaluationRequest, context: grpc.aio.ServicerContext
    ) -> evaluator_pb2.StartEvaluationResponse:
        """Validates the request, then starts the evaluation and returns its operation."""
        check_fields(request, self._config)
        check_paths(request, self._config)
        check_kinds(request, self._config)
        return self._start_job(request)

    async def GetEvaluationResult(
        self, request: evaluator_pb2.GetEvaluationResultRequest, context: grpc.aio.ServicerContext
    ) -> evaluator_pb2.GetEvaluationResultResponse:
        """The EvaluationResult of a SUCCEEDED evaluation; FAILED_PRECONDITION otherwise."""
        check = Validator()
        check.require(
            bool(request.name), "name", "give the operation name StartEvaluation returned"
        )
        check.raise_if_any()
        operation = self._store.get(request.name)
        if operation.kind != JOB_KIND:
            raise FailedPrecondition(
                f"name: {request.name!r} is a {operation.kind!r} operation, not an evaluation"
            )
        if not operation.done:
            raise FailedPrecondition(
                f"name: {request.name!r} is still {State.Name(operation.state)}; "
                "WaitOperation or WatchOperation until it finishes"
            )
        if operation.state != State.OPERATION_STATE_SUCCEEDED:
            raise FailedPrecondition(
                f"name: {request.name!r} ended {State.Name(operation.state)} without a result"
                + (f": {operation.error.message}" if operation.error.message else "")
            )
        result = evaluator_pb2.EvaluationResult()
        if not operation.response.Unpack(result):
            raise FailedPrecondition(
                f"name: {request.name!r} holds a {operation.response.TypeName()!r} response, "
                "not an EvaluationResult"
            )
        return evaluator_pb2.GetEvaluationResultResponse(result=result)

    async def ListTasks(
        self, request: evaluator_pb2.ListTasksRequest, context: grpc.aio.ServicerContext
    ) -> evaluator_pb2.ListTasksResponse:
        """Every task this server can run, with its metrics and default few-shot count."""
        return evaluator_pb2.ListTasksResponse(tasks=self._task_infos())

    def _start_job(
        self, request: evaluator_pb2.StartEvaluationRequest
    ) -> evaluator_pb2.StartEvaluationResponse:
        known, known_groups = set(list_tasks()), groups()
        unknown = [t for t in request.tasks if t not in known and t not in known_groups]
        if unknown:
            # The full list (158 names) would overflow gRPC's 8 KiB trailer: name the groups,
            # the stand-alone tasks and the closest matches; ListTasks has every name.
            grouped = {n for members in known_groups.values() for n in members}
            close = sorted({m for t in unknown for m in difflib.get_close_matches(t, known, 3)})
            raise InvalidArgument(
                "tasks",
                f"unknown task(s) {unknown}"
                + (f" (closest: {', '.join(close)})" if close else "")
                + f"; known groups: {', '.join(sorted(known_groups))}; other tasks: "
                f"{', '.join(sorted(known - grouped))}; ListTasks lists all {len(known)} names",
            )
        self._require_sandbox(list(request.tasks))
        explicit = (
            self._config.resolve(request.output_path, "output_path")
            if request.output_path
            else None
        )

        def output_for(operation: str) -> Path:
            return explicit or Path(self._config.output_root or ".") / operation

        def job(handle: OperationHandle) -> evaluator_pb2.EvaluationResult:
            return self._run(request, output_for(operation_id(handle.name)), handle)

        operation = self._jobs.start(
            evaluator_pb2.EvaluationMetadata(request=request),
            job,
            output=explicit if explicit is not None else output_for,
            field="output_path",
        )
        return evaluator_pb2.StartEvaluationResponse(operation=operation)

    def _require_sandbox(self, tasks: list[str]) -> None:
        """FAILED_PRECONDITION before any work when HumanEval could not sandbox its code."""
        if any(task.name == "humaneval" for task in resolve(tasks)):
            try:
                require_isolation(self._config.allow_unsafe_code_execution)
            except SandboxUnavailable as exc:
                raise FailedPrecondition(f"tasks: {exc}") from None

    def _run(
        self, request: evaluator_pb2.StartEvaluationRequest, output: Path, handle: OperationHandle
    ) -> evaluator_pb2.EvaluationResult:
        start = time.time()
        config = self._eval_config(request, output)
        try:
            self._config.resolve(str(output), "output_path")
            outcomes, model_name, judges = self._evaluate(request, config, handle)
        except InterruptedError:
            raise Cancelled(f"{handle.name} was cancelled") from None
        except SandboxUnavailable as exc:
            handle.fail(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return evaluator_pb2.EvaluationResult()
        except SandboxError as exc:
            handle.fail(grpc.StatusCode.INTERNAL, f"the HumanEval sandbox failed: {exc}")
            return evaluator_pb2.EvaluationResult()
        except ValueError as exc:
            handle.fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return evaluator_pb2.EvaluationResult()
        except ConnectionError as exc:
            handle.fail(grpc.StatusCode.UNAVAILABLE, str(exc))
            return evaluator_pb2.EvaluationResult()
        kind = "meshline-grpc" if request.WhichOneof("model") == "endpoint" else "local"
        settings = results_settings(kind, model_name, config, judges)
        # Written through the folder opened beneath its data root: a folder swapped for a
        # symlink meanwhile is refused (PERMISSION_DENIED), never followed.
        path, _ = write_results(output, outcomes, settings, start, self._config.data_roots)
        return evaluator_pb2.EvaluationResult(
            results=_task_results(outcomes),
            results_path=str(path),
            model=model_name,
            elapsed_seconds=time.time() - start,
        )

    def _eval_config(
        self, request: evaluator_pb2.StartEvaluationRequest, output: Path
    ) -> EvalConfig:
        """The run the request asks for, unset fields at their defaults."""

        def given(field: str, default: Any) -> Any:
            return getattr(request, field) if request.HasField(field) else default

        return EvalConfig(
            tasks=tuple(request.tasks),
            task_data_path=self._config.resolve(request.task_data_path, "task_data_path"),
            output_path=output,
            num_fewshot=given("num_fewshot", None),
            limit=given("limit", None),
            batch_size=given("batch_size", DEFAULT_BATCH_SIZE),
            max_new_tokens=given("max_new_tokens", None),
            seed=given("seed", DEFAULT_SEED),
            num_samples=given("num_samples", 1),
            temperature=given("temperature", DEFAULT_TEMPERATURE),
            allow_unsafe_code_execution=self._config.allow_unsafe_code_execution,
        )

    def _evaluate(
        self,
        request: evaluator_pb2.StartEvaluationRequest,
        config: EvalConfig,
        handle: OperationHandle,
    ) -> tuple[list[TaskOutcome], str, JudgeModels | None]:
        """The outcomes, the evaluated model's name and the judges (closed by then)."""
        model = self._open_model(request)
        judges: JudgeModels | None = None
        try:
            judges = self._open_judges(request)
            outcomes = evaluate(
                config,
                model,
                judges=judges,
                progress=_progress_to(handle, request),
                cancelled=handle.cancel_requested.is_set,
                show_bar=False,
            )
        finally:
            model.close()
            if judges is not None:
                judges.close()
        return outcomes, model.name, judges

    def _open_model(
        self, request: evaluator_pb2.StartEvaluationRequest, role: str = ""
    ) -> LanguageModel:
        """The model of the `{role}endpoint` / `{role}local` fields (role "" is the evaluated
        one), its errors naming that field."""
        batch = request.batch_size if request.HasField("batch_size") else DEFAULT_BATCH_SIZE
        field = request.WhichOneof(role.rstrip("_") or "model")
        if field == f"{role}endpoint":
            # imported here: the gRPC client stubs load only for an endpoint model
            from services.evaluator.models.grpc_client import GrpcLanguageModel

            flag = field if role else "--endpoint"  # the evaluated model's errors as before
            return GrpcLanguageModel(getattr(request, field), batch_size=batch, flag=flag)
        from services.evaluator.models.local import LocalLanguageModel

        roots = self._config.data_roots
        local = getattr(request, f"{role}local")
        tokenizer = local.tokenizer_path
        return LocalLanguageModel(
            resolve_under_roots(local.load_dir, roots, f"{role}local.load_dir"),
            load_format=_LOAD_FORMATS[local.load_format],
            tokenizer=resolve_under_roots(tokenizer, roots, f"{role}local.tokenizer_path")
            if tokenizer
            else None,
            batch_size=batch,
            flag=f"{role}local.load_dir" if role else "--load",
        )

    def _open_judges(self, request: evaluator_pb2.StartEvaluationRequest) -> JudgeModels | None:
        """rm_win_rate's reference and reward model, or None where the request sets neither."""
        if request.WhichOneof("reference") is None:
            return None
        reference = self._open_model(request, "reference_")
        try:
            return JudgeModels(reference, self._open_model(request, "reward_"))
        except BaseException:
            reference.close()
            raise

    def _task_infos(self) -> list[evaluator_pb2.TaskInfo]:
        infos = []
        for name, members in sorted(groups().items()):
            tasks = [get_task(member) for member in members]
            first = tasks[0]
            # A group reports the metrics all its subtasks share (AGIEval: acc, not acc_norm).
            shared = [
                m.name
                for m in first.metrics
                if all(m.name in {x.name for x in task.metrics} for task in tasks)
            ]
            kinds = sorted({task.output_type for task in tasks})
            infos.append(
                evaluator_pb2.TaskInfo(
                    name=name,
                    description=f"group of {len(members)} tasks"
                    + (f" ({' and '.join(kinds)})" if len(kinds) > 1 else ""),
                    metrics=shared,
                    output_type=first.output_type,
                    default_num_fewshot=first.default_num_fewshot,
                    subtasks=members,
                )
            )
        for name in list_tasks():
            task = get_task(name)
            infos.append(
                evaluator_pb2.TaskInfo(
                    name=name,
                    description=task.summary,
                    metrics=[m.name for m in task.metrics],
                    output_type=task.output_type,
                    default_num_fewshot=task.default_num_fewshot,
                )
            )
        return infos


def _progress_to(
    handle: OperationHandle, request: evaluator_pb2.StartEvaluationRequest
) -> Progress:
    """The `evaluate` progress callback that reports EvaluationMetadata on the operation."""

    def on_progress(task: str, done: int, total: int, req_done: int, req_total: int) -> None:
        metadata = evaluator_pb2.EvaluationMetadata(
            request=request,
            current_task=task,
            tasks_done=done,
            tasks_total=total,
            requests_done=req_done,
            requests_total=req_total,
        )
        handle.progress(req_done, req_total, unit="requests", message=task, metadata=metadata)

    return on_progress


def _metrics(scores: dict[str, float], stderrs: dict[str, float]) -> list[evaluator_pb2.Metric]:
    metrics = []
    for key, value in scores.items():
        name, filt = key.split(",", 1)
        metric = evaluator_pb2.Metric(name=name, filter=filt, value=value, higher_is_better=True)
        stderr = stderrs.get(key)
        if stderr is not None and stderr == stderr:
            metric.stderr = stderr
        metrics.append(metric)
    return metrics


def _task_results(outcomes: list[TaskOutcome]) -> list[evaluator_pb2.TaskResult]:
    results = [
        evaluator_pb2.TaskResult(
            task=o.task.name,
            group=o.task.group,
            num_fewshot=o.num_fewshot,
            num_samples=o.num_samples,
            metrics=_metrics(o.scores, o.stderrs),
            version=o.task.version,
        )
        for o in outcomes
    ]
    for g in aggregate_groups(outcomes):
        results.append(
            evaluator_pb2.TaskResult(
                task=g.name,
                group=g.name,
                num_samples=g.num_samples,
                metrics=_metrics(g.scores, g.stderrs),
            )
        )
    return results


def bindings(config: EvaluatorServiceConfig, store: OperationsStore) -> list[ServiceBinding]:
    """The evaluator service and the OperationsService over the same store.

    Probes the HumanEval sandbox now, so the log says at startup whether generated code can run.
    """
    state = isolation()
    if not state.available:
        logger.warning(
            "HumanEval sandbox unavailable (%s): humaneval requests are %s",
            state.reason,
            f"run UNSAFELY ({UNSAFE_FLAG})"
            if config.allow_unsafe_code_execution
            else f"refused (start with {UNSAFE_FLAG} to run them without isolation)",
        )
    servicer = EvaluatorServicer(config, store)
    return [
        ServiceBinding(
            SERVICE_NAME, servicer, evaluator_pb2_grpc.add_EvaluatorServiceServicer_to_server
        ),
        operations_binding(store),
    ]
