"""Answering a completion: the whole text at once, or streamed as server-sent events, with
usage (and, when asked, the rounds' timings); a client that leaves ends its request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway.accounting import SpeculationStats
from gateway.errors import ApiError
from gateway.generation import generate
from gateway.guard import GRPC_TO_HTTP
from gateway.observe import RequestObserver
from gateway.replicas import NoReplica
from gateway.rounds import GenerationPlan
from gateway.text import TextAssembler

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("gateway.app")


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
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
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
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculation": stats.as_dict(),
    }
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


async def respond(gateway: Gateway, request, plan: GenerationPlan, chat: bool, http: Request | None = None):
    stats = SpeculationStats()
    observer = RequestObserver(gateway.metrics, chat, gateway.served.name, plan)
    run = _Run(
        plan=plan,
        rounds=generate(gateway.clients, plan, stats, observer.context, gateway.metrics, gateway.crowded),
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
        status = GRPC_TO_HTTP.get(failure.code(), 500)
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
