"""Chaos bench (#37): random SIGKILLs of the job services, and the goodput of a training run
whose worker is killed every N steps under --max-restarts.

    python -m bench.bench_chaos --kills 50 --seed 37
    python -m bench.bench_chaos --kills 0 --goodput-iters 60 --kill-every 20

Part 1 kills one of the five services (chosen at random) at a random moment of a job, restarts
it on the same --state-dir and checks from outside, as tests/chaos does: every process the
killed service had started is gone, the job's operation is in a final state (FAILED
UNAVAILABLE, or SUCCEEDED if it had finished), the claims table is empty and the claim's flock
free, no staging folder is left (a conversion's is swept by the restart), and a conversion's
output (an evaluation's results.json) is there exactly when it SUCCEEDED. Inference is killed
during a streamed greedy generation: the stream must end UNAVAILABLE and the restarted service
answer the same tokens. Part 2 trains `--goodput-iters` steps uninterrupted, then again with
the worker SIGKILLed after each `--kill-every`-step checkpoint, and reports the loss curves'
equality and the goodput: useful steps over wall time, against the uninterrupted run (launched
the same way, --max-restarts included).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil

from meshline.common.v1 import operations_pb2, operations_pb2_grpc
from meshline.converter.v1 import converter_pb2_grpc
from meshline.evaluator.v1 import evaluator_pb2_grpc
from meshline.inference.v1 import inference_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2_grpc
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.chaos.procs import Service, alive, db_rows, lock_is_free, start_service
from tests.chaos.test_converter_kills import (
    convert_request,
    make_checkpoint,
    output_whole_or_absent,
    staging_left,
)
from tests.chaos.test_evaluator_kills import evaluation, make_task_data
from tests.chaos.test_inference_kills import generate, greedy
from tests.chaos.test_killed_worker_resume import WorkerKiller, run
from tests.chaos.test_preprocess_kills import make_corpus, request
from tests.chaos.test_trainer_lifetime import training_args
from tests.fixtures.tokenizers import build_sentencepiece
from tests.services.inference.http_served import make_checkpoint as make_inference_checkpoint


@dataclass
class KillReport:
    """What the kills found."""

    kills: dict[str, int] = field(default_factory=dict)
    """Kills per service."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """Final states seen after the restarts."""
    violations: list[str] = field(default_factory=list)
    """Every broken guarantee, with the kill it followed."""


def _check(report: KillReport, ok: bool, what: str) -> None:
    if not ok:
        report.violations.append(what)


def _kill_and_restart(
    service: Service, name: str, state: Path, data: Path
) -> tuple[Service, list, operations_pb2.Operation]:
    """SIGKILL, wait up to 90 s for its processes, restart; (restarted, leftovers, operation)."""
    started = service.kill9()
    deadline = time.monotonic() + 90
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = alive(started)
    restarted = start_service(service.name, data, state)
    with restarted.channel() as channel:
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        get = operations_pb2.GetOperationRequest(name=name)
        operation = ops.GetOperation(get, timeout=30).operation
    return restarted, leftover, operation


class _Folders:
    """`tmp_path_factory.mktemp` for the test fixtures this bench reuses."""

    def __init__(self, base: Path) -> None:
        self.base, self.made = base, 0

    def mktemp(self, name: str) -> Path:
        self.made += 1
        path = self.base / f"{name}{self.made}"
        path.mkdir(parents=True)
        return path


def _kill_inference(
    service: Service, state: Path, load: Path, expected: list[int], after: int, tag: str
) -> tuple[Service, list[str]]:
    """Kills the service once `after` tokens of a greedy stream arrived; restarts it. (restarted,
    problems): the stream must end UNAVAILABLE with a prefix of `expected`, nothing the service
    started may survive, and the restarted service must answer `expected` again."""
    problems: list[str] = []
    streamed: list[int] = []
    started: list[psutil.Process] | None = None
    code = grpc.StatusCode.OK
    with service.channel() as channel:
        stream = inference_pb2_grpc.InferenceServiceStub(channel).GenerateStream(
            greedy(), timeout=120
        )
        try:
            for message in stream:
                streamed.extend(message.token_ids)
                if len(streamed) >= after and started is None:
                    started = service.kill9()
        except grpc.RpcError as exc:
            code = exc.code()
    if started is None:
        problems.append(f"{tag}: the stream ended before the kill")
        started = service.kill9()
    elif code != grpc.StatusCode.UNAVAILABLE:
        problems.append(f"{tag}: the broken stream ended with {code}, not UNAVAILABLE")
    if streamed != expected[: len(streamed)]:
        problems.append(f"{tag}: streamed tokens differ from the greedy answer")
    deadline = time.monotonic() + 90
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(started):
        problems.append(f"{tag}: processes outlived the service: {alive(started)}")
    restarted = start_service("inference", None, state, "--load", str(load))
    if generate(restarted) != expected:
        problems.append(f"{tag}: the restarted service answers differently")
    return restarted, problems


@dataclass
class _JobInputs:
    """What the killed jobs read, made once per round."""

    model: Path
    """The SentencePiece model preprocess tokenizes with."""
    corpus: Path
    """The preprocess corpus folder."""
    source: Path
    """The HF checkpoint the converter converts."""
    tasks: Path
    """The evaluator's task data."""
    load: Path
    """The inference checkpoint (served, and the one the evaluator scores)."""


