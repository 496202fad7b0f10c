"""The HTTP app: OpenAI-compatible completions and chat completions, streamed as SSE."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.api import ApiError, ChatCompletionRequest, CompletionRequest, bad_request, check_model, plan_for
from gateway.backends import Backends, ServedModel
from gateway.config import GatewayConfig
from gateway.generation import GenerationPlan, SpeculationStats, generate
from gateway.observe import RequestObserver
from gateway.text import TextAssembler
from specserve.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# Used when the tokenizer has no chat template of its own; documented in the README.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

UNTRACED_PATHS = ("/health", "/metrics")

_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


@dataclass
class Gateway:
    config: GatewayConfig
    served: ServedModel
    tokenizer: object
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    backends: Backends | None = None
    in_flight: int = 0  # requests being generated (touched only on the event loop)

    def crowded(self) -> bool:
        """Whether more requests run than speculation pays for (max_speculating_requests)."""
        limit = self.config.max_speculating_requests
        return limit > 0 and self.in_flight > limit

    def plan(self, request, prompt_token_ids: list[int]) -> GenerationPlan:
        check_model(request.model, self.served)
        return plan_for(request, prompt_token_ids, self.served, self.config)

    def completion_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        template = None if getattr(self.tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def create_app(config: GatewayConfig, served: ServedModel, tokenizer) -> FastAPI:
    gateway = Gateway(config, served, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.backends = Backends(
            config.draft_address, config.verify_address, config.deadlines, config.channel_security
        )
        yield
        await gateway.backends.close()

    # FastAPI traces each HTTP request itself (the root span of a request's trace) once a
    # tracer provider is set; health and metrics scrapes stay untraced.
    telemetry = {"exclude": lambda scope: scope.get("path") in UNTRACED_PATHS, "operation_spans": False}
    app = FastAPI(title="specserve gateway", lifespan=lifespan, telemetry=telemetry)
    app.state.gateway = gateway
    _add_error_handlers(app)
    app.add_middleware(Guard, gateway=gateway)

    @app.get("/health")
    async def health():
        if await gateway.backends.ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "specserve",
                "max_model_len": served.max_context_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        plan = gateway.plan(request, gateway.completion_prompt(request))
        return await _respond(gateway, request, plan, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        plan = gateway.plan(request, gateway.chat_prompt(request))
        return await _respond(gateway, request, plan, chat=True)

    return app


class Guard:
    """ASGI middleware: API keys on every route but /health, and a bound on the requests in
    flight (a streamed request counts until its stream ends)."""

    def __init__(self, app, gateway: Gateway):
        self.app = app
        self.gateway = gateway
        self.keys = gateway.config.api_key_set

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.keys and scope["path"] != "/health" and not self._authorised(scope):
            error = ApiError(401, "a valid API key is required: 'Authorization: Bearer KEY'", code="invalid_api_key")
            reply = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await reply(scope, receive, send)
        if not (scope["method"] == "POST" and scope["path"].startswith("/v1/")):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.gateway.config.max_body_bytes:
            error = ApiError(
                413, f"request bodies are limited to {self.gateway.config.max_body_bytes} bytes", code="too_large"
            )
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        if self.gateway.in_flight >= self.gateway.config.max_concurrent_requests:
            error = ApiError(429, "the server is at capacity; retry shortly", code="too_many_requests")
            return await JSONResponse(error.body(), status_code=429, headers={"Retry-After": "1"})(scope, receive, send)
        self.gateway.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gateway.in_flight -= 1

    def _authorised(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        return scheme.lower() == "bearer" and any(hmac.compare_digest(key, k) for k in self.keys)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(bad_request(message, ".".join(location) or None).body(), status_code=400)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def backend_error(request: Request, error: grpc.aio.AioRpcError):
        status = _GRPC_TO_HTTP.get(error.code(), 500)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        body = ApiError(status, f"backend: {error.details()}", code=error.code().name.lower()).body()
        return JSONResponse(body, status_code=status, headers=headers)


class _Response:
    """Builds OpenAI response objects for one request (completion or chat)."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = return_token_ids

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def full(self, text: str, token_ids: list[int], finish_reason: str | None, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage
        return body


def _usage(plan: GenerationPlan, assembler: TextAssembler, stats: SpeculationStats, timings: bool) -> dict:
    completion = len(assembler.token_ids)
    prompt = len(plan.prompt_token_ids)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "speculation": stats.as_dict()}  # fmt: skip
    if timings:
        usage["timings"] = stats.timings.as_dict()
    return usage


@dataclass
class _Run:
    """One request's generation: its rounds, text, counters and observer."""

    plan: GenerationPlan
    rounds: AsyncIterator[list[int]]
    assembler: TextAssembler
    stats: SpeculationStats
    observer: RequestObserver
    response: _Response
    timings: bool

    def add(self, tokens: list[int]):
        delta = self.assembler.add(tokens)
        self.observer.on_tokens(len(delta.token_ids))
        return delta

    def usage(self) -> dict:
        return _usage(self.plan, self.assembler, self.stats, self.timings)

    async def close(self, error: BaseException | None = None) -> None:
        await self.rounds.aclose()
        self.observer.finish(len(self.assembler.token_ids), self.assembler.finish_reason, error)


async def _respond(gateway: Gateway, request, plan: GenerationPlan, chat: bool):
    stats = SpeculationStats()
    observer = RequestObserver(gateway.metrics, chat, gateway.served.name, plan)
    run = _Run(
        plan=plan,
        rounds=generate(gateway.backends, plan, stats, observer.context, gateway.metrics, gateway.crowded),
        assembler=TextAssembler(
            gateway.tokenizer, gateway.served.eos_token_ids, request.stop_strings(), plan.max_tokens
        ),
        stats=stats,
        observer=observer,
        response=_Response(chat, gateway.served.name, request.return_token_ids),
        timings=request.return_timings,
    )
    try:
        first = await run.rounds.__anext__()  # a failed prefill is still an HTTP error, not an event
    except BaseException as error:
        await run.close(error)
        raise
    if request.stream:
        return StreamingResponse(_stream(run, first, request.include_usage()), media_type="text/event-stream")
    error = None
    try:
        text = run.add(first).text
        while not run.assembler.finished:
            text += run.add(await run.rounds.__anext__()).text
    except StopAsyncIteration:
        pass
    except BaseException as failure:
        error = failure
        raise
    finally:
        await run.close(error)
    return run.response.full(text, run.assembler.token_ids, run.assembler.finish_reason, run.usage())


async def _stream(run: _Run, first: list[int], include_usage: bool) -> AsyncIterator[str]:
    error = None
    try:
        tokens, is_first = first, True
        while True:
            delta = run.add(tokens)
            if delta.text or delta.finish_reason or is_first or (run.response.return_token_ids and delta.token_ids):
                yield _sse(run.response.chunk(delta.text, delta.token_ids, delta.finish_reason, first=is_first))
            is_first = False
            if run.assembler.finished:
                break
            try:
                tokens = await run.rounds.__anext__()
            except StopAsyncIteration:
                break
        if include_usage:
            yield _sse(run.response.usage_chunk(run.usage()))
    except grpc.aio.AioRpcError as failure:
        error = failure
        log.warning("stream failed: %s: %s", failure.code().name, failure.details())
        status = _GRPC_TO_HTTP.get(failure.code(), 500)
        yield _sse(ApiError(status, f"backend: {failure.details()}", code=failure.code().name.lower()).body())
    finally:
        await run.close(error)
    yield "data: [DONE]\n\n"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
