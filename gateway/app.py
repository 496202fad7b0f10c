"""The HTTP app: OpenAI-compatible completions and chat completions, streamed as SSE."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from gateway.api import ApiError, ChatCompletionRequest, CompletionRequest, bad_request, check_model, plan_for
from gateway.backends import (
    Backends,
    IncompatibleModels,
    ServedModel,
    check_pair,
    served_model,
    wait_for_model_info,
)
from gateway.config import GatewayConfig
from gateway.generation import GenerationPlan, SpeculationStats, generate
from gateway.observe import RequestObserver
from gateway.replicas import NoReplica
from gateway.text import TextAssembler
from specserve.metrics import GatewayMetrics
from specserve.v1 import draft_pb2_grpc, verify_pb2_grpc
from specserve.v1.common_pb2 import ModelInfo, ModelInfoRequest

log = logging.getLogger(__name__)

# Used when the tokenizer has no chat template of its own; documented in the README.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

UNTRACED_PATHS = ("/health", "/metrics")
TOKENIZER_THREADS = 2
OPEN_PATHS = ("/health", "/metrics")  # no API key: probes and Prometheus's scrapes

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
    served: ServedModel | None  # None while starting: the verify service has not answered yet
    tokenizer: object
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    backends: Backends | None = None
    in_flight: int = 0  # requests being generated (touched only on the event loop)
    fatal: BaseException | None = None  # why the gateway could not start
    stopping: threading.Event = field(default_factory=threading.Event)
    seen_ready: bool = False  # a verifier has reported SERVING once: "unavailable", not "starting", after
    background: list = field(default_factory=list)  # its start-up and watching tasks
    tokenizer_threads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    )
    _thread_tokenizers: threading.local = field(default_factory=threading.local)

    def crowded(self) -> bool:
        """Whether more requests run than speculation pays for (max_speculating_requests)."""
        limit = self.config.max_speculating_requests
        return limit > 0 and self.in_flight > limit

    def plan(self, request, prompt_token_ids: list[int]) -> GenerationPlan:
        return plan_for(request, prompt_token_ids, self.served, self.config)

    def completion_prompt(self, request: CompletionRequest, tokenizer) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tokenizer(prompt)["input_ids"])
        return list(prompt)

    def chat_prompt(self, request: ChatCompletionRequest, tokenizer) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, chat_template=template,
                **request.template_variables(),
            )  # fmt: skip
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as error:
            raise bad_request(f"the model's chat template refused these messages: {error}", "messages") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def off_loop(self, work, request):
        """work(request, tokenizer) in the tokenizer threads, each with a tokenizer of its own
        (a fast tokenizer set to truncate or pad is not to be shared): a long prompt's
        tokenization must not hold up the event loop (other requests' rounds, health probes)."""

        def run():
            tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
            if tokenizer is None:
                tokenizer = self._thread_tokenizers.tokenizer = copy.deepcopy(self.tokenizer)
            return work(request, tokenizer)

        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_threads, run)


def create_app(config: GatewayConfig, tokenizer, fingerprint: str, on_fatal=None) -> FastAPI:
    """The gateway's app. It answers at once: /health says "starting" (503) and the API 503
    until the verify service has answered with a model the tokenizer (its fingerprint)
    belongs to; a draft service is waited for up to draft_startup_wait_s, then watched for.
    A pair that cannot be served is logged in one line and on_fatal() stops the server."""
    gateway = Gateway(config, None, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        backends = Backends(config.draft_address, config.verify_address, config.deadlines, config.channel_security)
        gateway.backends = backends
        await backends.start()
        tasks = [asyncio.ensure_future(_start_up(gateway, fingerprint, on_fatal))]
        gateway.background = tasks
        yield
        gateway.stopping.set()  # ends a start-up's wait for the services (a thread: not cancellable)
        for task in tasks:
            task.cancel()
        await backends.close()

    # FastAPI traces each HTTP request itself (the root span of a request's trace) once a
    # tracer provider is set; health and metrics scrapes stay untraced.
    telemetry = {"exclude": lambda scope: scope.get("path") in UNTRACED_PATHS, "operation_spans": False}
    app = FastAPI(title="specserve gateway", lifespan=lifespan, telemetry=telemetry)
    app.state.gateway = gateway
    _add_error_handlers(app)
    app.add_middleware(Guard, gateway=gateway)

    @app.get("/health")
    async def health():
        """Ready (200) while a verifier replica serves; the body says which parts are up
        ("starting" until the gateway has its model)."""
        body = await gateway.backends.health()
        gateway.seen_ready |= gateway.served is not None and body["status"] == "ok"
        if not gateway.seen_ready:
            body["status"] = "starting"
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        served = gateway.served
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "specserve",
                "max_model_len": served.max_context_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        check_model(request.model, gateway.served)
        prompt = await gateway.off_loop(gateway.completion_prompt, request)
        return await _respond(gateway, request, gateway.plan(request, prompt), chat=False, http=http)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http: Request):
        check_model(request.model, gateway.served)
        prompt = await gateway.off_loop(gateway.chat_prompt, request)
        return await _respond(gateway, request, gateway.plan(request, prompt), chat=True, http=http)

    return app


