"""InferenceClient: generate, stream, score, rewards, tokenize and model info, as typed Python
results."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from meshline_client.connection import Connection

FINISH = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop_string",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class TopLogprob:
    """One candidate token at a position."""

    token_id: int
    logprob: float


@dataclass
class Completion:
    """One generated sequence."""

    text: str
    token_ids: list[int]
    finish_reason: str
    cumulative_logprob: float
    seed: int
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)


@dataclass
class StreamDelta:
    """New tokens of one sequence from a stream; `finish_reason` is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class Score:
    """Log-probability of a continuation, and whether it is the greedy one."""

    logprob: float
    is_greedy: bool
    token_logprobs: list[float]
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)


@dataclass
class ModelInfo:
    """What the server loaded."""

    model_name: str
    family: str
    vocab_size: int
    context_length: int
    dtype: str
    eos_token_id: int | None
    bos_token_id: int | None


def _top(messages: Sequence[pb.TopLogprobs]) -> list[list[TopLogprob]]:
    return [[TopLogprob(c.token_id, c.logprob) for c in m.candidates] for m in messages]


class InferenceClient:
    """Calls meshline.inference.v1.InferenceService. Sampling keywords use HF names
    (max_new_tokens, temperature, top_k, top_p, num_beams, do_sample, repetition_penalty, stop,
    seed, length_penalty, num_return_sequences, early_stopping, logprobs)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._channel = connection.channel()
        self._stub = pb_grpc.InferenceServiceStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float:
        return self.connection.timeout_s if timeout_s is None else timeout_s

    @staticmethod
    def _request(prompt: str | Sequence[int], params: dict) -> pb.GenerateRequest:
        params = dict(params)
        structured = _structured(params.pop("structured_output", None))
        sampling = pb.SamplingParams(**params)
        request = pb.GenerateRequest(params=sampling, structured_output=structured)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        return request

    def generate_all(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **params: object
    ) -> list[Completion]:
        """Every sequence of one request (num_return_sequences of them)."""
        response = self._stub.Generate(
            self._request(prompt, params), timeout=self._timeout(timeout_s), wait_for_ready=True
        )
        return [
            Completion(
                s.text,
                list(s.token_ids),
                FINISH.get(s.finish_reason, "unspecified"),
                s.cumulative_logprob,
                s.seed,
                list(s.token_logprobs),
                _top(s.top_logprobs),
            )
            for s in response.sequences
        ]

    def generate(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **params: object
    ) -> Completion:
        """The first (best) sequence of one request."""
        return self.generate_all(prompt, timeout_s=timeout_s, **params)[0]

    def stream(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **params: object
    ) -> Iterator[StreamDelta]:
        """New tokens as they are produced; leaving the loop early cancels the generation."""
        call = self._stub.GenerateStream(
            self._request(prompt, params), timeout=self._timeout(timeout_s)
        )
        try:
            for message in call:
                yield StreamDelta(
                    message.index,
                    message.text,
                    list(message.token_ids),
                    FINISH.get(message.finish_reason),
                )
        finally:
            call.cancel()

    def score(
        self,
        pairs: Sequence[tuple[str | Sequence[int], str | Sequence[int]]],
        *,
        top_logprobs: int = 0,
        timeout_s: float | None = None,
    ) -> list[Score]:
        """Log-probability of each (context, continuation), text or token ids on either side."""
        items = []
        for context, continuation in pairs:
            item = pb.ScoreItem()
            if isinstance(context, str):
                item.context = context
            else:
                item.context_token_ids.extend(context)
            if isinstance(continuation, str):
                item.continuation = continuation
            else:
                item.continuation_token_ids.extend(continuation)
            items.append(item)
        request = pb.ScoreRequest(items=items, top_logprobs=top_logprobs)
        response = self._stub.Score(request, timeout=self._timeout(timeout_s), wait_for_ready=True)
        return [
            Score(r.logprob, r.is_greedy, list(r.token_logprobs), _top(r.top_logprobs))
            for r in response.results
        ]

    def reward(
        self, inputs: Sequence[str | Sequence[int]], *, timeout_s: float | None = None
    ) -> list[float]:
        """One reward per input (text or token ids) from a served reward model."""
        items = [
            pb.RewardInput(text=x) if isinstance(x, str) else pb.RewardInput(token_ids=list(x))
            for x in inputs
        ]
        response = self._stub.Reward(
            pb.RewardRequest(inputs=items), timeout=self._timeout(timeout_s), wait_for_ready=True
        )
        return list(response.rewards)

    def tokenize(
        self, text: str, *, add_special_tokens: bool = False, timeout_s: float | None = None
    ) -> list[int]:
        """Token ids of `text` under the served tokenizer."""
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._stub.Tokenize(request, timeout=self._timeout(timeout_s)).token_ids)

    def detokenize(
        self,
        token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        timeout_s: float | None = None,
    ) -> str:
        """Text of `token_ids`."""
        request = pb.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        return self._stub.Detokenize(request, timeout=self._timeout(timeout_s)).text

    def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """Name, family, vocabulary and context length of the served model."""
        info = self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self._timeout(timeout_s), wait_for_ready=True
        )
        return ModelInfo(
            info.model_name,
            info.family,
            info.vocab_size,
            info.context_length,
            info.dtype,
            info.eos_token_id if info.HasField("eos_token_id") else None,
            info.bos_token_id if info.HasField("bos_token_id") else None,
        )

    def ready(self, timeout_s: float = 10.0) -> bool:
        """Whether the channel connects within `timeout_s`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True


def _structured(value: object) -> pb.StructuredOutput | None:
    """`structured_output=` as a message, or a dict with one of json_schema (a dict or its JSON
    text), json_object (True), regex (a string) or choice (a list of strings)."""
    if value is None or isinstance(value, pb.StructuredOutput):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(
            "structured_output: give one of {'json_schema': ...}, {'json_object': True}, "
            "{'regex': ...} or {'choice': [...]}"
        )
    ((kind, given),) = value.items()
    if kind == "json_schema" and not isinstance(given, str):
        given = json.dumps(given)
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(values=list(given)))
    return pb.StructuredOutput(**{kind: given})
