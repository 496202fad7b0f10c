"""Answering a completion: the whole text at once, or streamed as server-sent events, with
usage (and, when asked, the rounds' timings); a client that leaves ends its request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway.accounting import SpeculationStats
from gateway.api import check_model, check_unsupported
from gateway.errors import ApiError, bad_request
from gateway.generation import generate
from gateway.guard import GRPC_TO_HTTP
from gateway.logprobs import ChoiceOutputs
from gateway.observe import RequestObserver
from gateway.prompts import MAX_PROMPTS, chat_prompt, completion_prompts
from gateway.replicas import NoReplica
from gateway.rounds import GenerationPlan
from gateway.state import Gateway
from gateway.text import TextAssembler

log = logging.getLogger("gateway.app")


class _Response:
    """Builds OpenAI response objects for one request (completion or chat)."""

    def __init__(self, chat: bool, model: str, request, request_id: str = ""):
        self.chat = chat
        self.request_id = request_id  # the guard's x-request-id
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = request.return_token_ids
        self.n = request.n or 1  # choices per prompt
        self.role = request.response_role() if chat else ""
        self.speculation_usage = request.speculation_usage()
        self.continuous_usage = request.stream and request.continuous_usage()

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        body = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.chat:  # vLLM's chat answers carry the prompt's ids and logprobs beside the choices
            body["service_tier"] = None
            for choice in choices:
                for key in ("prompt_token_ids", "prompt_logprobs"):
                    if key in choice:
                        body[key] = choice.pop(key)
        return body

    def chunk(self, index: int, delta, first: bool, extra: dict, stop_reason) -> dict:
        """A stream's chunk of choice index (delta: its TextDelta, the text echo's too);
        extra: its logprobs (and prompt_logprobs, prompt_token_ids), where asked."""
        text, finish_reason = delta.text, delta.finish_reason
        if self.chat:
            message = {"role": self.role, "content": text} if first else {"content": text}
            choice = {"index": index, "delta": message, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choice["stop_reason"] = stop_reason if finish_reason else None
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        choice.update(extra)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def choice(self, index: int, text: str, assembler, extra: dict) -> dict:
        finish_reason = assembler.finish_reason
        if self.chat:
            message = {
                "role": self.role,
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
            }
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choice["stop_reason"] = assembler.stop_reason
        if self.return_token_ids:
            choice["token_ids"] = assembler.token_ids
        choice["prompt_logprobs"] = None  # vLLM's, always there: null unless asked
        choice.update(extra)
        return choice

    def full(self, choices: list[dict], usage: dict) -> dict:
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage
        return body


def _usage(runs: list[_Run]) -> dict:
    """The request's usage: each prompt once, every choice's tokens (the choices share one
    SpeculationStats)."""
    completion = sum(len(run.assembler.token_ids) for run in runs)
    prompt = sum(len(run.plan.prompt_token_ids) for run in runs if run.index % run.response.n == 0)
    stats = runs[0].stats
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if runs[0].response.speculation_usage:
        usage["speculation"] = stats.as_dict()
    if runs[0].timings:
        usage["timings"] = stats.timings.as_dict()
    return usage


@dataclass
class _Run:
    """One choice's generation: its rounds, text, counters and observer."""

    index: int
    plan: GenerationPlan
    rounds: AsyncIterator[list[int]]
    assembler: TextAssembler
    stats: SpeculationStats
    observer: RequestObserver
    response: _Response
    timings: bool
    outputs: ChoiceOutputs

    def add_round(self, tokens: list[int]) -> list:
        """A round's tokens one by one, as a stream sends them, up to the one that ends the
        choice (a plain answer takes what a stream would): their TextDeltas (one for a round
        of none). The round is observed once: its time spreads over its tokens."""
        deltas = []
        for piece in [[token] for token in tokens] or [[]]:
            deltas.append(self.assembler.add(piece))
            if self.assembler.finished:
                break
        self.observer.on_tokens(sum(len(delta.token_ids) for delta in deltas))
        return deltas

    def choice(self, text: str) -> dict:
        extra = self.outputs.extra(self.assembler.token_ids, first=True)
        text = self.outputs.echoed(text)
        return self.response.choice(self.index, text, self.assembler, extra)

    async def close(self, error: BaseException | None = None) -> None:
        await self.rounds.aclose()
        self.observer.finish(len(self.assembler.token_ids), self.assembler.finish_reason, error, self.response.id)