class Guard:
    """ASGI middleware: a request id on every answer (x-request-id), API keys on every route
    but OPEN_PATHS, request bodies bounded while they stream in (chunked ones too), a bound
    on the requests in flight (a streamed request counts until its stream ends), and the last
    resort: an unexpected error is a 500 in OpenAI's shape that names the request, logged."""

    def __init__(self, app, gateway: Gateway):
        self.app = app
        self.gateway = gateway
        self.keys = [key.encode() for key in gateway.config.api_key_set]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self._guarded(scope, receive, send_with_id)
        except Exception as error:  # noqa: BLE001 - the last resort: no request takes the gateway down
            log.exception("request %s failed unexpectedly: %s %s", request_id, scope["method"], scope["path"])
            if not started:
                internal = ApiError(500, f"internal error; request id {request_id}", code="internal_error")
                await _error_response(internal)(scope, receive, send_with_id)
            elif not isinstance(error, OSError):
                raise

    async def _guarded(self, scope, receive, send):
        if self.keys and scope["path"] not in OPEN_PATHS and not self._authorised(scope):
            error = ApiError(401, "a valid API key is required: 'Authorization: Bearer KEY'", code="invalid_api_key")
            return await _error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if self.gateway.served is None and scope["path"] not in OPEN_PATHS:
            error = ApiError(503, "the gateway is starting: its verify service has not answered yet", code="starting")
            return await _error_response(error, {"Retry-After": "2"})(scope, receive, send)
        if not (scope["method"] == "POST" and scope["path"].startswith("/v1/")):
            return await self.app(scope, receive, send)
        limit = self.gateway.config.max_body_bytes
        too_large = ApiError(413, f"request bodies are limited to {limit} bytes", code="too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _error_response(too_large)(scope, receive, send)
        if self.gateway.in_flight >= self.gateway.config.max_concurrent_requests:
            error = ApiError(429, "the server is at capacity; retry shortly", code="too_many_requests")
            return await _error_response(error, {"Retry-After": "1"})(scope, receive, send)
        self.gateway.in_flight += 1
        try:
            body = await _read_body(receive, limit)
            if body is None:
                return await _error_response(too_large)(scope, receive, send)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.gateway.in_flight -= 1

    def _authorised(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = header.partition(b" ")
        return scheme.lower() == b"bearer" and any(hmac.compare_digest(key, k) for k in self.keys)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, read as it streams in; None once it passes limit bytes (the
    rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then what the client sends next (its
    disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _start_up(gateway: Gateway, fingerprint: str, on_fatal) -> None:
    """Waits for the verify service's model (and a draft service's, for a while), checks the
    pair, and opens the API; a pair that cannot be served stops the gateway (on_fatal)."""
    config, backends = gateway.config, gateway.backends
    security = config.channel_security
    try:
        target = await asyncio.to_thread(wait_for_model_info, config.verify_address, verify_pb2_grpc.VerifyServiceStub,
                                         config.startup_timeout_s, security, gateway.stopping)  # fmt: skip
        draft = None
        if config.draft_address:
            try:
                draft = await asyncio.to_thread(wait_for_model_info, config.draft_address, draft_pb2_grpc.DraftServiceStub,
                                                config.draft_startup_wait_s, security, gateway.stopping)  # fmt: skip
            except TimeoutError as error:  # an outage of the drafts is no outage of the service
                log.warning("%s; serving target-only rounds until the draft service answers", error)
        check_pair(target, draft, fingerprint)
    except Exception as error:  # noqa: BLE001 - a pair not to be served, or anything unforeseen: the gateway stops
        if gateway.stopping.is_set():
            return
        if not isinstance(error, (IncompatibleModels, TimeoutError, ValueError)):
            log.exception("start-up failed")
        log.error("refusing to start: %s", error)
        gateway.fatal = error
        if on_fatal is not None:
            on_fatal()
        return
    served = served_model(target, draft, config.served_model_name, draft_service=bool(config.draft_address))
    backends.draft_usable = draft is not None
    gateway.served = served
    drafts = [f"{', '.join(sorted(served.local_methods)) or 'none'} in the verifier"]
    if config.draft_address:
        name = draft.model_name if draft is not None else "not answering yet"
        drafts.append(f"{', '.join(sorted(served.remote_methods))} from the draft service ({name})")
    log.info("serving %s on http://%s:%d; drafts: %s", served.name, config.host, config.port, "; ".join(drafts))
    if config.draft_address and draft is None:
        gateway.background.append(asyncio.ensure_future(_watch_draft_service(gateway, target)))


async def _watch_draft_service(gateway: Gateway, target: ModelInfo) -> None:
    """Asks the draft service's replicas for their model until one answers with the target's
    vocabulary, which starts drafting; until then its methods' rounds run target-only."""
    backends, said = gateway.backends, set()
    while True:
        for replica in list(backends.drafters.replicas.values()):
            try:
                info = await replica.stub.GetModelInfo(ModelInfoRequest(), timeout=2)
                check_pair(target, info, target.tokenizer_fingerprint)
            except IncompatibleModels as error:  # asked again: a redeployed draft may match
                if str(error) not in said:
                    log.error("%s; its methods stay target-only", error)
                    said.add(str(error))
                continue
            except Exception as error:  # noqa: BLE001 - unreachable, or its channel closed: asked again
                if not said:
                    log.info("waiting for the draft service (%s)", type(error).__name__)
                    said.add("waiting")
                continue
            gateway.served = served_model(target, info, gateway.config.served_model_name, draft_service=True)
            backends.draft_usable = True
            log.info("the draft service answers (%s): drafting", info.model_name)
            return
        await asyncio.sleep(1.0)


def _error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's shape, with its status."""
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error_response(bad_request(message, ".".join(location) or None))

    @app.exception_handler(NoReplica)
    async def no_replica(request: Request, error: NoReplica):
        return _error_response(ApiError(503, str(error), code="unavailable"), {"Retry-After": "1"})

    @app.exception_handler(grpc.aio.AioRpcError)
    async def backend_error(request: Request, error: grpc.aio.AioRpcError):
        status = _GRPC_TO_HTTP.get(error.code(), 500)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        return _error_response(ApiError(status, f"backend: {error.details()}", code=error.code().name.lower()), headers)


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


async def _respond(gateway: Gateway, request, plan: GenerationPlan, chat: bool, http: Request | None = None):
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
    if request.stream:
        try:
            first = await run.rounds.__anext__()  # a failed prefill is still an HTTP error, not an event
        except BaseException as error:
            await run.close(error)
            raise
        return StreamingResponse(_stream(run, first, request.include_usage()), media_type="text/event-stream")
    # A plain request's client may leave (a timeout): its generation stops there, and its
    # sessions are freed at once (a stream's is stopped by the response itself).
    whole = asyncio.ensure_future(_whole(run))
    gone = asyncio.ensure_future(_disconnected(http)) if http is not None else None
    try:
        await asyncio.wait([whole] + ([gone] if gone else []), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not whole.done():
            whole.cancel()
            await asyncio.wait([whole])
        if gone is not None:
            gone.cancel()
    if whole.cancelled():
        return Response(status_code=499)  # nobody reads it
    text = whole.result()
    return run.response.full(text, run.assembler.token_ids, run.assembler.finish_reason, run.usage())


async def _whole(run: _Run) -> str:
    """All of a plain request's text; its sessions are closed however it ends."""
    error, text = None, ""
    try:
        tokens = await run.rounds.__anext__()
        text = run.add(tokens).text
        while not run.assembler.finished:
            text += run.add(await run.rounds.__anext__()).text
    except StopAsyncIteration:
        pass
    except BaseException as failure:
        error = failure
        raise
    finally:
        await run.close(error)
    return text


async def _disconnected(http: Request) -> None:
    """Returns once the client has gone away."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


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
    except NoReplica as failure:
        error = failure
        yield _sse(ApiError(503, str(failure), code="unavailable").body())
    except Exception as failure:  # noqa: BLE001 - the stream ends in an error event, not a dropped connection
        error = failure
        log.exception("stream failed unexpectedly")
        yield _sse(ApiError(500, "internal error", code="internal_error").body())
    finally:
        await run.close(error)
    yield "data: [DONE]\n\n"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
