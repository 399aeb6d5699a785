"""`GrpcLanguageModel`: the evaluator's client of a running meshline InferenceService.

Scores go out as `Score` calls of up to `batch_size` items (token ids, so truncation is ours),
each distinct item once and the items sharing a context in the same call;
generations as up to `batch_size` concurrent `Generate` calls, which the server's continuous
batching runs together. Tokenisation uses the server's `Tokenize` (cached per text). Rewards
(a served reward model) go out as `Reward` calls of up to `batch_size` token-id inputs; a server
that refuses one (a causal LM, or a reward model asked for log-likelihoods) says why, and the
evaluation stops with that message.
"""

from __future__ import annotations

import grpc

from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from services.evaluator.models.base import GenerationRequest, LanguageModel, SpecialTokens

DEFAULT_TIMEOUT_S = 600.0
_Item = tuple[tuple[int, ...], tuple[int, ...]]
"""(context ids, continuation ids) of one log-likelihood request, hashable."""


class GrpcLanguageModel(LanguageModel):
    """A model behind `endpoint` (host:port)."""

    def __init__(
        self,
        endpoint: str,
        *,
        batch_size: int = 8,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        channel: grpc.Channel | None = None,
        add_bos_token: bool | None = None,
        flag: str = "--endpoint",
    ) -> None:
        self.name = endpoint
        self.flag = flag  # the flag that named the endpoint, for errors
        self.add_bos_token = add_bos_token
        self._channel = channel or grpc.insecure_channel(
            endpoint, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._batch = max(1, batch_size)
        self._timeout = timeout_s
        self._token_cache: dict[tuple[str, bool], list[int]] = {}
        self._special: SpecialTokens | None = None
        try:
            info = self._stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            raise ConnectionError(
                f"{flag} {endpoint}: the inference service did not answer GetModelInfo "
                f"({err.code().name}: {err.details()}); start it with `meshline serve inference "
                "--load DIR`"
            ) from None
        self._context_length = int(info.context_length)
        self.info = info

    @property
    def fingerprint(self) -> str:
        """Endpoint plus the served checkpoint: a different model there misses the cache."""
        return f"{self.name}|{self.info.model_name}|{self.info.checkpoint_path}"

    @property
    def context_length(self) -> int:
        """The served model's context length."""
        return self._context_length

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Ids via the server's Tokenize, several calls in flight."""
        keys = [(t, add_special_tokens) for t in texts]
        missing = [k for k in dict.fromkeys(keys) if k not in self._token_cache]
        for start in range(0, len(missing), self._batch):
            chunk = missing[start : start + self._batch]
            futures = [
                self._stub.Tokenize.future(
                    inference_pb2.TokenizeRequest(text=t, add_special_tokens=add),
                    timeout=self._timeout,
                )
                for t, add in chunk
            ]
            for key, future in zip(chunk, futures, strict=True):
                self._token_cache[key] = list(future.result().token_ids)
        return [list(self._token_cache[k]) for k in keys]

    @property
    def special_tokens(self) -> SpecialTokens:
        """BOS and lm-eval's prefix token from GetModelInfo, their texts from Detokenize."""
        if self._special is None:
            info = self.info
            bos = info.bos_token_id if info.HasField("bos_token_id") else None
            eos = info.eos_token_id if info.HasField("eos_token_id") else None
            prefix = bos if bos is not None else eos  # None: only empty contexts fail

            def text(token_id: int | None) -> str | None:
                if token_id is None:
                    return None
                request = inference_pb2.DetokenizeRequest(
                    token_ids=[token_id], skip_special_tokens=False
                )
                return self._stub.Detokenize(request, timeout=self._timeout).text

            self._special = SpecialTokens(bos, text(bos), prefix, text(prefix), eos_id=eos)
        return self._special

    def score_ids(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Score calls of up to `batch_size` items; each distinct item is sent once.

        The server runs a context once per call for all the items that share it, so items are
        grouped by context and a group is split across calls only when it alone exceeds
        `batch_size` (in request order, 8-item calls would cut a 5-choice question in two and
        run its context twice).
        """
        unique = list(dict.fromkeys((tuple(c), tuple(x)) for c, x in items))
        by_context: dict[tuple[int, ...], list[_Item]] = {}
        for item in unique:
            by_context.setdefault(item[0], []).append(item)
        calls: list[list[_Item]] = []
        for members in by_context.values():
            for start in range(0, len(members), self._batch):
                piece = members[start : start + self._batch]
                if calls and len(calls[-1]) + len(piece) <= self._batch:
                    calls[-1] += piece
                else:
                    calls.append(piece)
        scores: dict[_Item, tuple[float, bool]] = {}
        for call in calls:
            request = inference_pb2.ScoreRequest(
                items=[
                    inference_pb2.ScoreItem(context_token_ids=c, continuation_token_ids=x)
                    for c, x in call
                ]
            )
            reply = self._stub.Score(request, timeout=self._timeout)
            for item, r in zip(call, reply.results, strict=True):
                scores[item] = (r.logprob, r.is_greedy)
        return [scores[(tuple(c), tuple(x))] for c, x in items]

    @property
    def is_reward_model(self) -> bool | None:
        """Not known before asking: the server refuses what its model cannot answer."""
        return None

    def reward_ids(self, rows: list[list[int]]) -> list[float]:
        """Reward calls of up to `batch_size` inputs (ids, so the encoding is ours)."""
        rewards: list[float] = []
        for start in range(0, len(rows), self._batch):
            request = inference_pb2.RewardRequest(
                inputs=[
                    inference_pb2.RewardInput(token_ids=row)
                    for row in rows[start : start + self._batch]
                ]
            )
            try:
                reply = self._stub.Reward(request, timeout=self._timeout)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                raise ValueError(f"{self.flag} {self.name}: {err.details()}") from None
            rewards.extend(reply.rewards)
        return rewards

    def generate_ids(
        self, prompts: list[list[int]], requests: list[GenerationRequest]
    ) -> list[str]:
        """`batch_size` Generate calls in flight at a time."""
        texts: list[str] = []
        for start in range(0, len(prompts), self._batch):
            futures = [
                self._stub.Generate.future(
                    inference_pb2.GenerateRequest(
                        prompt_token_ids=prompt,
                        params=_sampling(request),
                    ),
                    timeout=self._timeout,
                )
                for prompt, request in zip(
                    prompts[start : start + self._batch],
                    requests[start : start + self._batch],
                    strict=True,
                )
            ]
            try:
                texts.extend(f.result().sequences[0].text for f in futures)
            except grpc.RpcError as err:
                # e.g. a served reward model: the server says why, naming no flag of ours
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                raise ValueError(f"{self.flag} {self.name}: {err.details()}") from None
        return texts

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


def _sampling(request: GenerationRequest) -> inference_pb2.SamplingParams:
    params = inference_pb2.SamplingParams(
        max_new_tokens=request.max_new_tokens,
        do_sample=request.temperature is not None,
        stop=list(request.until),
        seed=request.seed,
    )
    if request.temperature is not None:
        params.temperature = request.temperature
    return params
