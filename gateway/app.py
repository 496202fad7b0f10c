"""The HTTP app: OpenAI-compatible completions and chat completions, streamed as SSE."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.api import ApiError, ChatCompletionRequest, CompletionRequest, bad_request, check_model, plan_for
from gateway.backends import Backends, ServedModel
from gateway.config import GatewayConfig
from gateway.generation import GenerationPlan, SpeculationStats, generate
from gateway.text import TextAssembler

log = logging.getLogger(__name__)

# Used when the tokenizer has no chat template of its own; documented in the README.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

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
    backends: Backends | None = None

    def plan(self, request, prompt_token_ids: list[int]) -> GenerationPlan:
        check_model(request.model, self.served)
        return plan_for(request, prompt_token_ids, self.served, self.config.method, self.config.num_speculative_tokens)

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
        gateway.backends = Backends(config.draft_address, config.verify_address, config.rpc_timeout_s)
        yield
        await gateway.backends.close()

    app = FastAPI(title="specserve gateway", lifespan=lifespan)
    app.state.gateway = gateway
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        if await gateway.backends.ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

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
        return JSONResponse(
            ApiError(status, f"backend: {error.details()}", code=error.code().name.lower()).body(), status_code=status
        )


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


async def _respond(gateway: Gateway, request, plan: GenerationPlan, chat: bool):
    stops = request.stop_strings()
    assembler = TextAssembler(gateway.tokenizer, gateway.served.eos_token_ids, stops, plan.max_tokens)
    stats = SpeculationStats()
    rounds = generate(gateway.backends, plan, stats)
    response = _Response(chat, gateway.served.name, request.return_token_ids)
    try:
        first = await rounds.__anext__()  # a failed prefill is still an HTTP error, not an event
    except BaseException:
        await rounds.aclose()
        raise
    if request.stream:
        events = _stream(rounds, first, assembler, response, plan, stats, request)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        text, delta = "", assembler.add(first)
        text += delta.text
        while not assembler.finished:
            text += assembler.add(await rounds.__anext__()).text
    except StopAsyncIteration:
        pass
    finally:
        await rounds.aclose()
    return response.full(
        text, assembler.token_ids, assembler.finish_reason, _usage(plan, assembler, stats, request.return_timings)
    )


async def _stream(
    rounds: AsyncIterator[list[int]],
    first: list[int],
    assembler: TextAssembler,
    response: _Response,
    plan: GenerationPlan,
    stats: SpeculationStats,
    request,
) -> AsyncIterator[str]:
    try:
        tokens, is_first = first, True
        while True:
            delta = assembler.add(tokens)
            if delta.text or delta.finish_reason or is_first or (response.return_token_ids and delta.token_ids):
                yield _sse(response.chunk(delta.text, delta.token_ids, delta.finish_reason, first=is_first))
            is_first = False
            if assembler.finished:
                break
            try:
                tokens = await rounds.__anext__()
            except StopAsyncIteration:
                break
        if request.include_usage():
            yield _sse(response.usage_chunk(_usage(plan, assembler, stats, request.return_timings)))
    except grpc.aio.AioRpcError as error:
        log.warning("stream failed: %s: %s", error.code().name, error.details())
        status = _GRPC_TO_HTTP.get(error.code(), 500)
        yield _sse(ApiError(status, f"backend: {error.details()}", code=error.code().name.lower()).body())
    finally:
        await rounds.aclose()
    yield "data: [DONE]\n\n"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