def choice_plan(plan: GenerationPlan, index: int) -> GenerationPlan:
    """Choice index's plan: choice i draws with the request's seed + i, so each choice of a
    seeded request reproduces, and the choices differ."""
    if index == 0:
        return plan
    return dataclasses.replace(
        plan, sampling=dataclasses.replace(plan.sampling, seed=(plan.sampling.seed + index) % 2**64)
    )


async def respond(
    gateway: Gateway, request, plans: list[GenerationPlan], chat: bool, http: Request | None = None, texts=()
):
    """The answer to a completion of request.n choices of each of plans' prompts (each choice
    its own rounds, all at once; choice index prompt * n + j, as vLLM numbers them); texts:
    each prompt's text, for echo."""
    stats = SpeculationStats()
    request_id = http.scope["state"].get("request_id", "") if http is not None else ""
    response = _Response(chat, gateway.served.name, request, request_id)
    runs, n = [], response.n
    for number, plan in enumerate(plans):
        # A prompt's sampled choices share its prefill: the first prefills, the others copy its
        # cache (greedy choices are all one, each from a prefill of its own: the leader's).
        copies = n > 1 and plan.prompt_logprobs is None and not plan.sampling.is_greedy
        shared = asyncio.get_running_loop().create_future() if copies else None
        for j in range(n):
            text = texts[number] if texts else None
            runs.append(
                _start_run(
                    gateway,
                    request,
                    response=response,
                    stats=stats,
                    plan=plan,
                    index=number * n + j,
                    j=j,
                    shared=shared,
                    text=text,
                )
            )
    if request.stream:
        firsts = []
        try:
            for run in runs:  # a failed prefill is still an HTTP error, not an event
                firsts.append(await anext(run.rounds, []))  # []: max_tokens 0, nothing made
        except BaseException as error:
            for run in runs:
                await run.close(error)
            raise
        return StreamingResponse(_stream(runs, firsts, request.include_usage()), media_type="text/event-stream")
    texts = await _all_texts(runs, http)
    if texts is None:
        return Response(status_code=499)  # nobody reads it
    choices = [run.choice(text) for run, text in zip(runs, texts)]
    return response.full(choices, _usage(runs))


def _start_run(
    gateway: Gateway,
    request,
    response: _Response,
    stats: SpeculationStats,
    plan: GenerationPlan,
    index: int,
    j: int,
    shared: asyncio.Future | None,
    text: str | None,
) -> _Run:
    """Choice j of a prompt's plan (index: its place in the answer): its rounds begun, and
    the assembler that turns them into text."""
    choice = choice_plan(plan, j)
    first = response.n if j == 0 else 0
    observer = RequestObserver(gateway.metrics, response.chat, gateway.served.name, choice, response.request_id, first)
    outputs = ChoiceOutputs(gateway.tokenizer, request, choice, response.chat, text)
    rounds = generate(
        gateway.clients,
        choice,
        stats,
        parent=observer.context,
        metrics=gateway.metrics,
        crowded=gateway.crowded,
        logprobs=outputs.logprobs,
        prefilled=shared,
        leads=j == 0,
    )
    processing = plan.sampling.processing
    ends = frozenset() if plan.sampling.ignore_eos else gateway.served.eos_token_ids
    assembler = TextAssembler(
        gateway.tokenizer,
        ends | frozenset(processing.stop_token_ids),
        request.stop_strings(),
        plan.max_tokens,
        include_stop=bool(request.include_stop_str_in_output),
        min_tokens=processing.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        stop_token_ids=frozenset(processing.stop_token_ids),
    )
    if plan.max_tokens == 0:
        assembler.finish_reason = "length"  # the prompt's logprobs only
    return _Run(
        index,
        choice,
        rounds=rounds,
        assembler=assembler,
        stats=stats,
        observer=observer,
        response=response,
        timings=request.return_timings,
        outputs=outputs,
    )


