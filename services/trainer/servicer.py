"""TrainerService: validates training requests, then launches, stops and watches jobs.

A request carries the same flags `meshline train` takes. The servicer checks the launch fields
and the environment (an allow-list, `worker_env`), parses the flags with the trainer's own
parser, resolves every path under the data roots (`request_paths`), checks the inputs exist and
are readable (`launch_checks`), then runs the job with the *resolved* flags (`services.trainer.job.run_job`: torchrun, or Kubernetes
workloads in a cluster) in a worker thread. Each metrics record becomes a StreamMetricsResponse
and the operation's progress; StopTraining sends the workers SIGTERM, on which they save to --save
and exit (SIGUSR2 with save_checkpoint=false: they exit without saving).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from meshline.common.v1 import operations_pb2
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unimplemented,
    Validator,
)
from services.common.jobs import JobRunner
from services.common.operation_jobs import OperationHandle
from services.common.operations import OperationsStore
from services.common.operations_servicer import operations_binding
from services.common.paths import ROOTS_ENV, resolve_under_roots, roots_env_value
from services.common.server import ServiceBinding
from services.trainer.arguments import parse_args
from services.trainer.config import TrainerServiceConfig
from services.trainer.job import TrainingRun, run_job
from services.trainer.k8s_launcher import use_kubernetes
from services.trainer.request_paths import argv_from_config, confine_config
from services.trainer.train_config import TrainConfig
from services.trainer.worker_env import env_violations
from training.launch_checks import check_inputs, check_model_layout

logger = logging.getLogger(__name__)
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
JOB_KIND = "train"
_RUN_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
# Launch settings that have their own request fields.
LAUNCH_FLAGS = {
    "--nproc-per-node": "nproc_per_node",
    "--nnodes": "nnodes",
    "--max-restarts": "max_restarts",
}


def check_request(request: trainer_pb2.StartTrainingRequest, config: TrainerServiceConfig) -> None:
    """Raises InvalidArgument naming every malformed launch field (the flags are parsed later)."""
    check = Validator()
    args = list(request.args)
    check.require(bool(args), "args", "give the training flags, e.g. ['--train-iters', '100', ...]")
    for i, token in enumerate(args):
        check.require(bool(token), f"args[{i}]", "must not be empty")
        flag = token.partition("=")[0]
        if flag in LAUNCH_FLAGS:
            check.require(False, f"args[{i}]", f"set {flag} with the field {LAUNCH_FLAGS[flag]}")
        check.require(flag not in ("-h", "--help"), f"args[{i}]", "--help is not a training flag")
    if request.HasField("nproc_per_node"):
        check.require(
            1 <= request.nproc_per_node <= config.max_nproc_per_node,
            "nproc_per_node",
            f"must be in [1, {config.max_nproc_per_node}], got {request.nproc_per_node}",
        )
    if request.HasField("nnodes"):
        check.require(request.nnodes >= 1, "nnodes", f"must be >= 1, got {request.nnodes}")
    if request.HasField("max_restarts"):
        check.require(
            0 <= request.max_restarts <= config.max_restarts_limit,
            "max_restarts",
            f"must be in [0, {config.max_restarts_limit}], got {request.max_restarts}",
        )
    for field, reason in env_violations(request.env):
        check.require(False, field, reason)
    if request.run_name:
        check.require(
            _RUN_NAME.fullmatch(request.run_name) is not None,
            "run_name",
            f"{request.run_name!r} must match {_RUN_NAME.pattern} (lower case, at most 63 chars)",
        )
    check.raise_if_any()


def _require_name(name: str) -> None:
    check = Validator()
    check.require(bool(name), "name", "give the operation name StartTraining returned")
    check.raise_if_any()


def parse_training_flags(args: list[str], world_size: int, roots: tuple[Path, ...]) -> TrainConfig:
    """The trainer's own parse of `args` (INVALID_ARGUMENT with its message), paths resolved.

    The returned config holds every path resolved under `roots` (a `--config` file can set them
    too, so the parsed config is what is confined); its inputs have been checked to exist
    (NOT_FOUND) and to be readable datasets (INVALID_ARGUMENT).
    """
    # The parser reads --config files, so those are confined before it runs, and it reads the
    # resolved path, not the requester's string.
    args = list(args)
    for i, token in enumerate(args):
        flag, has_value, inline = token.partition("=")
        if flag == "--config":
            path = inline if has_value else (args[i + 1] if i + 1 < len(args) else "")
            if path:
                resolved = str(resolve_under_roots(path, roots, f"args[{i}] (--config)"))
                if has_value:
                    args[i] = f"--config={resolved}"
                else:
                    args[i + 1] = resolved
    errors = io.StringIO()
    try:
        # argparse reports a bad flag on stderr and exits; keep its one-line reason.
        with contextlib.redirect_stderr(errors):
            config = parse_args(args).validate(world_size)
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        raise InvalidArgument("args", lines[-1] if lines else "not valid training flags") from None
    except ValueError as exc:
        raise InvalidArgument("args", str(exc)) from exc
    if config.autotune.autotune:
        raise InvalidArgument(
            "args",
            "--autotune runs trial jobs before the run, which `meshline train --autotune` "
            "does; send the flags it picks (its autotune.json) instead",
        )
    config = confine_config(config, roots)
    try:
        check_inputs(config)
        check_model_layout(config, world_size)
    except FileNotFoundError as exc:
        raise NotFound(f"args: {exc}") from None
    except ValueError as exc:
        raise InvalidArgument("args", str(exc)) from exc
    return config


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Starts, stops and watches training jobs held as operations in `store`."""

    def __init__(self, config: TrainerServiceConfig, store: OperationsStore) -> None:
        self._config = config
        self._store = store
        self._runs: dict[str, TrainingRun] = {}
        self._jobs = JobRunner(store, JOB_KIND, job_noun="training job")

    def _training_operation(self, name: str) -> operations_pb2.Operation:
        _require_name(name)
        operation = self._store.get(name)
        if operation.kind != JOB_KIND:
            raise FailedPrecondition(
                f"name: {name!r} is a {operation.kind!r} operation, not a training job"
            )
        return operation

    async def StartTraining(
        self, request: trainer_pb2.StartTrainingRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.StartTrainingResponse:
        """Validates the request, then launches the job and returns its operation."""
        check_request(request, self._config)
        nproc = request.nproc_per_node if request.HasField("nproc_per_node") else 1
        nnodes = request.nnodes if request.HasField("nnodes") else 1
        if nnodes > 1 and not use_kubernetes(self._config.launcher):
            raise Unimplemented(
                f"nnodes={nnodes}: multi-node jobs run as Kubernetes workloads; start the trainer "
                "service in a cluster (or with --launcher kubernetes)"
            )
        # Parsing walks folders and opens every shard: off the event loop.
        config = await asyncio.to_thread(
            parse_training_flags, list(request.args), nproc * nnodes, self._config.data_roots
        )
        return self._start_job(request, config, nproc, nnodes)

    async def StopTraining(
        self, request: trainer_pb2.StopTrainingRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.StopTrainingResponse:
        """Asks a running job to checkpoint (unless save_checkpoint=false) and exit."""
        operation = self._training_operation(request.name)
        if operation.done:
            raise FailedPrecondition(f"name: {request.name!r} has already finished")
        save = request.save_checkpoint if request.HasField("save_checkpoint") else True
        return self._stop_job(operation, save)

    async def StreamMetrics(
        self, request: trainer_pb2.StreamMetricsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.StreamMetricsResponse]:
        """Streams the job's logged steps from start_step on, ending when the job ends."""
        check = Validator()
        check.require(
            not request.HasField("start_step") or request.start_step >= 0,
            "start_step",
            "must be >= 0",
        )
        check.raise_if_any()
        operation = self._training_operation(request.name)
        run = self._runs.get(operation.name)
        if run is None:
            raise FailedPrecondition(
                f"name: {request.name!r} ran in an earlier server process; its metrics are in "
                "metrics.csv under its --log-dir"
            )
        sent = 0
        async for state in self._store.watch(operation.name):
            records = run.snapshot()
            for record in records[sent:]:
                if record.step >= request.start_step:
                    yield record
            sent = len(records)
            if state.done:
                break

    def _start_job(
        self,
        request: trainer_pb2.StartTrainingRequest,
        config: TrainConfig,
        nproc: int,
        nnodes: int,
    ) -> trainer_pb2.StartTrainingResponse:
        metadata = trainer_pb2.TrainingMetadata(
            request=request,
            total_steps=config.run.train_iters,
            checkpoint_dir=config.run.save or "",
            world_size=nproc * nnodes,
        )
        env = {**request.env, ROOTS_ENV: roots_env_value(self._config.data_roots)}
        run = TrainingRun(config, argv=argv_from_config(config), env=env)

        def job(handle: OperationHandle) -> trainer_pb2.TrainingResult | None:
            return run_job(
                self._config.launcher,
                request,
                run,
                handle,
                metadata,
                nproc,
                nnodes,
                on_started=self._store.record_process,
                lock_fds=tuple(self._jobs.claims.lock_fds(handle.name)),
            )

        def register(name: str) -> None:
            self._runs[name] = run

        # --save is the run's output: two running jobs saving into one directory would
        # interleave their checkpoints and `latest` pointers. (--log-dir and the rest are
        # per-run logs; sharing them loses nothing written.)
        save = Path(config.run.save) if config.run.save else None
        operation = self._jobs.start(
            metadata,
            job,
            output=save,
            field="args (--save)",
            path_noun="--save directory",
            on_created=register,
        )
        return trainer_pb2.StartTrainingResponse(operation=operation)

    def _stop_job(
        self, operation: operations_pb2.Operation, save_checkpoint: bool
    ) -> trainer_pb2.StopTrainingResponse:
        run = self._runs.get(operation.name)
        if run is None:
            raise FailedPrecondition(f"name: {operation.name!r} is not running in this server")
        if save_checkpoint and not run.config.run.save:
            raise FailedPrecondition(
                f"name: {operation.name!r} has no --save directory to checkpoint into; "
                "call again with save_checkpoint=false to stop without saving"
            )
        if not save_checkpoint and use_kubernetes(self._config.launcher):
            raise Unimplemented(
                "save_checkpoint=false: Kubernetes stops pods with SIGTERM, on which workers save "
                "to --save; stop with save_checkpoint=true, or cancel the operation"
            )
        run.request_stop(save_checkpoint)
        return trainer_pb2.StopTrainingResponse(operation=self._store.get(operation.name))


def bindings(config: TrainerServiceConfig, store: OperationsStore) -> list[ServiceBinding]:
    """The trainer service and the OperationsService over the same store."""
    servicer = TrainerServicer(config, store)
    return [
        ServiceBinding(
            SERVICE_NAME, servicer, trainer_pb2_grpc.add_TrainerServiceServicer_to_server
        ),
        operations_binding(store),
    ]
