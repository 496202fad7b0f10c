"""The HTTP app: OpenAI-compatible completions and chat completions, streamed as SSE."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.api import ChatCompletionRequest, CompletionRequest, check_model
from gateway.clients import (
    Backends,
    IncompatibleModels,
    ServedModel,
    check_pair,
    served_model,
    wait_for_model_info,
)
from gateway.config import GatewayConfig
from gateway.guard import Guard, add_error_handlers
from gateway.responses import chat_complete, complete
from gateway.state import Gateway
from gateway.vllm_routes import add_vllm_routes
from specserve.v1 import draft_pb2_grpc, verify_pb2_grpc
from specserve.v1.common_pb2 import ModelInfo, ModelInfoRequest

log = logging.getLogger(__name__)

UNTRACED_PATHS = ("/health", "/ping", "/metrics")


def create_app(config: GatewayConfig, tokenizer, fingerprint: str, on_fatal=None) -> FastAPI:
    """The gateway's app. It answers at once: /health says "starting" (503) and the API 503
    until the verify service has answered with a model the tokenizer (its fingerprint)
    belongs to; a draft service is waited for up to draft_startup_wait_s, then watched for.
    A pair that cannot be served is logged in one line and on_fatal() stops the server."""
    gateway = Gateway(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        backends = Backends(config.draft_address, config.verify_address, config.deadlines, config.channel_security)
        gateway.clients = backends
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
    add_error_handlers(app)
    app.add_middleware(Guard, gateway=gateway)

    _add_routes(app, gateway)
    add_vllm_routes(app, gateway)
    return app


async def _start_up(gateway: Gateway, fingerprint: str, on_fatal) -> None:
    """Waits for the verify service's model (and a draft service's, for a while), checks the
    pair, and opens the API; a pair that cannot be served stops the gateway (on_fatal)."""
    config, backends = gateway.config, gateway.clients
    security = config.channel_security
    try:
        target = await asyncio.to_thread(
            wait_for_model_info,
            config.verify_address,
            verify_pb2_grpc.VerifyServiceStub,
            config.startup_timeout_s,
            security,
            gateway.stopping,
        )
        draft = None
        if config.draft_address:
            try:
                draft = await asyncio.to_thread(
                    wait_for_model_info,
                    config.draft_address,
                    draft_pb2_grpc.DraftServiceStub,
                    config.draft_startup_wait_s,
                    security,
                    gateway.stopping,
                )
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
    gateway.metrics.model_name = served.name
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
    backends, said = gateway.clients, set()
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


def model_card(served: ServedModel) -> dict:
    return {
        "id": served.name,
        "object": "model",
        "created": 0,
        "owned_by": "specserve",
        "root": served.name,
        "parent": None,
        "max_model_len": served.max_context_length,
    }


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    """Health, metrics, the model list and the two completion endpoints."""

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (and SageMaker's) name for it
    async def health():
        """Ready (200) while a verifier replica serves; the body says which parts are up
        ("starting" until the gateway has its model)."""
        body = await gateway.clients.health()
        gateway.seen_ready |= gateway.served is not None and body["status"] == "ok"
        if not gateway.seen_ready:
            body["status"] = "starting"
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(gateway.served)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model, gateway.served)
        return model_card(gateway.served)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        return await complete(gateway, request, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http: Request):
        return await chat_complete(gateway, request, http)
