"""The OpenAI-compatible HTTP API of the inference server (FastAPI), on the gRPC server's engine.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream` as server-sent events), vLLM's `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info` (lm-eval's remote tokenizer), and `GET /health` (probes; no auth).
Errors use OpenAI's JSON error object: 400 bad input, 401 missing/wrong bearer token, 404 unknown
model or route, 413 body too large, 429 too many requests in flight, 503 no model loaded; 500
only for a server bug (with an incident id in the log). A client that disconnects cancels its
generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.inference.config import InferenceServiceConfig
from services.inference.http_config import HttpConfig
from services.inference.http_middleware import GuardMiddleware
from services.inference.metrics import metered
from services.inference.openai_generation import (
    FINISH_REASONS,
    ChoiceResult,
    Plan,
    fold,
    generate,
    plan,
    prefix_offsets,
    prompt_logprobs,
    render_chat,
    resolve_prompts,
    token_strings,
)
from services.inference.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    invalid,
)
from services.inference.serving import ServingEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25


def build_app(
    engine: ServingEngine | None,
    limits: InferenceServiceConfig,
    http: HttpConfig,
    auth_token: str | None = None,
) -> FastAPI:
    """The ASGI app serving `engine` (None: every model route answers 503)."""
    app = FastAPI(title="Meshline inference (OpenAI-compatible)", docs_url=None, redoc_url=None)
    api = _Api(engine, limits, http)
    app.add_middleware(GuardMiddleware, http=http, auth_token=auth_token)
    _add_error_handlers(app)
    app.get("/health")(api.health)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/tokenizer_info")(api.tokenizer_info)
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
    def __init__(
        self, engine: ServingEngine | None, limits: InferenceServiceConfig, http: HttpConfig
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.http = http
        self.model_name = http.served_model_name or (
            engine.loaded.name if engine is not None else ""
        )
        self.created = int(time.time())

    def _require(self, model: str | None) -> ServingEngine:
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

    async def health(self) -> JSONResponse:
        if self.engine is None:
            return JSONResponse({"status": "no model loaded"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self) -> dict[str, Any]:
        engine = self._require(None)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "meshline",
                    "max_model_len": engine.engine.max_seq_len,
                }
            ],
        }

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        engine = self._require(None)
        tokens = engine.tokens
        if tokens.tokenizer is None:
            raise invalid("prompt", "this server has no tokenizer")
        ids = (
            tokens.encode_prompt(body.prompt)
            if body.add_special_tokens
            else (tokens.require().encode(body.prompt))
        )
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_seq_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        engine = self._require(None)
        tokens = engine.tokens
        if tokens.tokenizer is None:
            raise invalid("tokens", "this server has no tokenizer")
        bad = [t for t in body.tokens if not 0 <= t < tokens.vocab_size]
        if bad:
            raise invalid("tokens", f"ids {bad[:5]} are outside [0, {tokens.vocab_size})")
        return {"prompt": tokens.detokenize(body.tokens, True)}

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
        hf = getattr(tokens.tokenizer, "_tok", None)
        return {
            **special,
            "chat_template": getattr(hf, "chat_template", None),
            "model_max_length": engine.engine.max_seq_len,
            "vocab_size": tokens.vocab_size,
        }

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        engine = self._require(body.model)
        if body.suffix:
            raise invalid("suffix", "not supported")
        prompts = resolve_prompts(engine, body.prompt, self.http.max_prompts)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise invalid("max_tokens", "0 generates nothing; set echo true to score the prompt")
        current = plan(
            body,
            max_tokens=max_tokens,
            top_k_wanted=body.logprobs,
            prompt_lengths=[len(ids) for _, ids in prompts],
            engine=engine,
            limits=self.limits,
        )
        meta = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if body.stream:
            chunks = self._completion_chunks(engine, body, prompts, current, max_tokens, meta)
            return _sse(chunks)
        return await _until_disconnect(
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
                        parts.append(_echo_logprobs(engine, echoes[i], current.top_k))
                    parts.append(
                        _gen_logprobs(
                            engine, gen, current.top_k, len(echo_text) if body.echo else 0
                        )
                    )
                    logprobs = _concat(parts)
                choices.append(
                    {
                        "index": i * current.n + j,
                        "text": echo_text + gen.text,
                        "logprobs": logprobs,
                        "finish_reason": FINISH_REASONS[gen.finish] if gen.finish else "length",
                    }
                )
        prompt_tokens = sum(len(p) for p in ids)
        return {**meta, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

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
                    logprobs = _echo_logprobs(engine, echoes[i], current.top_k) if echoes else None
                    yield {
                        **meta,
                        "choices": [_chunk_choice(i * current.n + j, echo_text, logprobs)],
                    }
        completion_tokens = 0
        if max_tokens > 0:
            offsets = {(i, j): echo_lengths[i] for i in range(len(ids)) for j in range(current.n)}
            async for i, event in _merged(engine, ids, current.config):
                completion_tokens += len(event.token_ids)
                logprobs = None
                if current.want_logprobs:
                    partial = ChoiceResult()
                    fold(partial, event)
                    logprobs = _gen_logprobs(
                        engine, partial, current.top_k, offsets[i, event.index]
                    )
                offsets[i, event.index] += len(event.text)
                choice = _chunk_choice(i * current.n + event.index, event.text, logprobs)
                if event.finish is not None:
                    choice["finish_reason"] = FINISH_REASONS[event.finish]
                yield {**meta, "choices": [choice]}
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _usage(sum(len(p) for p in ids), completion_tokens)
            yield {**meta, "choices": [], "usage": usage}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        engine = self._require(body.model)
        prompt = render_chat(engine, body, self.http.chat_template)
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
        )
        meta = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if body.stream:
            return _sse(self._chat_chunks(engine, body, prompt, current, meta))
        results = await _until_disconnect(request, generate(engine, prompt, current))
        choices = [
            {
                "index": j,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": _chat_logprobs(engine, r, current.top_k)
                if current.want_logprobs
                else None,
                "finish_reason": FINISH_REASONS[r.finish] if r.finish else "length",
            }
            for j, r in enumerate(results)
        ]
        usage = _usage(len(prompt), sum(len(r.token_ids) for r in results))
        return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}

    async def _chat_chunks(
        self,
        engine: ServingEngine,
        body: ChatCompletionRequest,
        prompt: list[int],
        current: Plan,
        meta: dict[str, Any],
    ) -> AsyncIterator[dict[str, Any]]:
        meta = {**meta, "object": "chat.completion.chunk"}
        for j in range(current.n):
            delta = {"role": "assistant", "content": ""}
            yield {**meta, "choices": [{"index": j, "delta": delta, "finish_reason": None}]}
        completion_tokens = 0
        async for _, event in _merged(engine, [prompt], current.config):
            completion_tokens += len(event.token_ids)
            choice: dict[str, Any] = {
                "index": event.index,
                "delta": {"content": event.text},
                "finish_reason": FINISH_REASONS[event.finish] if event.finish else None,
            }
            if current.want_logprobs:
                partial = ChoiceResult()
                fold(partial, event)
                choice["logprobs"] = _chat_logprobs(engine, partial, current.top_k)
            yield {**meta, "choices": [choice]}
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {**meta, "choices": [], "usage": _usage(len(prompt), completion_tokens)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chunk_choice(index: int, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


def _top_dict(engine: ServingEngine, top: list[tuple[int, float]], k: int) -> dict[str, float]:
    chosen = top[:k]
    names = token_strings(engine, [t for t, _ in chosen])
    return {name: lp for name, (_, lp) in zip(names, chosen, strict=True)}


def _echo_logprobs(engine: ServingEngine, echo: ChoiceResult, k: int) -> dict[str, Any]:
    """Completion logprobs of a prompt: the first token has none (nothing precedes it)."""
    ids = echo.token_ids
    return {
        "tokens": token_strings(engine, ids),
        "token_logprobs": [None, *echo.token_logprobs][: len(ids)],
        "top_logprobs": [None, *(_top_dict(engine, t, k) for t in echo.top_logprobs)][: len(ids)],
        "text_offset": prefix_offsets(engine, ids),
    }


def _gen_logprobs(engine: ServingEngine, gen: ChoiceResult, k: int, start: int) -> dict[str, Any]:
    offsets, at = [], start
    for i in range(len(gen.token_ids)):
        offsets.append(at)
        at += len(gen.token_texts[i]) if i < len(gen.token_texts) else 0
    return {
        "tokens": token_strings(engine, gen.token_ids),
        "token_logprobs": list(gen.token_logprobs),
        "top_logprobs": [_top_dict(engine, t, k) for t in gen.top_logprobs],
        "text_offset": offsets,
    }


def _concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}


def _chat_logprobs(engine: ServingEngine, gen: ChoiceResult, k: int) -> dict[str, Any]:
    names = token_strings(engine, gen.token_ids)
    content = []
    for name, lp, top in zip(names, gen.token_logprobs, gen.top_logprobs, strict=True):
        alternatives = top[:k]
        alt_names = token_strings(engine, [t for t, _ in alternatives])
        content.append(
            {
                "token": name,
                "logprob": lp,
                "bytes": list(name.encode()),
                "top_logprobs": [
                    {"token": n, "logprob": v, "bytes": list(n.encode())}
                    for n, (_, v) in zip(alt_names, alternatives, strict=True)
                ],
            }
        )
    return {"content": content}


async def _merged(
    engine: ServingEngine, prompts: list[list[int]], config: Any
) -> AsyncIterator[tuple[int, Any]]:
    """Events of one engine request per prompt, interleaved as they come; leaving early (client
    gone) cancels every request."""
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, prompt: list[int]) -> None:
        try:
            async for event in metered(engine.front, prompt, config, "http"):
                queue.put_nowait((i, event))
        except ValueError as exc:
            queue.put_nowait(invalid("prompt", str(exc)))
        except Exception as exc:  # forwarded to the consumer, which reports it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    open_tasks = len(tasks)
    try:
        while open_tasks:
            item = await queue.get()
            if item is None:
                open_tasks -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events: one `data: <json>` per chunk, then `data: [DONE]`. An error after the
    stream started is sent as an error object (the status line is already out)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except ApiError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n".encode()
        except Exception as exc:
            incident = uuid.uuid4().hex[:12]
            log.error("stream failed", exc_info=exc, extra={"incident": incident})
            error = ApiError(500, f"internal error; the server log has incident {incident}")
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client disconnected", code="client_disconnected")
    finally:
        if not task.done():
            task.cancel()
