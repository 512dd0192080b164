"""The FastAPI app: OpenAI routes, auth, limits, health and metrics over one engine worker.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], GET
/health, GET /metrics. Every failure answers OpenAI-style JSON
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (checked here and
in serving/server/schema.py, before any engine work), 401 without the API key, 404 for an
unknown model or route, 413 for an oversized body, 503 (with Retry-After) when the
admission queue is full, the model is still loading or the server is shutting down, 504
past the request timeout. The model loads in a background thread after the server starts
listening, so /health can say 503 "loading" meanwhile.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specheads.serving.decode.scheduler import SequenceRequest
from specheads.serving.server.json_body import parse_json_body
from specheads.serving.server.schema import APIError, ChatCompletionRequest, CompletionRequest, validate_request
from specheads.serving.decode.sampling import MAX_SEED, SamplingParams
from specheads.serving.server.state import ServerState
from specheads.serving.server.worker import Choice, EngineUnavailable, Event, Job, QueueFull
from specheads.serving.server.responses import ChunkWriter, Collector, ResponseMeta, sse

log = logging.getLogger("specheads.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: valid JSON whatever text a client sent and
    an error echoes (a lone surrogate cannot be encoded as UTF-8, but escapes as \\udXXX)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_response(err: APIError) -> JSONResponse:
    return AsciiJSONResponse(err.body(), status_code=err.status, headers=err.headers)


class GuardMiddleware:
    """Auth (constant-time bearer check), draining and the Content-Length limit, before routing."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        config = state.config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None
        self.public = {"/health"} | ({"/metrics"} if config.public_metrics else set())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        error = None
        if self.expected is not None and path not in self.public:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
        if error is None and self.state.draining and path not in ("/health", "/metrics"):
            error = APIError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                             code="shutting_down", headers={"Retry-After": str(self.state.config.retry_after_s)})
        length = headers.get(b"content-length")
        if error is None and length is not None:
            limit = self.state.config.max_body_bytes
            if not length.isdigit():
                error = APIError(400, f"Content-Length must be a non-negative integer, got {length.decode()!r}")
            elif int(length) > limit:
                error = APIError(413, f"the request body is {int(length)} bytes; the limit is {limit}",
                                 code="request_too_large")
        if error is not None:
            self.state.metrics.rejected.labels(status=error.status).inc()
            return await _error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
    except ClientDisconnect as err:  # nobody reads the answer; counted once, as a 499 rejection
        raise APIError(499, "the client disconnected while its request was being read",
                       code="disconnected") from err
    return bytes(body)


def _tokenize_prompts(state: ServerState, req) -> list[list[int]]:
    tokenizer = state.tokenizer
    if isinstance(req, ChatCompletionRequest):
        if req.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions, send chat_template, "
                                "or start the server with --chat-template FILE", param="messages",
                           code="no_chat_template")
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        template = {} if req.chat_template is None else {"chat_template": req.chat_template}
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message, tokenize=False,
                                                 **template, **(req.chat_template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - template errors are the request's fault (roles, order)
            param = "chat_template" if req.chat_template is not None else "messages"
            raise APIError(400, f"the chat template rejected these messages: {err}", param=param) from err
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, "the messages are empty after applying the chat template", param="messages")
        return [ids]
    prompts = []
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise APIError(400, f"prompt {i} is empty after tokenization", param="prompt")
        else:
            bad = [t for t in prompt if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(400, f"prompt {i} has token ids outside [0, {state.vocab_size}): {bad[:5]}",
                               param="prompt")
            ids = list(prompt)
        prompts.append(ids)
    return prompts


def _max_tokens(state: ServerState, req, prompt_len: int) -> int:
    limit = state.max_model_len
    if req.max_tokens is not None:
        if prompt_len + req.max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the prompt, "
                                f"{req.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return req.max_tokens
    room = limit - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, the prompt has "
                            f"{prompt_len} tokens, leaving no room for a completion.", param="prompt",
                       code="context_length_exceeded")
    return room if isinstance(req, ChatCompletionRequest) else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)


