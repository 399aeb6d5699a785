"""Bounded fuzz of UpdateWeights (a client stream): mutated headers and chunks, raw bytes.

A real inference server with --allow-weight-updates and a token, on localhost port 0. Each call
streams a valid partial update of one small tensor with one message replaced by a mutation
(field-level, byte-level, or random bytes sent raw, so undecodable messages reach the server),
and a few streams of random messages only. No call may end UNKNOWN or INTERNAL; an update that
was refused leaves the served weights as they were (checked through a parameter's bytes and the
version), and afterwards the server is SERVING and takes a good update.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from meshline_client.weight_sync import update_messages
from services.common.config import ServerConfig
from services.common.server import create_server
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import SERVICE_NAME, bindings, load_engine
from tests.security.fuzzing import Fuzzer
from tests.services.inference.helpers import hf_reference, save_hf_checkpoint

STREAMS = 80
TOKEN = "fuzz-token"
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
METHOD = f"/{SERVICE_NAME}/UpdateWeights"
TENSOR = "layers.0.input_layernorm.weight"


def test_fuzz_update_weights(tmp_path: Path, sentencepiece_model: Path) -> None:
    hf, _, _ = hf_reference("llama-gqa", seed=2, vocab_size=512)
    directory = save_hf_checkpoint(hf, tmp_path / "ckpt", sentencepiece_model)
    (tmp_path / "token").write_text(TOKEN)
    config = InferenceServiceConfig(load=directory, max_batch_rows=4, allow_weight_updates=True)
    engine = load_engine(config)
    assert engine is not None
    param = dict(engine.engine.model.named_parameters())[TENSOR]
    fuzzer, rng = Fuzzer(7), random.Random(7)
    auth = (("authorization", f"Bearer {TOKEN}"),)

    def good(version: int) -> list[bytes]:
        value = torch.full_like(param, float(version))
        messages = update_messages([(TENSOR, value)], version, partial=True, chunk_bytes=1024)
        return [m.SerializeToString() for m in messages]

    async def main() -> Counter:
        server_config = ServerConfig(
            host="127.0.0.1", port=0, auth_token_file=str(tmp_path / "token")
        )
        server, port, _ = await create_server(bindings(config, engine), server_config)
        statuses: Counter = Counter()
        failures: list[str] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_unary(METHOD)
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                version_now = 0
                for i in range(STREAMS):
                    bodies = good(version_now + 1)
                    if i % 10 == 9:
                        bodies = [rng.randbytes(rng.choice((1, 17, 300))) for _ in range(3)]
                    else:
                        at = rng.randrange(len(bodies))
                        seed = inference_pb2.UpdateWeightsRequest.FromString(bodies[at])
                        bodies[at] = fuzzer.mutate(seed)
                    before = param.detach().clone()
                    try:
                        await call(iter(bodies), metadata=auth, timeout=20)
                        code = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code()
                        if code in FORBIDDEN:
                            failures.append(f"stream {i} -> {code.name}: {exc.details()[:300]}")
                    statuses[code.name] += 1
                    reply = await stub.GetWeightsVersion(
                        inference_pb2.GetWeightsVersionRequest(), metadata=auth, timeout=10
                    )
                    if code == grpc.StatusCode.OK:
                        version_now = reply.version
                    else:
                        assert reply.version == version_now, (i, code)
                        assert torch.equal(param, before), (i, code)
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                await call(iter(good(version_now + 1)), metadata=auth, timeout=20)
                assert torch.equal(param, torch.full_like(param, float(version_now + 1)))
        finally:
            await server.stop(None)
            await engine.front.close()
        assert not failures, "\n".join(failures[:20])
        return statuses

    statuses = asyncio.run(main())
    print(dict(statuses))
    assert statuses["INVALID_ARGUMENT"] > 0 and sum(statuses.values()) == STREAMS
