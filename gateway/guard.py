"""The HTTP boundary of the gateway: every request gets an id and, where a key is set, must
bring it; bodies are read up to the limit; and every failure is answered as an OpenAI error
object with the status it means (docs/design.md, "Failures"), never an unanswered 500."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.errors import ApiError, bad_request
from gateway.replicas import NoReplica
from gateway.state import Gateway

log = logging.getLogger("gateway.app")
access = logging.getLogger("gateway.access")

OPEN_PATHS = ("/health", "/ping", "/metrics")  # no API key: probes and Prometheus's scrapes
BOUNDED_PATHS = ("/tokenize", "/detokenize", "/invocations")  # bodies bounded, as the API's

GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


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
        request_id = _request_id(dict(scope["headers"]).get(b"x-request-id"))
        scope.setdefault("state", {})["request_id"] = request_id
        started, status, since = False, 0, time.perf_counter()

        async def send_with_id(message):
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            try:
                await self._guarded(scope, receive, send_with_id)
            finally:
                if scope["path"] not in OPEN_PATHS:  # an access log line per request (probes and scrapes aside)
                    client = (scope.get("client") or ("-", 0))[0]
                    access.info(
                        '%s "%s %s" %d %.3fs request_id=%s',
                        client,
                        scope["method"],
                        scope["path"],
                        status or 500,
                        time.perf_counter() - since,
                        request_id,
                    )
        except Exception as error:  # noqa: BLE001 - the last resort: no request takes the gateway down
            log.exception("request %s failed unexpectedly: %s %s", request_id, scope["method"], scope["path"])
            if not started:
                internal = ApiError(500, f"internal error; request id {request_id}", code="internal_error")
                await error_response(internal)(scope, receive, send_with_id)
            elif not isinstance(error, OSError):
                raise

    async def _guarded(self, scope, receive, send):
        if self.keys and scope["path"] not in OPEN_PATHS and not self._authorised(scope):
            error = ApiError(401, "a valid API key is required: 'Authorization: Bearer KEY'", code="invalid_api_key")
            return await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if self.gateway.served is None and scope["path"] not in OPEN_PATHS:
            error = ApiError(503, "the gateway is starting: its verify service has not answered yet", code="starting")
            return await error_response(error, {"Retry-After": "2"})(scope, receive, send)
        if not (scope["method"] == "POST" and (scope["path"].startswith("/v1/") or scope["path"] in BOUNDED_PATHS)):
            return await self.app(scope, receive, send)
        limit = self.gateway.config.max_body_bytes
        too_large = ApiError(413, f"request bodies are limited to {limit} bytes", code="too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await error_response(too_large)(scope, receive, send)
        if self.gateway.in_flight >= self.gateway.config.max_concurrent_requests:
            error = ApiError(429, "the server is at capacity; retry shortly", code="too_many_requests")
            return await error_response(error, {"Retry-After": "1"})(scope, receive, send)
        self.gateway.in_flight += 1
        try:
            body = await _read_body(receive, limit)
            if body is None:
                return await error_response(too_large)(scope, receive, send)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.gateway.in_flight -= 1

    def _authorised(self, scope) -> bool:
        """Whether the request bears a valid key; its tenant (what method suffix may share
        across requests) is then a hash of the key."""
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = header.partition(b" ")
        valid = scheme.lower() == b"bearer" and any(hmac.compare_digest(key, k) for k in self.keys)
        if valid:
            scope["state"]["tenant"] = hashlib.sha256(key).hexdigest()[:32]
        return valid


_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")


def _request_id(sent: bytes | None) -> str:
    """The client's X-Request-Id where it sent a plausible one (printable, at most 128
    characters), else a new one."""
    return sent.decode() if sent is not None and _REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex


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


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's shape, with its status."""
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        kind = f" [type={first['type']}]" if first.get("type") else ""  # pydantic's, as vLLM answers it
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}{kind}"
        return error_response(bad_request(message, ".".join(location) or None))

    @app.exception_handler(NoReplica)
    async def no_replica(request: Request, error: NoReplica):
        return error_response(ApiError(503, str(error), code="unavailable"), {"Retry-After": "1"})

    @app.exception_handler(grpc.aio.AioRpcError)
    async def backend_error(request: Request, error: grpc.aio.AioRpcError):
        status = GRPC_TO_HTTP.get(error.code(), 500)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        return error_response(ApiError(status, f"backend: {error.details()}", code=error.code().name.lower()), headers)
