"""InferenceService: validates every request, then runs it on the loaded model's engine.

Generation requests are judged by `engine.validation` (the rules the HTTP front applies too) in
two stages, both INVALID_ARGUMENT naming every bad field: the fields on their own, before
anything else, then against the loaded model (token ids inside the vocabulary, prompt +
max_new_tokens inside --max-model-len, cache rows). A Score item past the context is
OUT_OF_RANGE. A server started without --load
answers well-formed model calls with FAILED_PRECONDITION "no model loaded". With --enable-lora,
GenerateRequest.lora_adapter picks a loaded adapter (INVALID_ARGUMENT naming an unknown one), and
LoadLoraAdapter / UnloadLoraAdapter change them on a server with --auth-token-file.

A reward model (`--load` holds a scalar value head) is served without a generation engine
(services/inference/reward_serving.py): it answers Reward, Tokenize, Detokenize and GetModelInfo;
the other model RPCs are INVALID_ARGUMENT naming it, as Reward is on a causal LM.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator

import grpc

from engine.loading import LoadedModel
from engine.requests import Finish, RequestError, StepEvent
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from engine.validation import (
    MAX_LOGPROBS,
    InvalidRequest,
    Problem,
    prompt_problems,
    prompt_text_problems,
    request_problems,
    reward_problems,
    sampling_problems,
)
from engine.weight_update import WeightVersion, updatable_parameters
from meshline.inference.v1 import inference_pb2, inference_pb2_grpc
from services.common.checkpoint_formats import VALUES
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    MeshlineError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Validator,
)
from services.common.server import ServiceBinding
from services.inference.config import InferenceServiceConfig
from services.inference.grpc_structured import checked_grammar
from services.inference.http_config import HttpConfig
from services.inference.metrics import instrument, metered
from services.inference.off_loop import off_loop
from services.inference.reward_serving import (
    ServingRewardModel,
    build_serving_reward_model,
    serves_reward_model,
)
from services.inference.serving import ServingEngine, build_serving_engine, request_limits
from services.inference.weight_updates import require_updates, update_weights

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
FINISH_REASONS = {
    Finish.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    Finish.STOP: inference_pb2.FINISH_REASON_STOP,
    Finish.STOP_STRING: inference_pb2.FINISH_REASON_STOP_STRING,
    Finish.CANCELLED: inference_pb2.FINISH_REASON_CANCELLED,
}
DEFAULT_MAX_NEW_TOKENS = 64
MAX_REPORTED_VIOLATIONS = 20
"""A Score request stops being checked after this many bad fields (the error stays readable)."""


def request_failed(error: RequestError) -> MeshlineError:
    """The status of a request that failed inside the engine (the others went on): a value its
    fields led to (ValueError, overflow) is INVALID_ARGUMENT on `params`, anything else INTERNAL."""
    message = (
        f"the request failed in the engine while {error.stage} "
        f"({type(error.cause).__name__}: {error.cause}); other requests were not affected"
    )
    if isinstance(error.cause, (ValueError, ArithmeticError)):
        return InvalidArgument("params", message)
    return MeshlineError(message + "; the server log has the traceback")


def load_engine(config: InferenceServiceConfig) -> ServingEngine | ServingRewardModel | None:
    """The engine serving `config.load` (a reward model's scorer when it holds a value head), or
    None when the server starts without a model.

    Load problems raise ValueError naming the flag (the CLI prints it and exits 2).
    """
    if config.load is None:
        return None
    if serves_reward_model(config):
        return build_serving_reward_model(config)
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        # imported here: only a TP/PP server needs it (it pulls in torch.distributed's store)
        from services.inference.parallel_serving import launch_parallel

        return launch_parallel(config)
    return build_serving_engine(config)


def raise_problems(problems: list[Problem], prompt_field: str) -> None:
    """INVALID_ARGUMENT listing every problem (sampling fields as `params.<name>`)."""
    if problems:
        raise InvalidArgument.from_violations(
            (prompt_field if p.field == "prompt" else f"params.{p.field}", p.reason)
            for p in problems
        )


def raise_adapter_problems(error: InvalidRequest) -> None:
    """INVALID_ARGUMENT for a request the engine refused at submission: its `lora_adapter` (the
    engine's field `model`) or the fields engine.validation names."""
    if error.problems and error.problems[0].field == "model":
        raise InvalidArgument("lora_adapter", error.problems[0].reason)
    raise_problems(error.problems, "prompt")


def check_generate_request(
    request: inference_pb2.GenerateRequest, config: InferenceServiceConfig
) -> None:
    """Raises InvalidArgument naming every malformed field of a Generate(Stream) request
    (engine.validation's rules, before any model is needed)."""
    has_text, has_ids = bool(request.prompt), len(request.prompt_token_ids) > 0
    if has_text == has_ids:
        raise InvalidArgument(
            "prompt",
            "give exactly one of prompt and prompt_token_ids"
            + (" (both are set)" if has_text else " (neither is set)"),
        )
    limits = request_limits(config)
    if has_text:
        problems = prompt_text_problems(request.prompt, limits)
    else:
        problems = prompt_problems(list(request.prompt_token_ids), limits)
    problems += sampling_problems(sampling_config(request.params), limits)
    raise_problems(problems, "prompt" if has_text else "prompt_token_ids")


def check_score_request(
    request: inference_pb2.ScoreRequest, config: InferenceServiceConfig
) -> None:
    """Raises InvalidArgument naming every malformed item of a Score request."""
    check = Validator()
    check.require(len(request.items) > 0, "items", "give at least one item to score")
    check.require(
        0 <= request.top_logprobs <= MAX_LOGPROBS,
        "top_logprobs",
        f"must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}",
    )
    check.require(
        len(request.items) <= config.max_score_items,
        "items",
        f"at most {config.max_score_items} items per request, got {len(request.items)}",
    )
    if check.violations:
        check.raise_if_any()
    for i, item in enumerate(request.items):
        check.require(
            len(item.context) + len(item.continuation) <= config.max_text_chars,
            f"items[{i}]",
            f"context + continuation must be at most {config.max_text_chars} characters",
        )
        check.require(
            len(item.context_token_ids) + len(item.continuation_token_ids)
            <= config.max_score_tokens,
            f"items[{i}]",
            f"at most {config.max_score_tokens} token ids per request (--max-score-tokens)",
        )
        check.require(
            not (item.context and item.context_token_ids),
            f"items[{i}].context",
            "give the context as text or as context_token_ids, not both",
        )
        has_text, has_ids = bool(item.continuation), len(item.continuation_token_ids) > 0
        check.require(
            has_text != has_ids,
            f"items[{i}].continuation",
            "give exactly one of continuation and continuation_token_ids (non-empty)",
        )
        check.require(
            min(item.context_token_ids, default=0) >= 0
            and min(item.continuation_token_ids, default=0) >= 0,
            f"items[{i}]",
            "token ids must be >= 0",
        )
        if len(check.violations) >= MAX_REPORTED_VIOLATIONS:
            break
    check.raise_if_any()


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Validates requests, then runs them on the engine (None = no model loaded).

    Each RPC checks its request, then `_require_engine()`, then calls one `_run_*` method.
    """

    def __init__(
        self,
        config: InferenceServiceConfig,
        engine: ServingEngine | ServingRewardModel | None,
        runtime_lora: bool = False,
    ) -> None:
        self._config = config
        self._reward = engine if isinstance(engine, ServingRewardModel) else None
        """The served reward model (None: a causal LM or nothing is served)."""
        self._engine = engine if isinstance(engine, ServingEngine) else None
        self._weights: WeightVersion | None = None
        """The served weights' version; None: UpdateWeights is refused (no
        --allow-weight-updates, or no model)."""
        if self._engine is not None and config.allow_weight_updates:
            self._weights = WeightVersion(updatable_parameters(self._engine.engine.model))
        self._runtime_lora = runtime_lora
        """Whether LoadLoraAdapter/UnloadLoraAdapter may run (the server checks a token)."""

    def _require_engine(self) -> ServingEngine:
        if self._reward is not None:
            raise InvalidArgument(
                "model",
                f"the served model {self._reward.loaded.name!r} is a reward model (a scalar "
                "value head): it answers Reward (HTTP POST /pooling), Tokenize, Detokenize and "
                "GetModelInfo; generate and score log-probabilities with a causal LM",
            )
        if self._engine is None:
            raise FailedPrecondition(
                "no model loaded; start the server with --load DIR (a checkpoint directory)"
            )
        return self._engine

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        """Generates the requested sequences and returns them all at once."""
        check_generate_request(request, self._config)
        return await self._run_generate(self._require_engine(), request)

    async def GenerateStream(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        """Generates like Generate, streaming each step's new tokens per sequence."""
        check_generate_request(request, self._config)
        async for response in self._run_generate_stream(self._require_engine(), request):
            yield response

    async def Score(
        self, request: inference_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ScoreResponse:
        """Log-probabilities of each item's continuation after its context."""
        check_score_request(request, self._config)
        return await self._run_score(self._require_engine(), request)

    async def Reward(
        self, request: inference_pb2.RewardRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.RewardResponse:
        """One reward per input from the served reward model."""
        check_reward_request(request, self._config)
        reward = self._reward
        if reward is None:
            engine = self._require_engine()  # FAILED_PRECONDITION without a model
            raise InvalidArgument(
                "model",
                f"the served model {engine.loaded.name!r} is a causal LM, not a reward model "
                "(no scalar value head); serve a `meshline train --stage rm` checkpoint or a "
                "...ForSequenceClassification with one label to get rewards",
            )
        return await self._run_reward(reward, request)

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        """Token ids of the text under the loaded model's tokenizer."""
        check = Validator()
        check.require(
            len(request.text) <= self._config.max_text_chars,
            "text",
            f"at most {self._config.max_text_chars} characters (--max-text-chars), "
            f"got {len(request.text)}",
        )
        check.raise_if_any()
        return await self._run_tokenize(self._require_model(), request)

    async def Detokenize(
        self, request: inference_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.DetokenizeResponse:
        """Text of the token ids under the loaded model's tokenizer."""
        check = Validator()
        if check.require(
            len(request.token_ids) <= self._config.max_text_chars,
            "token_ids",
            f"at most {self._config.max_text_chars} ids (--max-text-chars), "
            f"got {len(request.token_ids)}",
        ):
            check.require(min(request.token_ids, default=0) >= 0, "token_ids", "must be >= 0")
        check.raise_if_any()
        return await self._run_detokenize(self._require_model(), request)

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        """Name, architecture, vocabulary, context length, dtype and layout of the loaded model."""
        if self._reward is not None:
            return _reward_model_info(self._reward)
        return await self._run_model_info(self._require_engine())

    async def UpdateWeights(
        self,
        request_iterator: AsyncIterator[inference_pb2.UpdateWeightsRequest],
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.UpdateWeightsResponse:
        """Replaces the served weights with the streamed, newer version (all or nothing)."""
        engine = self._require_engine()
        served = require_updates(self._weights)
        return await update_weights(served, engine, request_iterator)

    async def GetWeightsVersion(
        self, request: inference_pb2.GetWeightsVersionRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetWeightsVersionResponse:
        """The version of the served weights (0: as loaded)."""
        self._require_engine()
        return inference_pb2.GetWeightsVersionResponse(
            version=0 if self._weights is None else self._weights.version,
            updates_allowed=self._weights is not None,
        )

    async def LoadLoraAdapter(
        self, request: inference_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.LoadLoraAdapterResponse:
        """Serves another LoRA adapter by name (see the proto)."""
        engine = self._lora_engine()
        adapters = engine.engine.adapters
        assert adapters is not None
        if request.lora_name in adapters.names():
            raise InvalidArgument("lora_name", f"an adapter named {request.lora_name!r} is loaded")
        if request.lora_name == engine.loaded.name:
            raise InvalidArgument("lora_name", "is the base model's name")
        path = self._config.resolve_adapter(request.lora_path, "lora_path")
        try:
            prepared = await off_loop(
                lambda: adapters.prepare(request.lora_name, path, "lora_path")
            )
            await engine.front.run(lambda: engine.engine.install_adapter(prepared, "lora_name"))
        except ValueError as exc:
            field, _, reason = str(exc).partition(": ")
            raise InvalidArgument(field, reason) from None
        return inference_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(
        self, request: inference_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.UnloadLoraAdapterResponse:
        """Stops serving a LoRA adapter to new requests (see the proto)."""
        engine = self._lora_engine()
        try:
            await engine.front.run(
                lambda: engine.engine.remove_adapter(request.lora_name, "lora_name")
            )
        except ValueError as exc:
            raise NotFound(str(exc)) from None
        return inference_pb2.UnloadLoraAdapterResponse()

    def _require_model(self) -> ServingEngine | ServingRewardModel:
        """The served model, whichever kind (for the RPCs both answer)."""
        return self._reward if self._reward is not None else self._require_engine()

    async def _run_reward(
        self, reward: ServingRewardModel, request: inference_pb2.RewardRequest
    ) -> inference_pb2.RewardResponse:
        tokens = reward.tokens

        def encode() -> list[list[int]]:
            rows = []
            for i, item in enumerate(request.inputs):
                if item.text:
                    try:
                        rows.append(tokens.encode_prompt(item.text))
                    except ValueError as exc:
                        raise FailedPrecondition(f"inputs[{i}].text: {exc}") from None
                else:
                    rows.append(list(item.token_ids))
            return rows

        rows = await off_loop(encode)
        problems = reward_problems(rows, reward.limits(self._config))
        if problems:
            raise InvalidArgument.from_violations((p.field, p.reason) for p in problems)
        rewards = await reward.front.run(lambda: reward.scorer.score(rows))
        return inference_pb2.RewardResponse(rewards=rewards, num_tokens=[len(r) for r in rows])

    def _lora_engine(self) -> ServingEngine:
        engine = self._require_engine()
        if engine.engine.adapters is None:
            raise FailedPrecondition(
                "this server serves no LoRA adapters; start it with --enable-lora"
            )
        if not self._runtime_lora:
            raise PermissionDenied(
                "loading and unloading LoRA adapters at run time needs an authenticated server; "
                "start it with --auth-token-file (the adapters of --lora-modules need none)"
            )
        return engine

    async def _run_generate(
        self, engine: ServingEngine, request: inference_pb2.GenerateRequest
    ) -> inference_pb2.GenerateResponse:
        prompt_ids, config = await self._prepare(engine, request)
        sequences = [inference_pb2.Sequence() for _ in range(config.num_return_sequences)]
        adapter = request.lora_adapter
        try:
            # One reply at the end: the engine posts this request's events once it finishes.
            async for event in metered(
                engine.front, prompt_ids, config, "grpc", hold=True, adapter=adapter
            ):
                seq = sequences[event.index]
                seq.token_ids.extend(event.token_ids)
                seq.text += event.text
                seq.cumulative_logprob = event.cumulative_logprob
                seq.seed = event.seed
                seq.token_logprobs.extend(event.token_logprobs)
                seq.top_logprobs.extend(_top_messages(event.top_logprobs))
                if event.finish is not None:
                    seq.finish_reason = FINISH_REASONS[event.finish]
        except RequestError as exc:
            raise request_failed(exc) from exc
        except InvalidRequest as exc:  # the adapter was unloaded since _prepare
            raise_adapter_problems(exc)
        return inference_pb2.GenerateResponse(sequences=sequences)

    async def _run_generate_stream(
        self, engine: ServingEngine, request: inference_pb2.GenerateRequest
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        prompt_ids, config = await self._prepare(engine, request)
        adapter = request.lora_adapter
        try:
            async for event in metered(engine.front, prompt_ids, config, "grpc", adapter=adapter):
                yield _stream_message(event)
        except RequestError as exc:
            raise request_failed(exc) from exc
        except InvalidRequest as exc:  # the adapter was unloaded since _prepare
            raise_adapter_problems(exc)

    async def _prepare(
        self, engine: ServingEngine, request: inference_pb2.GenerateRequest
    ) -> tuple[list[int], SamplingConfig]:
        """Prompt ids and decoding settings, checked against the loaded model."""
        tokens = engine.tokens
        if request.prompt:
            if tokens.tokenizer is None:
                raise FailedPrecondition(
                    "prompt: this server has no tokenizer; send prompt_token_ids or restart it "
                    "with --tokenizer PATH"
                )
            add = not request.HasField("add_special_tokens") or request.add_special_tokens
            prompt_ids = await off_loop(lambda: tokens.encode_prompt(request.prompt, add))
            field = "prompt"
        else:
            prompt_ids = list(request.prompt_token_ids)
            field = "prompt_token_ids"
        config = sampling_config(request.params)
        if request.HasField("structured_output"):
            grammar = await off_loop(lambda: checked_grammar(engine, request))
            config = dataclasses.replace(config, grammar=grammar)
        limits = request_limits(self._config, engine)
        raise_problems(request_problems(prompt_ids, config, limits), field)
        try:
            engine.engine.adapter_slot(request.lora_adapter)
        except InvalidRequest as exc:
            raise_adapter_problems(exc)
        return prompt_ids, config

    async def _run_score(
        self, engine: ServingEngine, request: inference_pb2.ScoreRequest
    ) -> inference_pb2.ScoreResponse:
        items = await off_loop(lambda: self._score_items(engine, request))
        limit = engine.engine.max_seq_len  # --max-model-len, else the model's context length
        for i, (context, continuation) in enumerate(items):
            if len(context) + len(continuation) > limit:
                raise OutOfRange(
                    f"items[{i}]: context + continuation is {len(context) + len(continuation)} "
                    f"tokens, over the server's model length {limit} (--max-model-len)"
                )
        total = sum(len(c) + len(x) for c, x in items)
        if total > self._config.max_score_tokens:
            raise InvalidArgument(
                "items",
                f"the items hold {total} tokens in all, at most {self._config.max_score_tokens} "
                "per request (--max-score-tokens); split them over several requests",
            )
        pad = engine.tokens.pad_id or 0
        top = request.top_logprobs
        results = await engine.front.run(lambda: engine.engine.score(items, pad, top))
        return inference_pb2.ScoreResponse(
            results=[
                inference_pb2.ScoreResult(
                    logprob=r.logprob,
                    is_greedy=r.is_greedy,
                    token_logprobs=r.token_logprobs,
                    top_logprobs=_top_messages(r.top_logprobs),
                )
                for r in results
            ]
        )

    def _score_items(
        self, engine: ServingEngine, request: inference_pb2.ScoreRequest
    ) -> list[tuple[list[int], list[int]]]:
        """(context ids, continuation ids) per item, tokenised and checked (a worker thread)."""
        tokens = engine.tokens
        items = []
        check = Validator()
        for i, item in enumerate(request.items):
            try:
                context = list(item.context_token_ids) or (
                    tokens.require().encode(item.context) if item.context else []
                )
                continuation = list(item.continuation_token_ids) or tokens.require().encode(
                    item.continuation
                )
            except ValueError as exc:
                raise FailedPrecondition(f"items[{i}]: {exc}") from None
            if not context and tokens.prefix_id is not None:
                context = [tokens.prefix_id]  # lm-eval's prefix token: BOS, else EOS
            check.require(
                context, f"items[{i}].context", "empty context and the tokenizer has no BOS or EOS"
            )
            check.require(
                continuation, f"items[{i}].continuation", "the continuation encodes to no tokens"
            )
            check.require(
                all(t < tokens.vocab_size for t in (*context, *continuation)),
                f"items[{i}]",
                f"token ids must be < the vocabulary size {tokens.vocab_size}",
            )
            items.append((context, continuation))
            if len(check.violations) >= MAX_REPORTED_VIOLATIONS:
                break
        check.raise_if_any()
        return items

    async def _run_tokenize(
        self, engine: ServingEngine | ServingRewardModel, request: inference_pb2.TokenizeRequest
    ) -> inference_pb2.TokenizeResponse:
        tokens = engine.tokens

        def tokenize() -> inference_pb2.TokenizeResponse:
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = tokens.encode_prompt(request.text, add_special_tokens=add)
            # Built here too: a response of millions of pieces takes a while to assemble.
            return inference_pb2.TokenizeResponse(token_ids=ids, tokens=tokens.pieces(ids))

        try:
            return await off_loop(tokenize)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None

    async def _run_detokenize(
        self,
        engine: ServingEngine | ServingRewardModel,
        request: inference_pb2.DetokenizeRequest,
    ) -> inference_pb2.DetokenizeResponse:
        tokens = engine.tokens
        if max(request.token_ids, default=0) >= tokens.vocab_size:
            bad = [t for t in request.token_ids if t >= tokens.vocab_size]
            raise InvalidArgument(
                "token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {tokens.vocab_size})"
            )
        ids = list(request.token_ids)
        try:
            text = await off_loop(lambda: tokens.detokenize(ids, request.skip_special_tokens))
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
        return inference_pb2.DetokenizeResponse(text=text)

    async def _run_model_info(self, engine: ServingEngine) -> inference_pb2.GetModelInfoResponse:
        info = _model_info(
            engine.loaded,
            engine.tokens,
            context_length=engine.engine.max_seq_len,
            dtype=engine.dtype_name,
            device=engine.engine.device.type,
            num_parameters=engine.num_parameters(),
            task=inference_pb2.MODEL_TASK_GENERATE,
        )
        info.parallel_layout.tensor_parallel_size = engine.tensor_parallel_size
        info.parallel_layout.pipeline_parallel_size = engine.pipeline_parallel_size
        if engine.engine.adapters is not None:
            info.lora_adapters.extend(engine.engine.adapters.names())
        return info


def check_reward_request(
    request: inference_pb2.RewardRequest, config: InferenceServiceConfig
) -> None:
    """Raises InvalidArgument naming every malformed input of a Reward request (before any
    model is needed; lengths in tokens are checked once tokenised)."""
    check = Validator()
    check.require(len(request.inputs) > 0, "inputs", "give at least one input to score")
    check.require(
        len(request.inputs) <= config.max_score_items,
        "inputs",
        f"at most {config.max_score_items} inputs per request (--max-score-items), "
        f"got {len(request.inputs)}",
    )
    check.raise_if_any()
    ids_in_all = 0
    for i, item in enumerate(request.inputs):
        has_text, has_ids = bool(item.text), len(item.token_ids) > 0
        check.require(
            has_text != has_ids,
            f"inputs[{i}]",
            "give exactly one of text and token_ids (non-empty)"
            + (" (both are set)" if has_text else ""),
        )
        check.require(
            len(item.text) <= config.max_text_chars,
            f"inputs[{i}].text",
            f"at most {config.max_text_chars} characters (--max-text-chars), got {len(item.text)}",
        )
        check.require(min(item.token_ids, default=0) >= 0, f"inputs[{i}].token_ids", "must be >= 0")
        ids_in_all += len(item.token_ids)
        if len(check.violations) >= MAX_REPORTED_VIOLATIONS:
            break
    check.require(
        ids_in_all <= config.max_score_tokens,
        "inputs",
        f"at most {config.max_score_tokens} token ids per request (--max-score-tokens), "
        f"got {ids_in_all}",
    )
    check.raise_if_any()


def _reward_model_info(reward: ServingRewardModel) -> inference_pb2.GetModelInfoResponse:
    """GetModelInfo of a served reward model (one process; no adapters)."""
    return _model_info(
        reward.loaded,
        reward.tokens,
        context_length=reward.max_seq_len,
        dtype=reward.dtype_name,
        device=reward.scorer.device.type,
        num_parameters=reward.num_parameters(),
        task=inference_pb2.MODEL_TASK_REWARD,
    )


def _model_info(
    loaded: LoadedModel,
    tokens: TokenizerInfo,
    *,
    context_length: int,
    dtype: str,
    device: str,
    num_parameters: int,
    task: int,
) -> inference_pb2.GetModelInfoResponse:
    """The fields every served model reports (one process layout; the caller adds the rest)."""
    info = inference_pb2.GetModelInfoResponse(
        model_name=loaded.name,
        family=loaded.config.family,
        vocab_size=loaded.config.vocab_size,
        context_length=context_length,
        dtype=dtype,
        parallel_layout=inference_pb2.ParallelLayout(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1
        ),
        checkpoint_path=str(loaded.path),
        load_format=loaded.load_format,
        checkpoint_format=VALUES[loaded.load_format],
        device=device,
        num_parameters=num_parameters,
        task=task,  # type: ignore[arg-type]
    )
    for name, value in (
        ("eos_token_id", tokens.eos_id),
        ("bos_token_id", tokens.bos_id),
        ("pad_token_id", tokens.pad_id),
    ):
        if value is not None:
            setattr(info, name, value)
    return info


def sampling_config(params: inference_pb2.SamplingParams) -> SamplingConfig:
    """Request parameters with their defaults applied (already validated field by field)."""

    def get(name: str, default: object) -> object:
        return getattr(params, name) if params.HasField(name) else default

    seed = params.seed if params.HasField("seed") else secrets.randbits(63)
    return SamplingConfig(
        max_new_tokens=int(get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),  # type: ignore[call-overload]
        do_sample=bool(get("do_sample", False)),
        temperature=float(get("temperature", 1.0)),  # type: ignore[arg-type]
        top_k=int(get("top_k", 0)),  # type: ignore[call-overload]
        top_p=float(get("top_p", 1.0)),  # type: ignore[arg-type]
        num_beams=int(get("num_beams", 1)),  # type: ignore[call-overload]
        repetition_penalty=float(get("repetition_penalty", 1.0)),  # type: ignore[arg-type]
        length_penalty=float(get("length_penalty", 1.0)),  # type: ignore[arg-type]
        early_stopping=bool(get("early_stopping", False)),
        num_return_sequences=int(get("num_return_sequences", 1)),  # type: ignore[call-overload]
        stop=tuple(params.stop),
        seed=int(seed),
        logprobs=int(get("logprobs", 0)),  # type: ignore[call-overload]
    )


def _top_messages(top: list[list[tuple[int, float]]]) -> list[inference_pb2.TopLogprobs]:
    return [
        inference_pb2.TopLogprobs(
            candidates=[inference_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in position]
        )
        for position in top
    ]


def _stream_message(event: StepEvent) -> inference_pb2.GenerateStreamResponse:
    return inference_pb2.GenerateStreamResponse(
        index=event.index,
        token_ids=event.token_ids,
        text=event.text,
        finish_reason=FINISH_REASONS[event.finish]
        if event.finish is not None
        else inference_pb2.FINISH_REASON_UNSPECIFIED,
        cumulative_logprob=event.cumulative_logprob,
        seed=event.seed,
        token_logprobs=event.token_logprobs,
        top_logprobs=_top_messages(event.top_logprobs),
    )


def bindings(
    config: InferenceServiceConfig,
    engine: ServingEngine | ServingRewardModel | None,
    http: HttpConfig | None = None,
    runtime_lora: bool = False,
) -> list[ServiceBinding]:
    """The services an inference server hosts (health and reflection are added by the server);
    with `http.http_port`, the OpenAI-compatible HTTP front runs beside it on the same engine.
    `runtime_lora`: the server checks a token, so LoadLoraAdapter/UnloadLoraAdapter may run."""
    servicer = InferenceServicer(config, engine, runtime_lora)
    if isinstance(engine, ServingEngine):
        instrument(engine.engine)
    companion = None
    if http is not None and http.http_port is not None:
        # The ASGI stack is imported only by servers that serve HTTP (start-up time).
        from services.inference.http_server import http_companion

        companion = http_companion(engine, config, http)
    return [
        ServiceBinding(
            SERVICE_NAME,
            servicer,
            inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            on_stop=None if engine is None else engine.stop,
            max_request_bytes=config.max_request_mb * 2**20,
            companion=companion,
        )
    ]
