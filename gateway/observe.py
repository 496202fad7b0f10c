"""One request's span and metrics: the request span carries the GenAI semantic-convention
attributes (https://opentelemetry.io/docs/specs/semconv/gen-ai/) and parents every round."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.rounds import GenerationPlan
from specserve.serving.metrics import GatewayMetrics
from specserve.serving.telemetry import start_span


class RequestObserver:
    def __init__(self, metrics: GatewayMetrics, chat: bool, model: str, plan: GenerationPlan, request_id: str = ""):
        self.metrics = metrics
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
        self.metrics.generation_tokens.inc(output_tokens)
        self.metrics.request_success.labels(finished_reason=finish_reason or "abort").inc()
        self.metrics.e2e.observe(time.perf_counter() - self.started)
        self.metrics.requests.labels(finish_reason=finish_reason or "error").inc()
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", [finish_reason or "error"])
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()