def _start_job(
    which: str, channel: grpc.Channel, rng: random.Random, inputs: _JobInputs, output: Path
) -> tuple[str, float]:
    """Start one `which` job writing to `output`; (its operation name, seconds until the kill)."""
    if which == "preprocess":
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        req = request(Path(inputs.model), inputs.corpus, output)
        return stub.StartPreprocess(req, timeout=60).operation.name, rng.uniform(0.1, 2.5)
    if which == "evaluator":
        estub = evaluator_pb2_grpc.EvaluatorServiceStub(channel)
        ereq = evaluation(inputs.load, inputs.tasks, output)
        return estub.StartEvaluation(ereq, timeout=60).operation.name, rng.uniform(0.5, 8.0)
    if which == "converter":
        cstub = converter_pb2_grpc.ConverterServiceStub(channel)
        creq = convert_request(inputs.source, output)
        return cstub.Convert(creq, timeout=60).operation.name, rng.uniform(0.1, 2.5)
    tstub = trainer_pb2_grpc.TrainerServiceStub(channel)
    treq = trainer_pb2.StartTrainingRequest(args=training_args(output))
    return tstub.StartTraining(treq, timeout=60).operation.name, rng.uniform(0.5, 15.0)


def _check_killed_job(
    report: KillReport,
    which: str,
    tag: str,
    leftover: list,
    operation: operations_pb2.Operation,
    state: Path,
    output: Path,
) -> None:
    """What a killed and restarted job must leave: no process, a final operation, no claim or
    staging, and an output that agrees with the operation's state."""
    state_name = operations_pb2.OperationState.Name(operation.state)
    report.outcomes[state_name] = report.outcomes.get(state_name, 0) + 1
    _check(report, not leftover, f"{tag}: processes outlived the service: {leftover}")
    _check(report, operation.done, f"{tag}: not final after the restart")
    _check(report, db_rows(state, "SELECT path FROM claims") == [], f"{tag}: a claim survived")
    _check(report, lock_is_free(output), f"{tag}: the claim's flock is held")
    staged = list(output.parent.glob(".*.partial-*")) + staging_left(output)
    _check(report, not staged, f"{tag}: staging left: {staged}")
    succeeded = operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED
    if which == "evaluator":
        visible = (output / "results.json").exists()
        _check(report, succeeded == visible, f"{tag}: results.json and state disagree")
    if which == "converter":
        _check(report, output_whole_or_absent(output), f"{tag}: half-visible output")
        _check(report, succeeded == output.exists(), f"{tag}: output and state disagree")


def _start_services(
    base: Path, data: Path
) -> tuple[dict[str, Service], dict[str, Path], _JobInputs]:
    """The data every job reads (under `data`), and the five services: (services, their state
    folders, the jobs' inputs)."""
    model = build_sentencepiece(data / "sp")
    make_corpus(data / "corpus", files=6, docs=6000)
    source = make_checkpoint(data / "hf")
    jobs = ("converter", "evaluator", "preprocess", "trainer")
    states = {name: base / f"state-{name}" for name in jobs}
    services = {name: start_service(name, data, states[name]) for name in states}
    load, _, _ = make_inference_checkpoint(_Folders(data / "inference"), model, seed=7)
    tasks = make_task_data(data / "tasks")
    states["inference"] = base / "state-inference"
    services["inference"] = start_service(
        "inference", None, states["inference"], "--load", str(load)
    )
    return services, states, _JobInputs(model, data / "corpus", source, tasks, load)


