"""Bounded fuzz of every service: mutated and random request bodies, never UNKNOWN or INTERNAL.

Each test starts the real service in-process on localhost port 0 and sends a fixed number of
bodies (deterministic seed) to every unary-request RPC it hosts, its OperationsService included:
field-mutated copies of plausible requests (extreme and NaN/inf numbers, long / NUL / unicode /
path-like strings, unknown enum values, huge repeated fields), byte-level mutations of their wire
form and random bytes (sent raw, so undecodable bodies reach the server). Then the server must
still answer the health check SERVING and serve one good request.

Jobs stay cheap: request paths point into an empty data root (refused with NOT_FOUND) except for
one tiny real corpus / checkpoint per service; a request that does start an operation is
cancelled at once; the trainer's launcher is replaced by one that fails the job without starting
torchrun (its validation, flag parsing and path checks all run for real).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshline.common.v1 import checkpoint_pb2, operations_pb2, operations_pb2_grpc
from meshline.converter.v1 import converter_pb2
from meshline.evaluator.v1 import evaluator_pb2
from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from meshline.preprocess.v1 import preprocess_pb2, preprocess_pb2_grpc
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.config import ServerConfig
from services.common.errors import Unavailable
from services.common.operations import OperationsStore
from services.common.server import ServiceBinding, create_server
from tests.security.fuzzing import Fuzzer, call_raw

BODIES_PER_RPC = 50
MIN_SERVICE_BODIES = 160
"""A service with few RPCs gets more bodies per RPC, so each service sees at least this many."""
OPERATION_BODIES_PER_RPC = 12
CALL_TIMEOUT_S = 20.0
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
OPS = "/meshline.common.v1.OperationsService/"


def _operation_seeds() -> dict[str, tuple[list[Message], bool]]:
    name = "op-0000"
    return {
        "GetOperation": ([operations_pb2.GetOperationRequest(name=name)], False),
        "ListOperations": ([operations_pb2.ListOperationsRequest(page_size=5)], False),
        "CancelOperation": ([operations_pb2.CancelOperationRequest(name=name)], False),
        "WaitOperation": (
            [operations_pb2.WaitOperationRequest(name=name, timeout_seconds=0.1)],
            False,
        ),
        "WatchOperation": ([operations_pb2.WatchOperationRequest(name=name)], True),
    }


async def _cancel_everything(channel: grpc.aio.Channel) -> None:
    """Cancel every operation still running (a mutated request may have been a valid one)."""
    ops = operations_pb2_grpc.OperationsServiceStub(channel)
    try:
        listed = await ops.ListOperations(operations_pb2.ListOperationsRequest(page_size=1000))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNIMPLEMENTED  # inference hosts no operations
        return
    for operation in listed.operations:
        if not operation.done:
            await ops.CancelOperation(operations_pb2.CancelOperationRequest(name=operation.name))


async def _fuzz(
    channel: grpc.aio.Channel,
    service: str,
    seeds: dict[str, tuple[list[Message], bool]],
    per_rpc: int,
    fuzzer: Fuzzer,
    statuses: Counter,
    failures: list[str],
) -> None:
    for method, (messages, streaming) in seeds.items():
        path = f"/{service}/{method}" if not service.startswith("/") else f"{service}{method}"
        for body in fuzzer.bodies(messages, per_rpc):
            code, details = await call_raw(channel, path, body, streaming, CALL_TIMEOUT_S)
            statuses[code.name] += 1
            if code in FORBIDDEN:
                failures.append(f"{method} -> {code.name}: {details[:300]} (body {body[:80]!r})")
            if code == grpc.StatusCode.OK:
                await _cancel_everything(channel)


async def _run_fuzz(
    bindings: list[ServiceBinding],
    service: str,
    seeds: dict[str, tuple[list[Message], bool]],
    good_request,
    seed: int,
    operations: bool = True,
) -> Counter:
    """Fuzz one server; returns the status counts (asserts no UNKNOWN/INTERNAL and health)."""
    server, port, _ = await create_server(bindings, ServerConfig(host="127.0.0.1", port=0))
    statuses: Counter = Counter()
    failures: list[str] = []
    fuzzer = Fuzzer(seed)
    started = time.monotonic()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * 2**20)]
        ) as channel:
            per_rpc = max(BODIES_PER_RPC, MIN_SERVICE_BODIES // len(seeds))
            await _fuzz(channel, service, seeds, per_rpc, fuzzer, statuses, failures)
            if operations:
                await _fuzz(
                    channel,
                    OPS,
                    _operation_seeds(),
                    OPERATION_BODIES_PER_RPC,
                    fuzzer,
                    statuses,
                    failures,
                )
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await good_request(channel)
            await _cancel_everything(channel)
    finally:
        await server.stop(None)
    elapsed = time.monotonic() - started
    print(f"{service}: {sum(statuses.values())} calls in {elapsed:.1f}s: {dict(statuses)}")
    assert not failures, "\n".join(failures[:20])
    return statuses


# -- preprocess ---------------------------------------------------------------------------------


def test_fuzz_preprocess(tmp_path: Path, sentencepiece_model: Path) -> None:
    from services.preprocess.config import PreprocessServiceConfig
    from services.preprocess.servicer import SERVICE_NAME, bindings

    model = tmp_path / "tok.model"
    model.write_bytes(Path(sentencepiece_model).read_bytes())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5)))
    real = preprocess_pb2.StartPreprocessRequest(
        input=[str(corpus)],
        output_prefix=str(tmp_path / "c"),
        tokenizer_type=preprocess_pb2.TOKENIZER_TYPE_SENTENCEPIECE,
        tokenizer_model=str(model),
        json_keys=["text"],
        append_eod=True,
        workers=1,
    )
    missing = preprocess_pb2.StartPreprocessRequest()
    missing.CopyFrom(real)
    missing.input[:] = [str(tmp_path / "absent.jsonl")]
    seeds = {"StartPreprocess": ([missing, real], False)}
    config = PreprocessServiceConfig(data_roots=(tmp_path,), max_workers=1)

    async def good(channel: grpc.aio.Channel) -> None:
        request = preprocess_pb2.StartPreprocessRequest()
        request.CopyFrom(real)
        request.output_prefix = str(tmp_path / "good")
        stub = preprocess_pb2_grpc.PreprocessServiceStub(channel)
        started = (await stub.StartPreprocess(request, timeout=30)).operation
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        wait = operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=120)
        done = (await ops.WaitOperation(wait, timeout=150)).operation
        assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message

    asyncio.run(
        _run_fuzz(bindings(config, OperationsStore(None)), SERVICE_NAME, seeds, good, seed=1)
    )


# -- trainer ------------------------------------------------------------------------------------


def test_fuzz_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.trainer import servicer as trainer_servicer
    from services.trainer.config import TrainerServiceConfig

    launched: list[trainer_pb2.StartTrainingRequest] = []

    def no_launch(launcher, request, run, handle, metadata, nproc, nnodes, *, on_started, lock_fds):
        launched.append(request)
        raise Unavailable("fuzz test: jobs are not launched")

    monkeypatch.setattr(trainer_servicer, "run_job", no_launch)
    args = [
        *("--model", "tiny-llama", "--mock-data", "--train-iters", "3", "--log-interval", "1"),
        *("--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "32"),
    ]
    valid = trainer_pb2.StartTrainingRequest(args=args, nproc_per_node=1, run_name="fuzz")
    with_paths = trainer_pb2.StartTrainingRequest(
        args=[*args, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "absent")],
        env={"OMP_NUM_THREADS": "1"},
    )
    seeds = {
        "StartTraining": ([valid, with_paths], False),
        "StopTraining": (
            [trainer_pb2.StopTrainingRequest(name="op-1", save_checkpoint=True)],
            False,
        ),
        "StreamMetrics": ([trainer_pb2.StreamMetricsRequest(name="op-1", start_step=0)], True),
    }
    config = TrainerServiceConfig(data_roots=(tmp_path,), launcher="local")

    async def good(channel: grpc.aio.Channel) -> None:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        before = len(launched)
        started = (await stub.StartTraining(valid, timeout=30)).operation
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        wait = operations_pb2.WaitOperationRequest(name=started.name, timeout_seconds=30)
        done = (await ops.WaitOperation(wait, timeout=60)).operation
        assert done.error.code == grpc.StatusCode.UNAVAILABLE.value[0], done.error.message
        assert len(launched) == before + 1

    asyncio.run(
        _run_fuzz(
            trainer_servicer.bindings(config, OperationsStore(None)),
            trainer_servicer.SERVICE_NAME,
            seeds,
            good,
            seed=2,
        )
    )


# -- converter ----------------------------------------------------------------------------------


def test_fuzz_converter(tmp_path: Path) -> None:
    from services.converter.config import ConverterServiceConfig
    from services.converter.servicer import SERVICE_NAME, bindings
    from tests.services.inference.helpers import hf_reference, save_hf_checkpoint

    request = converter_pb2.ConvertRequest(
        load_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
        save_format=checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE,
        load_dir=str(tmp_path / "absent"),
        save_dir=str(tmp_path / "out"),
    )
    hf, _, _ = hf_reference("llama-gqa", seed=2, vocab_size=512)
    real = converter_pb2.ConvertRequest()
    real.CopyFrom(request)
    real.load_dir = str(save_hf_checkpoint(hf, tmp_path / "hf"))
    seeds = {"Convert": ([request, real], False)}
    config = ConverterServiceConfig(data_roots=(tmp_path,))

    async def good(channel: grpc.aio.Channel) -> None:
        good_request = converter_pb2.ConvertRequest()
        good_request.CopyFrom(real)
        good_request.save_dir = str(tmp_path / "good")
        started = await channel.unary_unary(
            f"/{SERVICE_NAME}/Convert",
            request_serializer=converter_pb2.ConvertRequest.SerializeToString,
            response_deserializer=converter_pb2.ConvertResponse.FromString,
        )(good_request, timeout=30)
        ops = operations_pb2_grpc.OperationsServiceStub(channel)
        wait = operations_pb2.WaitOperationRequest(name=started.operation.name, timeout_seconds=120)
        done = (await ops.WaitOperation(wait, timeout=150)).operation
        assert done.state == operations_pb2.OPERATION_STATE_SUCCEEDED, done.error.message

    asyncio.run(
        _run_fuzz(bindings(config, OperationsStore(None)), SERVICE_NAME, seeds, good, seed=3)
    )


# -- evaluator ----------------------------------------------------------------------------------


def test_fuzz_evaluator(tmp_path: Path) -> None:
    from services.evaluator.config import EvaluatorServiceConfig
    from services.evaluator.servicer import SERVICE_NAME, bindings

    endpoint = evaluator_pb2.StartEvaluationRequest(
        tasks=["mmlu"],
        task_data_path=str(tmp_path / "absent"),
        endpoint="127.0.0.1:1",
        limit=1,
        batch_size=1,
        max_new_tokens=4,
        output_path=str(tmp_path / "out"),
        seed=1,
    )
    local = evaluator_pb2.StartEvaluationRequest()
    local.CopyFrom(endpoint)
    local.local.load_dir = str(tmp_path / "model")
    seeds = {
        "StartEvaluation": ([endpoint, local], False),
        "GetEvaluationResult": ([evaluator_pb2.GetEvaluationResultRequest(name="op-1")], False),
        "ListTasks": ([evaluator_pb2.ListTasksRequest()], False),
    }
    config = EvaluatorServiceConfig(data_roots=(tmp_path,))

    async def good(channel: grpc.aio.Channel) -> None:
        reply = await channel.unary_unary(
            f"/{SERVICE_NAME}/ListTasks",
            request_serializer=evaluator_pb2.ListTasksRequest.SerializeToString,
            response_deserializer=evaluator_pb2.ListTasksResponse.FromString,
        )(evaluator_pb2.ListTasksRequest(), timeout=30)
        assert "mmlu" in {t.name for t in reply.tasks}

    asyncio.run(
        _run_fuzz(bindings(config, OperationsStore(None)), SERVICE_NAME, seeds, good, seed=4)
    )


# -- inference ----------------------------------------------------------------------------------


def test_fuzz_inference(tmp_path: Path, sentencepiece_model: Path) -> None:
    from services.inference.config import InferenceServiceConfig
    from services.inference.servicer import SERVICE_NAME, bindings, load_engine
    from tests.services.inference.helpers import hf_reference, save_hf_checkpoint

    hf, _, _ = hf_reference("llama-gqa", seed=2, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path / "ckpt", sentencepiece_model)
    config = InferenceServiceConfig(load=directory, max_batch_rows=8, max_new_tokens_limit=16)
    engine = load_engine(config)
    assert engine is not None
    params = inference_pb2.SamplingParams(
        max_new_tokens=4, do_sample=True, top_k=5, top_p=0.9, temperature=0.7, seed=3
    )
    by_ids = inference_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], params=params)
    by_text = inference_pb2.GenerateRequest(
        prompt="The model", params=inference_pb2.SamplingParams(max_new_tokens=3, stop=["a"])
    )
    beams = inference_pb2.GenerateRequest(
        prompt_token_ids=[9, 10],
        params=inference_pb2.SamplingParams(max_new_tokens=3, num_beams=2, num_return_sequences=2),
    )
    score = inference_pb2.ScoreRequest(
        items=[
            inference_pb2.ScoreItem(context_token_ids=[5, 6], continuation_token_ids=[7]),
            inference_pb2.ScoreItem(context="The", continuation=" model"),
        ]
    )
    seeds = {
        "Generate": ([by_ids, by_text, beams], False),
        "GenerateStream": ([by_ids, beams], True),
        "Score": ([score], False),
        "Tokenize": (
            [inference_pb2.TokenizeRequest(text="The model", add_special_tokens=True)],
            False,
        ),
        "Detokenize": ([inference_pb2.DetokenizeRequest(token_ids=[5, 6, 7])], False),
        "GetModelInfo": ([inference_pb2.GetModelInfoRequest()], False),
    }

    async def good(channel: grpc.aio.Channel) -> None:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        greedy = inference_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7], params=inference_pb2.SamplingParams(max_new_tokens=6)
        )
        reply = await stub.Generate(greedy, timeout=60)
        expected = await engine.front.run(lambda: engine.engine.generate([[5, 6, 7]], [_greedy(6)]))
        assert list(reply.sequences[0].token_ids) == expected[0][0].token_ids

    async def main() -> Counter:
        try:
            return await _run_fuzz(
                bindings(config, engine), SERVICE_NAME, seeds, good, seed=5, operations=False
            )
        finally:
            await engine.front.close()

    statuses = asyncio.run(main())
    assert statuses["OK"] > 0  # some mutated requests were valid and served


def _greedy(max_new_tokens: int):
    from engine.sampling import SamplingConfig

    return SamplingConfig(max_new_tokens=max_new_tokens)


def test_fuzz_reward_model(tmp_path: Path, sentencepiece_model: Path) -> None:
    """A served reward model under mutated Reward (and refused Generate/Score) requests: never
    UNKNOWN/INTERNAL, and a valid Reward still equals the scorer's own result afterwards."""
    from services.inference.config import InferenceServiceConfig
    from services.inference.servicer import SERVICE_NAME, bindings, load_engine
    from tests.services.inference.test_reward_served import make_reward_checkpoint

    directory = make_reward_checkpoint(tmp_path / "rm", sentencepiece_model)
    config = InferenceServiceConfig(load=directory, max_score_items=8, max_score_tokens=256)
    served = load_engine(config)
    assert served is not None
    reward = inference_pb2.RewardRequest(
        inputs=[
            inference_pb2.RewardInput(text="The model"),
            inference_pb2.RewardInput(token_ids=[5, 6, 7]),
        ]
    )
    seeds = {
        "Reward": ([reward], False),
        "Generate": ([inference_pb2.GenerateRequest(prompt_token_ids=[5, 6])], False),
        "Score": (
            [
                inference_pb2.ScoreRequest(
                    items=[inference_pb2.ScoreItem(context="a", continuation=" b")]
                )
            ],
            False,
        ),
        "Tokenize": ([inference_pb2.TokenizeRequest(text="The model")], False),
        "GetModelInfo": ([inference_pb2.GetModelInfoRequest()], False),
    }

    async def good(channel: grpc.aio.Channel) -> None:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.RewardRequest(inputs=[inference_pb2.RewardInput(token_ids=[5, 6])])
        reply = await stub.Reward(request, timeout=60)
        expected = await served.front.run(lambda: served.scorer.score([[5, 6]]))
        assert list(reply.rewards) == expected

    async def main() -> Counter:
        try:
            return await _run_fuzz(
                bindings(config, served), SERVICE_NAME, seeds, good, seed=7, operations=False
            )
        finally:
            await served.front.close()

    statuses = asyncio.run(main())
    assert statuses["OK"] > 0 and statuses["INVALID_ARGUMENT"] > 0
