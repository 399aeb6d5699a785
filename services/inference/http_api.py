"""The OpenAI-compatible HTTP API of the inference server (FastAPI), on the gRPC server's engine.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream` as server-sent events), vLLM's `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info` (lm-eval's remote tokenizer), `GET /health` (probes; no auth), vLLM's
`POST /pooling` (one reward per input, on a served reward model; services/inference/
openai_pooling.py), and with
--enable-lora vLLM's `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` (only on a
server with a bearer token: loading reads files on the server). A request's `model` picks the
base model or a loaded LoRA adapter; an unknown name is a 400 on a LoRA server.
Errors use OpenAI's JSON error object: 400 bad input, 401 missing/wrong bearer token, 404 unknown
model or route, 413 body too large, 429 too many requests in flight, 503 no model loaded (a
generation route on a reward model, or /pooling on a causal LM, is a 400 saying so); 500
only for a server bug (with an incident id in the log). A client that disconnects cancels its
generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.grammar import grammar_problem, json_schema_grammar
from engine.requests import Finish
from engine.validation import reward_problems
from services.common.errors import MeshlineError, PermissionDenied
from services.inference.config import InferenceServiceConfig
from services.inference.http_body import OffLoopBodyRoute
from services.inference.http_config import HttpConfig
from services.inference.http_middleware import GuardMiddleware
from services.inference.http_streaming import merged, sse, until_disconnect
from services.inference.off_loop import off_loop
from services.inference.openai_generation import (
    FINISH_REASONS,
    ChoiceResult,
    Plan,
    chat_source,
    chat_template_of,
    fold,
    generate,
    plan,
    prompt_logprobs,
    render_chat,
    resolve_prompts,
    token_strings,
)
from services.inference.openai_pooling import (
    PoolingRequest,
    as_chat,
    pooling_response,
    pooling_texts_or_ids,
)
from services.inference.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    invalid,
)
from services.inference.openai_responses import (
    chat_logprobs,
    chunk_choice,
    concat,
    echo_logprobs,
    gen_logprobs,
    usage_of,
)
from services.inference.openai_structured import checked_constraint, requested_grammar
from services.inference.reward_serving import ServingRewardModel
from services.inference.serving import ServingEngine
from services.inference.tool_calls import (
    StreamSplitter,
    ToolPlan,
    call_grammar,
    parameters_of,
    parse_calls,
    tool_plan,
)

log = logging.getLogger(__name__)


def build_app(
    engine: ServingEngine | ServingRewardModel | None,
    limits: InferenceServiceConfig,
    http: HttpConfig,
    auth_token: str | None = None,
) -> FastAPI:
    """The ASGI app serving `engine` (None: every model route answers 503)."""
    app = FastAPI(title="Meshline inference (OpenAI-compatible)", docs_url=None, redoc_url=None)
    app.router.route_class = OffLoopBodyRoute  # bodies parsed off the loop shared with gRPC
    api = _Api(engine, limits, http, runtime_lora=auth_token is not None)
    app.add_middleware(GuardMiddleware, http=http, auth_token=auth_token)
    _add_error_handlers(app)
    app.get("/health")(api.health)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/tokenizer_info")(api.tokenizer_info)
    app.post("/v1/load_lora_adapter")(api.load_lora_adapter)
    app.post("/v1/unload_lora_adapter")(api.unload_lora_adapter)
    app.post("/pooling")(api.pooling)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
            for e in errors[:5]
        )
        return JSONResponse(ApiError(400, detail, param=param).body(), status_code=400)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /v1/models"
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        incident = uuid.uuid4().hex[:12]
        log.error(
            "uncaught %s in %s",
            type(exc).__name__,
            request.url.path,
            exc_info=exc,
            extra={"incident": incident},
        )
        message = f"internal error ({type(exc).__name__}); the server log has incident {incident}"
        return JSONResponse(ApiError(500, message).body(), status_code=500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


class _Api:
    """The route handlers over one engine (None: no model loaded)."""

    def __init__(
        self,
        engine: ServingEngine | ServingRewardModel | None,
        limits: InferenceServiceConfig,
        http: HttpConfig,
        runtime_lora: bool = False,
    ) -> None:
        self.engine = engine if isinstance(engine, ServingEngine) else None
        self.reward = engine if isinstance(engine, ServingRewardModel) else None
        """The served reward model (None: a causal LM or nothing)."""
        self.runtime_lora = runtime_lora
        """Whether clients may load/unload LoRA adapters (the server checks a bearer token)."""
        self.limits = limits
        self.http = http
        self.model_name = http.served_model_name or (
            engine.loaded.name if engine is not None else ""
        )
        self.created = int(time.time())

    def _require(self, model: str | None) -> ServingEngine:
        if self.reward is not None:
            raise invalid(
                "model",
                f"{self.model_name!r} is a reward model (a scalar value head): it answers POST "
                "/pooling (one reward per input), not generation; serve a causal LM for this "
                "route",
            )
        if self.engine is None:
            raise ApiError(
                503, "no model loaded; start the server with --load DIR", code="no_model"
            )
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return self.engine

    def _resolve(self, model: str | None) -> tuple[ServingEngine, str]:
        """The engine and the LoRA adapter (or "" for the base model) a request's `model` picks;
        on a LoRA server an unknown name is a 400 naming it."""
        engine = self._require(None)
        adapters = engine.engine.adapters
        if model is None or model == self.model_name or adapters is None:
            return self._require(model), ""
        if model in adapters.names():
            return engine, model
        raise ApiError(
            400,
            f"model: no model or LoRA adapter {model[:128]!r} is served here; the base model is "
            f"{self.model_name!r}, the adapters {sorted(adapters.names())}",
            param="model",
            code="model_not_found",
        )

    def _adapters(self, param: str) -> ServingEngine:
        """The engine for a load/unload call: 400 without --enable-lora, 403 without a token."""
        engine = self._require(None)
        if engine.engine.adapters is None:
            raise invalid(param, "this server serves no LoRA adapters; start it with --enable-lora")
        if not self.runtime_lora:
            raise ApiError(
                403,
                "loading and unloading LoRA adapters at run time needs an authenticated server; "
                "start it with --auth-token-file (the adapters of --lora-modules need none)",
                code="permission_denied",
            )
        return engine

    async def load_lora_adapter(self, body: LoadLoraAdapterRequest) -> PlainTextResponse:
        engine = self._adapters("lora_name")
        adapters = engine.engine.adapters
        assert adapters is not None
        if body.lora_name == self.model_name:
            raise invalid("lora_name", f"{body.lora_name!r} is the base model's name")
        if body.lora_name in adapters.names():
            raise invalid("lora_name", f"an adapter named {body.lora_name!r} is already loaded")
        try:
            path = self.limits.resolve_adapter(body.lora_path, "lora_path")
        except PermissionDenied as exc:
            raise ApiError(403, str(exc), param="lora_path", code="permission_denied") from None
        except MeshlineError as exc:
            raise invalid("lora_path", str(exc)) from None
        try:
            prepared = await off_loop(lambda: adapters.prepare(body.lora_name, path, "lora_path"))
            await engine.front.run(lambda: engine.engine.install_adapter(prepared, "lora_name"))
        except ValueError as exc:
            param = str(exc).partition(":")[0]
            raise ApiError(400, str(exc), param=param, code="invalid_value") from None
        log.info("LoRA adapter %r loaded from %s", body.lora_name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        engine = self._adapters("lora_name")
        if body.lora_int_id is not None:
            raise invalid("lora_int_id", "Meshline names adapters only; send lora_name alone")
        try:
            await engine.front.run(
                lambda: engine.engine.remove_adapter(body.lora_name, "lora_name")
            )
        except ValueError as exc:
            raise ApiError(404, str(exc), param="lora_name", code="model_not_found") from None
        log.info("LoRA adapter %r unloaded", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def health(self) -> JSONResponse:
        if self.engine is None and self.reward is None:
            return JSONResponse({"status": "no model loaded"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self) -> dict[str, Any]:
        if self.reward is not None:
            return {"object": "list", "data": [self._model_card(self.reward.max_seq_len)]}
        engine = self._require(None)
        base = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "meshline",
            "max_model_len": engine.engine.max_seq_len,
        }
        adapters = engine.engine.adapters
        names = adapters.names() if adapters is not None else {}
        parents = {m.name: m.base_model_name for m in self.limits.lora_modules}
        # vLLM's listing: each adapter as a model whose `parent` is the base it adapts.
        data = [base] + [
            {**base, "id": name, "parent": parents.get(name) or self.model_name} for name in names
        ]
        return {"object": "list", "data": data}

    def _model_card(self, max_model_len: int) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "meshline",
            "max_model_len": max_model_len,
        }

    async def pooling(self, body: PoolingRequest) -> dict[str, Any]:
        if self.reward is None:
            self._require(body.model)  # 503 without a model, 404 naming another one
            raise invalid(
                "model",
                f"{self.model_name!r} is a causal LM, not a reward model (no scalar value head): "
                "/pooling scores with a `meshline train --stage rm` checkpoint or a "
                "...ForSequenceClassification with one label (this one generates: "
                "/v1/completions)",
            )
        reward = self.reward
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        rows = await off_loop(lambda: self._pooling_rows(reward, body))
        problems = reward_problems(rows, reward.limits(self.limits))
        if problems:
            field = "messages" if body.messages is not None else "input"
            detail = "; ".join(f"{p.field.replace('inputs', field)}: {p.reason}" for p in problems)
            raise ApiError(400, detail, param=field, code="invalid_value")
        rewards = await reward.front.run(lambda: reward.scorer.score(rows))
        return pooling_response(
            self.model_name,
            int(time.time()),
            f"pool-{uuid.uuid4().hex}",
            rewards,
            [len(r) for r in rows],
        )

    def _pooling_rows(self, reward: ServingRewardModel, body: PoolingRequest) -> list[list[int]]:
        """Token ids of each input (a worker thread: tokenising and rendering take a while)."""
        if body.messages is not None:
            chat = as_chat(body)
            return [
                render_chat(reward, chat, self.http.chat_template, self.limits.max_text_chars)  # type: ignore[arg-type]
            ]
        items = pooling_texts_or_ids(body)
        if len(items) > self.limits.max_score_items:
            raise invalid(
                "input",
                f"at most {self.limits.max_score_items} inputs per request (--max-score-items), "
                f"got {len(items)}",
            )
        rows: list[list[int]] = []
        for i, item in enumerate(items):
            if isinstance(item, list):
                rows.append(item)
                continue
            if len(item) > self.limits.max_text_chars:
                raise invalid(
                    f"input[{i}]",
                    f"at most {self.limits.max_text_chars} characters (--max-text-chars), "
                    f"got {len(item)}",
                )
            if reward.tokens.tokenizer is None:
                raise invalid("input", "this server has no tokenizer; send token ids")
            rows.append(reward.tokens.encode_prompt(item, body.add_special_tokens))
        return rows

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        engine = self._require(None)
        tokens = engine.tokens
        if tokens.tokenizer is None:
            raise invalid("prompt", "this server has no tokenizer")
        ids = await off_loop(lambda: tokens.encode_prompt(body.prompt, body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_seq_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        engine = self._require(None)
        tokens = engine.tokens
        if tokens.tokenizer is None:
            raise invalid("tokens", "this server has no tokenizer")
        bad = [t for t in body.tokens if not 0 <= t < tokens.vocab_size]
        if bad:
            raise invalid("tokens", f"ids {bad[:5]} are outside [0, {tokens.vocab_size})")
        return {"prompt": await off_loop(lambda: tokens.detokenize(body.tokens, True))}

    async def tokenizer_info(self) -> dict[str, Any]:
        engine = self._require(None)
        tokens = engine.tokens
        if tokens.tokenizer is None:
            raise invalid("tokenizer", "this server has no tokenizer")
        special = {
            name: (token_strings(engine, [i])[0] if i is not None else None)
            for name, i in (
                ("eos_token", tokens.eos_id),
                ("bos_token", tokens.bos_id),
                ("pad_token", tokens.pad_id),
            )
        }
        return {
            **special,
            "chat_template": chat_template_of(engine),
            "model_max_length": engine.engine.max_seq_len,
            "vocab_size": tokens.vocab_size,
        }

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        engine, adapter = self._resolve(body.model)
        if body.suffix:
            raise invalid("suffix", "not supported")
        if adapter and body.echo and body.logprobs is not None:
            raise invalid(
                "echo", "prompt log-probabilities are scored by the base model, not a LoRA adapter"
            )
        # Tokenising runs in a worker thread, as on the gRPC front: a long prompt must not stall
        # the event loop that serves every other stream and the health probes.
        prompts = await off_loop(
            lambda: resolve_prompts(
                engine,
                body.prompt,
                self.http.max_prompts,
                self.limits.max_text_chars,
                body.add_special_tokens,
            )
        )
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise invalid("max_tokens", "0 generates nothing; set echo true to score the prompt")
        constraint = await off_loop(lambda: checked_constraint(engine, requested_grammar(body)))
        current = plan(
            body,
            max_tokens=max_tokens,
            top_k_wanted=body.logprobs,
            prompt_lengths=[len(ids) for _, ids in prompts],
            engine=engine,
            limits=self.limits,
            constraint=constraint,
        )
        current.adapter = adapter
        meta = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": adapter or self.model_name,
        }
        if body.stream:
            chunks = self._completion_chunks(engine, body, prompts, current, max_tokens, meta)
            return sse(chunks)
        return await until_disconnect(
            request, self._completion(engine, body, prompts, current, max_tokens, meta)
        )

    async def _completion(
        self,
        engine: ServingEngine,
        body: CompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        current: Plan,
        max_tokens: int,
        meta: dict[str, Any],
    ) -> dict[str, Any]:
        ids = [p for _, p in prompts]
        echoes = None
        if body.echo and current.want_logprobs:
            echoes = await prompt_logprobs(engine, ids, current.top_k)
        generated: list[list[ChoiceResult]] = [[] for _ in ids]
        if max_tokens > 0:
            generated = list(await asyncio.gather(*(generate(engine, p, current) for p in ids)))
        choices = []
        completion_tokens = 0
        for i, (text, prompt) in enumerate(prompts):
            echo_text = (
                (text if text is not None else engine.tokens.detokenize(prompt, True))
                if (body.echo and engine.tokens.tokenizer is not None)
                else ""
            )
            for j in range(current.n):
                gen = generated[i][j] if max_tokens > 0 else ChoiceResult(finish=None)
                completion_tokens += len(gen.token_ids)
                logprobs = None
                if current.want_logprobs:
                    parts = []
                    if echoes is not None:
                        parts.append(echo_logprobs(engine, echoes[i], current.top_k))
                    parts.append(
                        gen_logprobs(engine, gen, current.top_k, len(echo_text) if body.echo else 0)
                    )
                    logprobs = concat(parts)
                choices.append(
                    {
                        "index": i * current.n + j,
                        "text": echo_text + gen.text,
                        "logprobs": logprobs,
                        "finish_reason": FINISH_REASONS[gen.finish] if gen.finish else "length",
                    }
                )
        prompt_tokens = sum(len(p) for p in ids)
        return {**meta, "choices": choices, "usage": usage_of(prompt_tokens, completion_tokens)}

    async def _completion_chunks(
        self,
        engine: ServingEngine,
        body: CompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        current: Plan,
        max_tokens: int,
        meta: dict[str, Any],
    ) -> AsyncIterator[dict[str, Any]]:
        ids = [p for _, p in prompts]
        echo_lengths = [0] * len(ids)
        if body.echo:
            echoes = (
                await prompt_logprobs(engine, ids, current.top_k) if current.want_logprobs else None
            )
            for i, (text, prompt) in enumerate(prompts):
                echo_text = text if text is not None else engine.tokens.detokenize(prompt, True)
                echo_lengths[i] = len(echo_text)
                for j in range(current.n):
                    logprobs = echo_logprobs(engine, echoes[i], current.top_k) if echoes else None
                    yield {
                        **meta,
                        "choices": [chunk_choice(i * current.n + j, echo_text, logprobs)],
                    }
        completion_tokens = 0
        if max_tokens > 0:
            offsets = {(i, j): echo_lengths[i] for i in range(len(ids)) for j in range(current.n)}
            async for i, event in merged(engine, ids, current.config, current.adapter):
                completion_tokens += len(event.token_ids)
                logprobs = None
                if current.want_logprobs:
                    partial = ChoiceResult()
                    fold(partial, event)
                    logprobs = gen_logprobs(engine, partial, current.top_k, offsets[i, event.index])
                offsets[i, event.index] += len(event.text)
                choice = chunk_choice(i * current.n + event.index, event.text, logprobs)
                if event.finish is not None:
                    choice["finish_reason"] = FINISH_REASONS[event.finish]
                yield {**meta, "choices": [choice]}
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = usage_of(sum(len(p) for p in ids), completion_tokens)
            yield {**meta, "choices": [], "usage": usage}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        engine, adapter = self._resolve(body.model)
        tools, constraint = await off_loop(lambda: self._chat_constraints(engine, body))
        prompt = await off_loop(
            lambda: render_chat(
                engine, body, self.http.chat_template, self.limits.max_text_chars, tools
            )
        )
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(
                1, min(self.limits.max_new_tokens_limit, engine.engine.max_seq_len - len(prompt))
            )
        current = plan(
            body,
            max_tokens=max_tokens,
            top_k_wanted=(body.top_logprobs or 0) if body.logprobs else None,
            prompt_lengths=[len(prompt)],
            engine=engine,
            limits=self.limits,
            constraint=constraint,
        )
        current.adapter = adapter
        meta = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": adapter or self.model_name,
        }
        if body.stream:
            return sse(self._chat_chunks(engine, body, prompt, current, meta, tools))
        results = await until_disconnect(request, generate(engine, prompt, current))
        choices = []
        for j, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = FINISH_REASONS[r.finish] if r.finish else "length"
            calls = parse_calls(tools, r.text) if tools is not None else ("", [])
            if calls[1]:
                message = {
                    "role": "assistant",
                    "content": calls[0] or None,
                    "tool_calls": [c.openai() for c in calls[1]],
                }
                finish = "tool_calls" if finish == "stop" else finish
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": chat_logprobs(engine, r, current.top_k)
                    if current.want_logprobs
                    else None,
                    "finish_reason": finish,
                }
            )
        usage = usage_of(len(prompt), sum(len(r.token_ids) for r in results))
        return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}

    def _chat_constraints(
        self, engine: ServingEngine, body: ChatCompletionRequest
    ) -> tuple[ToolPlan | None, tuple[str, str] | None]:
        """The request's tool use and the grammar its answer follows (a forced tool call, or a
        structured output), each checked against the served tokenizer; 400 naming the field."""
        for i, tool in enumerate(body.tools or []):
            reason = grammar_problem(json_schema_grammar(parameters_of(tool)), None)
            if reason is not None:
                raise invalid(f"tools[{i}].function.parameters", f"not a usable schema: {reason}")
        source = chat_source(engine, self.http.chat_template)
        tools = tool_plan(body, source)
        constraint = checked_constraint(engine, requested_grammar(body))
        if tools is not None and tools.forced:
            if constraint is not None:
                raise invalid(
                    constraint[0].split(".")[0],
                    f"a forced tool_choice ({tools.choice!r}) already fixes the answer's form; "
                    "drop one of them",
                )
            constraint = checked_constraint(engine, ("tool_choice", call_grammar(tools)))
        return tools, constraint

    async def _chat_chunks(
        self,
        engine: ServingEngine,
        body: ChatCompletionRequest,
        prompt: list[int],
        current: Plan,
        meta: dict[str, Any],
        tools: ToolPlan | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        meta = {**meta, "object": "chat.completion.chunk"}
        for j in range(current.n):
            delta = {"role": "assistant", "content": ""}
            yield {**meta, "choices": [{"index": j, "delta": delta, "finish_reason": None}]}
        completion_tokens = 0
        splitters = [StreamSplitter(tools) for _ in range(current.n)] if tools else []
        async for _, event in merged(engine, [prompt], current.config, current.adapter):
            completion_tokens += len(event.token_ids)
            choice: dict[str, Any] = {
                "index": event.index,
                "delta": {"content": event.text},
                "finish_reason": FINISH_REASONS[event.finish] if event.finish else None,
            }
            if current.want_logprobs:
                partial = ChoiceResult()
                fold(partial, event)
                choice["logprobs"] = chat_logprobs(engine, partial, current.top_k)
            if splitters:
                splitter = splitters[event.index]
                choice["delta"] = {"content": splitter.feed(event.text)}
                if event.finish is not None:
                    rest, calls = splitter.finish()
                    choice["delta"] = {"content": choice["delta"]["content"] + rest}
                    if calls:
                        choice["delta"]["tool_calls"] = [c.openai(k) for k, c in enumerate(calls)]
                        if event.finish in (Finish.STOP, Finish.STOP_STRING):
                            choice["finish_reason"] = "tool_calls"
            yield {**meta, "choices": [choice]}
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {**meta, "choices": [], "usage": usage_of(len(prompt), completion_tokens)}