def kill_round(kills: int, seed: int, base: Path) -> KillReport:
    """`kills` random SIGKILLs across converter, evaluator, preprocess and trainer jobs and
    inference streams."""
    rng = random.Random(seed)
    report = KillReport()
    data = base / "data"
    data.mkdir()
    services, states, inputs = _start_services(base, data)
    expected = generate(services["inference"])
    try:
        for i in range(kills):
            which = rng.choice(sorted(services))
            service = services[which]
            report.kills[which] = report.kills.get(which, 0) + 1
            if which == "inference":
                after = rng.randint(1, len(expected) // 2)
                tag = f"kill {i} (inference, after {after} streamed tokens)"
                services[which], problems = _kill_inference(
                    service, states[which], inputs.load, expected, after, tag
                )
                report.violations.extend(problems)
                continue
            output = data / "out" / f"{which}-{i}"
            output.parent.mkdir(exist_ok=True)
            with service.channel() as channel:
                name, delay = _start_job(which, channel, rng, inputs, output)
            time.sleep(delay)
            tag = f"kill {i} ({which}, {name}, after {delay:.1f}s)"
            services[which], leftover, operation = _kill_and_restart(
                service, name, states[which], data
            )
            _check_killed_job(report, which, tag, leftover, operation, states[which], output)
    finally:
        for service in services.values():
            service.stop()
    return report


def _restart_gaps(killer: WorkerKiller, arrivals: list[tuple[float, int]]) -> list[float]:
    """Seconds from each kill to the restarted worker's first step (the step after the
    checkpoint it resumed from; records of the killed worker still in the pipe come earlier)."""
    gaps = []
    for killed_at, checkpoint in zip(killer.kill_times, killer.kills, strict=True):
        first = next((t for t, step in arrivals if t > killed_at and step == checkpoint + 1), None)
        if first is not None:
            gaps.append(round(first - killed_at, 2))
    return gaps


def _lost_seconds(killer: WorkerKiller, arrivals: list[tuple[float, int]]) -> list[float]:
    """Seconds each kill cost the run: from the last new step before the restart to the first
    new step after it (detection, restart, resume and the steps redone), less one ordinary step.

    The restart is the first record of the step after the checkpoint once the kill was sent;
    records the killed worker printed before dying may still arrive after the kill."""
    times = [t for t, _ in arrivals]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(times))
    lost = []
    for killed_at, checkpoint in zip(killer.kill_times, killer.kills, strict=True):
        restarted = next(
            (t for t, step in arrivals if t > killed_at and step == checkpoint + 1), None
        )
        if restarted is None:
            continue
        before = [(t, step) for t, step in arrivals if t < restarted]
        last_t, last_step = max(before, key=lambda ts: ts[1])
        after = [t for t, step in arrivals if t >= restarted and step > last_step]
        if after:
            lost.append(round(after[0] - last_t - step_s, 2))
    return lost


def goodput(iters: int, every: int, base: Path) -> dict[str, object]:
    """Uninterrupted vs killed-every-`every`-steps training of `iters` steps."""
    at = list(range(every, iters, every))
    # The same launch (--max-restarts, hence the warm spare) without the kills: the difference
    # is what the kills cost, not what the spare saves at the first start.
    started = time.monotonic()
    reference = run(base / "reference", iters, None, len(at), save_interval=every)
    clean_s = time.monotonic() - started
    killer = WorkerKiller(base / "chaos", at)
    arrivals: list[tuple[float, int]] = []
    started = time.monotonic()
    interrupted = run(
        base / "chaos", iters, killer, len(at), save_interval=every, arrivals=arrivals
    )
    chaos_s = time.monotonic() - started
    lost = _lost_seconds(killer, arrivals)
    return {
        "iters": iters,
        "kills": len(killer.kills),
        "uninterrupted_s": round(clean_s, 1),
        "killed_s": round(chaos_s, 1),
        "goodput": round(clean_s / chaos_s, 3),
        "loss_curve_identical": interrupted == reference,
        "restart_cost_s": round((chaos_s - clean_s) / max(len(killer.kills), 1), 1),
        "kill_to_first_step_s": _restart_gaps(killer, arrivals),
        "lost_s": lost,
        # Robust to the shared machine's load swings between the two runs: the share of the
        # killed run's wall time not lost to the kills.
        "goodput_from_lost_time": round(1 - sum(lost) / chaos_s, 3),
        "steps_redone": [
            max(step for t, step in arrivals if t <= killed_at) - checkpoint
            for killed_at, checkpoint in zip(killer.kill_times, killer.kills, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Runs both parts and prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="random service kills (0: none)")
    parser.add_argument("--seed", type=int, default=37, help="random seed of the kills")
    parser.add_argument("--goodput-iters", type=int, default=60, help="steps of each run (0: skip)")
    parser.add_argument("--kill-every", type=int, default=20, help="steps between worker kills")
    parser.add_argument(
        "--rounds", type=int, default=1, help="goodput pairs to run (the machine is shared: noise)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="5 kills and one 20-step goodput pair (`python -m bench`)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.kills, args.goodput_iters, args.kill_every, args.rounds = 5, 20, 10, 1
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="meshline-chaos-") as tmp:
        base = Path(tmp)
        if args.kills:
            (base / "kills").mkdir()
            started = time.monotonic()
            report = kill_round(args.kills, args.seed, base / "kills")
            result["kills"] = {**report.__dict__, "wall_s": round(time.monotonic() - started)}
        if args.goodput_iters:
            rounds = []
            for i in range(args.rounds):
                (base / f"goodput-{i}").mkdir()
                rounds.append(goodput(args.goodput_iters, args.kill_every, base / f"goodput-{i}"))
            result["goodput"] = rounds[0] if len(rounds) == 1 else rounds
            if len(rounds) > 1:
                result["goodput_median"] = statistics.median(float(r["goodput"]) for r in rounds)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
