"""kill -9 the inference service in the middle of a streamed generation, restart it, and check
from outside: the client's stream ends with UNAVAILABLE instead of hanging, nothing the service
started survives it, and the restarted service serves the same model (a greedy request gives
the tokens the interrupted stream had begun)."""

from __future__ import annotations

import grpc
import pytest

from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.chaos.procs import Service, alive, start_service, wait_for
from tests.services.inference.http_served import make_checkpoint

pytestmark = [pytest.mark.slow]
PROMPT = [1, 40, 77, 9]
NEW_TOKENS = 120


def greedy() -> inference_pb2.GenerateRequest:
    params = inference_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    return inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=params)


def generate(service: Service) -> list[int]:
    with service.channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        return list(stub.Generate(greedy(), timeout=120).sequences[0].token_ids)


def test_inference_killed_mid_stream_serves_again_after_restart(
    tmp_path_factory: pytest.TempPathFactory, sentencepiece_model, tmp_path
) -> None:
    directory, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=7)
    state = tmp_path / "state"
    service = start_service("inference", None, state, "--load", str(directory))
    try:
        expected = generate(service)
        streamed: list[int] = []
        channel = service.channel()
        stream = inference_pb2_grpc.InferenceServiceStub(channel).GenerateStream(
            greedy(), timeout=120
        )
        with pytest.raises(grpc.RpcError) as broken:
            for message in stream:
                streamed.extend(message.token_ids)
                if len(streamed) == 1:
                    started = service.kill9()
        channel.close()
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE
        assert streamed and streamed == expected[: len(streamed)] and len(streamed) < NEW_TOKENS
        wait_for(lambda: not alive(started), 30, "the killed service's processes to end")
        service = start_service("inference", None, state, "--load", str(directory))
        assert generate(service) == expected
    finally:
        service.stop()
