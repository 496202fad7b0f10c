"""One request's span and metrics: the request span carries the GenAI semantic-convention
attributes (https://opentelemetry.io/docs/specs/semconv/gen-ai/) and parents every round."""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.rounds import GenerationPlan
from specserve.serving.metrics import GatewayMetrics
from specserve.serving.telemetry import start_span


class RequestObserver:
    """One choice's observer. n: its request's n for the first choice, 0 for the others
    (vllm:request_params_n counts a request once, its other histograms each choice)."""

    def __init__(
        self, metrics: GatewayMetrics, chat: bool, model: str, plan: GenerationPlan, request_id: str = "", n: int = 1
    ):
        self.metrics = metrics
        self.n, self.prompt_length, self.max_tokens = n, len(plan.prompt_token_ids), plan.max_tokens
        self.started = time.perf_counter()
        self.last_token_at: float | None = None
        operation = "chat" if chat else "text_completion"
        self.span = start_span(
            f"{operation} {model}",
            kind=SpanKind.INTERNAL,  # under the HTTP server span FastAPI makes
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": plan.max_tokens,
                "gen_ai.request.temperature": plan.sampling.temperature,
                "gen_ai.request.top_p": plan.sampling.top_p,
                "specserve.request_id": request_id,
                "gen_ai.usage.input_tokens": len(plan.prompt_token_ids),
                "specserve.speculation.method": plan.method,
                "specserve.speculation.num_speculative_tokens": plan.num_speculative_tokens,
            },
        )
        self.context = trace.set_span_in_context(self.span)
        self.finished = False
        metrics.requests_running.inc()
        metrics.requests_waiting.inc()
        metrics.prompt_tokens.inc(len(plan.prompt_token_ids))
        self.waiting = True

    def on_tokens(self, count: int) -> None:
        """A round's tokens reached the response; latency is counted per token."""
        now = time.perf_counter()
        self._done_waiting()
        if self.last_token_at is None:
            self.metrics.ttft.observe(now - self.started)
            count -= 1
        elif count:
            for _ in range(count):
                self.metrics.itl.observe((now - self.last_token_at) / count)
        self.last_token_at = now

    def _done_waiting(self) -> None:
        if self.waiting:
            self.waiting = False
            self.metrics.requests_waiting.dec()

    def finish(
        self, output_tokens: int, finish_reason: str | None, error: BaseException | None = None, response_id: str = ""
    ) -> None:
        if self.finished:
            return
        self.span.set_attribute("gen_ai.response.id", response_id)
        self.finished = True
        self.metrics.requests_running.dec()
        self._done_waiting()
        self._observe_finished(output_tokens, finish_reason or _unfinished(error))
        self.metrics.requests.labels(finish_reason=finish_reason or "error").inc()
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason or "error"])
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()

    def _observe_finished(self, output_tokens: int, finished_reason: str) -> None:
        metrics = self.metrics
        metrics.generation_tokens.inc(output_tokens)
        metrics.request_success.labels(finished_reason=finished_reason).inc()
        metrics.e2e.observe(time.perf_counter() - self.started)
        metrics.request_prompt_tokens.observe(self.prompt_length)
        metrics.request_generation_tokens.observe(output_tokens)
        if self.max_tokens:  # as vLLM, which leaves out a request without one
            metrics.request_params_max_tokens.observe(self.max_tokens)
        if self.n:
            metrics.request_params_n.observe(self.n)


def _unfinished(error: BaseException | None) -> str:
    """vLLM's finished_reason of a request with no finish reason: "abort" where its client left
    (its generation cancelled), "error" where it failed."""
    return "error" if error is not None and not isinstance(error, (asyncio.CancelledError, GeneratorExit)) else "abort"
