"""An InferenceService that answers every Generate with a chosen completion (the attacker's side).

Tokens are the prompt's UTF-8 bytes, so Generate recovers the prompt text and answers with
`answer(prompt)`. Only the evaluator under test is real; this stands for a model (or a
compromised inference endpoint) that returns hostile code.
"""

from __future__ import annotations

from collections.abc import Callable

from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from services.common.server import ServiceBinding
from tests.services.evaluator.servers import ServerThread

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


class FakeInference(inference_pb2_grpc.InferenceServiceServicer):
    """GetModelInfo, Tokenize and Generate; counts the Generate calls."""

    def __init__(self, answer: Callable[[str], str]) -> None:
        self.answer = answer
        self.generated = 0

    async def GetModelInfo(self, request, context):
        return inference_pb2.GetModelInfoResponse(
            model_name="hostile", family="llama", vocab_size=256, context_length=1 << 16
        )

    async def Tokenize(self, request, context):
        return inference_pb2.TokenizeResponse(token_ids=list(request.text.encode()))

    async def Generate(self, request, context):
        self.generated += 1
        prompt = bytes(request.prompt_token_ids).decode()
        return inference_pb2.GenerateResponse(
            sequences=[inference_pb2.Sequence(text=self.answer(prompt))]
        )


def serve_fake(answer: Callable[[str], str]) -> tuple[ServerThread, FakeInference]:
    """The fake on 127.0.0.1:<port 0> in its own thread; stop() the server when done."""
    servicer = FakeInference(answer)
    binding = ServiceBinding(
        SERVICE, servicer, inference_pb2_grpc.add_InferenceServiceServicer_to_server
    )
    return ServerThread([binding]), servicer