def _num_logprobs(req) -> int | None:
    """The top tokens to report per position, None for no logprobs (chat: `logprobs` turns
    them on, `top_logprobs` counts; completions: `logprobs` counts)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _echo_text(state: ServerState, req, index: int, ids: list[int]) -> str | None:
    """Completions' `echo`: the prompt as sent, or a token-id prompt's decoded text."""
    if isinstance(req, ChatCompletionRequest) or not req.echo:
        return None
    prompt = req.prompts[index]
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(ids, skip_special_tokens=True)


def _sampling_fields(state: ServerState, req) -> tuple[float, float, int]:
    """(temperature, top_p, top_k): the request's, else the target's generation_config defaults
    (state.default_sampling), else 1, 1 and off, as vLLM fills them."""
    defaults = state.default_sampling
    temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
    top_p = req.top_p if req.top_p is not None else defaults.get("top_p", 1.0)
    top_k = req.top_k if req.top_k is not None else defaults.get("top_k", 0)
    return float(temperature), float(top_p), int(top_k)


def _build_choices(state: ServerState, req, prompts: list[list[int]]) -> list[Choice]:
    eos = None if req.ignore_eos else state.eos_token_id
    num_logprobs = _num_logprobs(req)
    temperature, top_p, top_k = _sampling_fields(state, req)
    choices = []
    for p, ids in enumerate(prompts):
        max_new = _max_tokens(state, req, len(ids))
        echo = _echo_text(state, req, p, ids)
        for j in range(req.n):
            index = p * req.n + j
            sampling = None
            if temperature > 0:
                seed = None if req.seed is None else (req.seed + index) % (MAX_SEED + 1)
                sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
            request = SequenceRequest(input_ids=list(ids), max_new_tokens=max_new, eos_token_id=eos,
                                      sampling=sampling, speculate=req.speculate, logprobs=num_logprobs,
                                      prompt_logprobs=echo is not None and num_logprobs is not None)
            choices.append(Choice(index=index, request=request, stop=req.stop_strings, echo=echo))
    return choices


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel("disconnect")
            job.events.put_nowait(Event("error", status=499, message="client disconnected", code="disconnected"))
            return


async def _next_event(job: Job) -> Event:
    timeout = None if job.deadline is None else max(0.0, job.deadline - time.monotonic()) + 2.0
    try:
        return await asyncio.wait_for(job.events.get(), timeout)
    except asyncio.TimeoutError:  # the worker is stuck in a long step: answer anyway
        job.cancel("timeout")
        return Event("error", status=504, message="the request did not finish within the server's request timeout",
                     code="timeout")


def _unknown_model(asked: str, served: str) -> APIError:
    return APIError(404, f"The model `{asked}` does not exist; this server serves `{served}`.", "not_found_error",
                    param="model", code="model_not_found")


def _event_error(event: Event) -> APIError:
    """An error the worker (or the disconnect watcher) reported; the worker counted it already."""
    err_type = {400: "invalid_request_error", 503: "service_unavailable", 504: "timeout_error"}.get(event.status,
                                                                                                   "server_error")
    return APIError(event.status, event.message, err_type, code=event.code, rejected=False)


async def _handle(state: ServerState, request: Request, chat: bool):
    config = state.config
    raw = await _read_body(request, config.max_body_bytes)
    req = validate_request(ChatCompletionRequest if chat else CompletionRequest, parse_json_body(raw))
    if req.model != config.model_name:
        raise _unknown_model(req.model, config.model_name)
    if state.status != "ready" or state.engine is None:
        raise APIError(503, f"the model is not ready ({state.status}); retry shortly", "service_unavailable",
                       code="model_loading", headers={"Retry-After": str(config.retry_after_s)})
    prompts = _tokenize_prompts(state, req)
    choices = _build_choices(state, req, prompts)
    meta = ResponseMeta(chat=chat, model=config.model_name, num_choices=len(choices),
                        prompt_tokens=sum(len(p) for p in prompts), include_usage=req.include_usage,
                        logprobs=_num_logprobs(req) is not None, reasoning_parser=config.reasoning_parser)
    job = Job(choices, asyncio.get_running_loop(), config.request_timeout_s)
    if state.cut_off:  # it got past the middleware before the shutdown and its grace period ended
        raise APIError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                       code="shutting_down", headers={"Retry-After": str(config.retry_after_s)})
    try:
        state.engine.submit(job)
    except QueueFull as err:
        raise APIError(503, f"{err}; retry after {config.retry_after_s}s", "service_unavailable",
                       code="server_overloaded", headers={"Retry-After": str(config.retry_after_s)}) from err
    except EngineUnavailable as err:
        raise APIError(503, str(err), "service_unavailable", code="engine_unavailable",
                       headers={"Retry-After": str(config.retry_after_s)}) from err
    state.jobs.add(job)
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        first = await _next_event(job)  # streamed or not, errors before any output are plain JSON errors
        if first.kind == "error":
            raise _event_error(first)
        if not req.stream:
            collector = Collector(meta)
            event = first
            while True:
                if event.kind == "error":
                    raise _event_error(event)
                collector.add(event)
                if collector.complete:
                    return JSONResponse(collector.body())
                event = await _next_event(job)
    except BaseException:
        job.cancel("disconnect")
        state.jobs.discard(job)
        raise
    finally:
        watcher.cancel()
        if not req.stream:
            state.jobs.discard(job)
    return StreamingResponse(_stream(state, job, meta, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _stream(state: ServerState, job: Job, meta: ResponseMeta, first: Event):
    writer = ChunkWriter(meta)
    try:
        for line in writer.start():
            yield line
        event = first
        while True:
            if event.kind == "error":
                yield sse(_event_error(event).body())  # vLLM's convention for a failure mid-stream
                yield sse("[DONE]")
                return
            for line in writer.event(event):
                yield line
            if writer.collector.complete:
                for line in writer.end():
                    yield line
                return
            event = await _next_event(job)
    finally:
        job.cancel("disconnect")  # a no-op once the job is done
        state.jobs.discard(job)


def create_app(state: ServerState) -> FastAPI:
    """The app over `state`; the model loads when the app starts (lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="specheads-load", daemon=True).start()
        yield
        state.draining = True
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="specheads", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specheads = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        if err.rejected:
            state.metrics.rejected.labels(status=err.status).inc()
        return _error_response(err)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception):
        # A bug of ours: still an OpenAI-style JSON body, and counted (Starlette logs the traceback).
        state.metrics.rejected.labels(status=500).inc()
        return _error_response(APIError(500, f"internal server error ({type(err).__name__})", "server_error",
                                        code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        err_type = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
        return _error_response(APIError(err.status_code, message, err_type, code=str(err.status_code)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(state, request, chat=True)

    def model_card() -> dict:
        return {"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "specheads",
                "root": state.config.model_root or state.config.model_name, "max_model_len": state.max_model_len or None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.config.model_name:
            raise _unknown_model(model_id, state.config.model_name)
        return model_card()

    @app.get("/health")
    async def health():
        if state.healthy:
            return {"status": "ok"}
        status = "draining" if state.draining else state.status
        if state.status == "ready" and state.engine is not None and state.engine.fatal_error:
            status, error = "failed", state.engine.fatal_error
        else:
            error = state.error
        return AsciiJSONResponse({"status": status, "error": error}, status_code=503,
                            headers={"Retry-After": str(state.config.retry_after_s)})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return GuardMiddleware(app, state)