async def _all_texts(runs: list[_Run], http: Request | None) -> list[str] | None:
    """Every choice's whole text; None where the client left first. A plain request's client
    may leave (a timeout): its generation stops there, and its sessions are freed at once (a
    stream's is stopped by the response itself); a choice that fails stops the others."""
    wholes = [asyncio.ensure_future(_whole(run)) for run in runs]
    gone = asyncio.ensure_future(_disconnected(http)) if http is not None else None
    try:
        everything = asyncio.gather(*wholes)
        await asyncio.wait([everything] + ([gone] if gone else []), return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed = everything.done() and not everything.cancelled() and everything.exception() is not None
        if not everything.done() or failed:  # the client gone, or a choice failed: all stop
            for whole in wholes:
                whole.cancel()
            await asyncio.wait(wholes)
        if gone is not None:
            gone.cancel()
    if failed:
        raise everything.exception()
    if any(whole.cancelled() for whole in wholes):
        return None
    return [whole.result() for whole in wholes]


async def _whole(run: _Run) -> str:
    """All of a plain request's text; its sessions are closed however it ends."""
    error, text = None, ""
    try:
        text = "".join(delta.text for delta in run.add_round(await run.rounds.__anext__()))  # the prefill's too
        while not run.assembler.finished:
            text += "".join(delta.text for delta in run.add_round(await run.rounds.__anext__()))
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


async def _chunks(run: _Run, first: list[int], out: asyncio.Queue) -> None:
    """One choice's chunks into out, a token each (as a server without speculation sends
    them: clients count chunks as tokens), then None; its failure in their place."""
    tokens, is_first = first, True
    try:
        while True:
            upto = len(run.assembler.token_ids)
            for delta in run.add_round(tokens):
                upto += len(delta.token_ids)  # the choice's tokens up to this chunk's
                if delta.text or delta.finish_reason or is_first or (run.response.return_token_ids and delta.token_ids):
                    await out.put(_chunk(run, delta, is_first, upto))
                is_first = False
            if run.assembler.finished:
                break
            try:
                tokens = await run.rounds.__anext__()
            except StopAsyncIteration:
                break
        await out.put(None)
    except Exception as failure:  # noqa: BLE001 - the stream ends in an error event
        await out.put(failure)


def _chunk(run: _Run, delta, first: bool, upto: int) -> dict:
    """The chunk of delta, the choice's tokens up to upto (its logprobs are those since the
    chunk before; with continuous usage, its counts so far)."""
    extra = run.outputs.extra(run.assembler.token_ids[:upto], first=first)
    if first:
        delta.text = run.outputs.echoed(delta.text)
    chunk = run.response.chunk(run.index, delta, first, extra, run.assembler.stop_reason)
    if run.response.continuous_usage:  # vLLM's: the choice's counts so far
        prompt = len(run.plan.prompt_token_ids)
        chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": upto, "total_tokens": prompt + upto}
    return chunk


async def _stream(runs: list[_Run], firsts: list[list[int]], include_usage: bool) -> AsyncIterator[str]:
    """Every choice's chunks as they come, then the usage (asked) and [DONE]."""
    error = None
    out: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_chunks(run, first, out)) for run, first in zip(runs, firsts)]
    try:
        left = len(runs)
        while left:
            item = await out.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield _sse(item)
        if include_usage:
            yield _sse(runs[0].response.usage_chunk(_usage(runs)))
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
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in runs:
            await run.close(error)
    yield "data: [DONE]\n\n"


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def complete(gateway: Gateway, request, http: Request):
    """A completion request's answer: each of its prompts' n choices."""
    check_model(request.model, gateway.served)
    prompts, texts = await gateway.off_loop(completion_prompts, request)
    if len(prompts) * (request.n or 1) > MAX_PROMPTS:  # each choice holds a verifier session
        raise bad_request(f"prompts times n is at most {MAX_PROMPTS} per request", "n")
    grammar = await gateway.off_loop(gateway.grammar, request)
    plans = [gateway.plan(request, prompt, http.scope["state"].get("tenant", ""), grammar) for prompt in prompts]
    return await respond(gateway, request, plans, chat=False, http=http, texts=texts)


async def chat_complete(gateway: Gateway, request, http: Request):
    """A chat completion request's answer."""
    check_model(request.model, gateway.served)
    check_unsupported(request)  # before the template renders the messages
    prompt = await gateway.off_loop(chat_prompt, request)
    grammar = await gateway.off_loop(gateway.grammar, request)
    plan = gateway.plan(request, prompt, http.scope["state"].get("tenant", ""), grammar)
    return await respond(gateway, request, [plan], chat=True, http=http)
