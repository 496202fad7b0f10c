"""gRPC servicer of the verify service: message -> job -> batcher -> message."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from specserve.grammar import Grammar, Grammars, GrammarState
from specserve.model.loading import LoadedModel
from specserve.protocol import SparseDistribution, model_info
from specserve.sampling import SamplingParams
from specserve.serving.batching import Batcher
from specserve.serving.metrics import ServiceMetrics
from specserve.serving.telemetry import record_span
from specserve.speculation import Speculation
from specserve.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.config import VerifyConfig
from verify_service.jobs import DecodeJob, Outcome, PrefillJob, ReleaseJob, VerifyJob

SERVICE_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    def __init__(
        self,
        batcher: Batcher,
        loaded: LoadedModel,
        config: VerifyConfig,
        metrics: ServiceMetrics,
        local_methods: tuple[str, ...] = (),
    ):
        self._batcher = batcher
        self._loaded = loaded
        self._config = config
        self._metrics = metrics
        self._info = model_info(loaded, config.max_speculative_tokens, local_methods)
        self._grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    def _grammar(self, request: verify_pb2.PrefillRequest) -> GrammarState | None:
        """The session's grammar after the output sent (compiled here, on the call's thread,
        not on the batch's)."""
        grammar = Grammar.from_proto(request.grammar)
        if grammar is None:
            return None
        output = request.token_ids[request.prompt_length :] if request.prompt_length else []
        return self._grammars.start(grammar, list(output))

    def _run(self, job) -> Outcome:
        """Submits a job; records its queue, forward and kernel time as spans and metrics."""
        submitted = time.time_ns()
        self._metrics.queue_depth.set(self._batcher.pending)
        outcome: Outcome = self._batcher.submit(job)
        self._record(outcome, submitted)
        return outcome

    def _record(self, outcome: Outcome, waiting_since_ns: int) -> None:
        self._metrics.queue_seconds.observe(max(0, outcome.batch_started_ns - waiting_since_ns) / 1e9)
        attributes = {"specserve.batch_size": outcome.batch_size}
        if outcome.draft_started_ns:  # a round drafted here (colocated)
            record_span("verifier.queue", waiting_since_ns, max(waiting_since_ns, outcome.draft_started_ns))
            record_span(
                "draft.forward",
                outcome.draft_started_ns,
                outcome.draft_ended_ns,
                {"specserve.k": outcome.num_draft_tokens},
            )
        else:
            record_span("verifier.queue", waiting_since_ns, max(waiting_since_ns, outcome.batch_started_ns))
        record_span("target.forward", outcome.batch_started_ns, outcome.forward_ended_ns, attributes)
        record_span("kernel.rejection_sample", outcome.forward_ended_ns, outcome.decided_ns, attributes)

    def Prefill(self, request: verify_pb2.PrefillRequest, context) -> verify_pb2.PrefillResponse:
        started = time.perf_counter()
        sampling = SamplingParams.from_proto(request.sampling)
        prompt = request.prompt_top_logprobs if request.prompt_logprobs else None
        job = PrefillJob(
            request.session_id,
            tuple(request.token_ids),
            sampling=sampling,
            prompt_logprobs=prompt,
            copy_of=request.copy_of,
            prompt_length=request.prompt_length,
            grammar=self._grammar(request),
        )
        outcome = self._run(job)
        self._metrics.prefills.inc()
        if not context.is_active():
            # Its caller left while it was queued (a client gone mid-prefill): the caller's
            # Release may have come first and found nothing, so the session is freed here.
            self._batcher.submit(ReleaseJob(request.session_id))
        return verify_pb2.PrefillResponse(
            next_token_id=outcome.next_token_id,
            num_verified=outcome.num_verified,
            server_seconds=time.perf_counter() - started,
            next_token_logprob=outcome.logprobs[0].to_proto() if outcome.logprobs else None,
            prompt_logprobs=[logprob.to_proto() for logprob in outcome.prompt_logprobs],
        )

    def Verify(self, request: verify_pb2.VerifyRequest, context) -> verify_pb2.VerifyResponse:
        started = time.perf_counter()
        outcome = self._run(self._verify_job(request))
        return verify_pb2.VerifyResponse(
            num_accepted=outcome.num_accepted,
            next_token_id=outcome.next_token_id,
            num_verified=outcome.num_verified,
            batch_size=outcome.batch_size,
            server_seconds=time.perf_counter() - started,
            forward_seconds=outcome.forward_seconds,
            kernel_seconds=outcome.kernel_seconds,
            mask_seconds=outcome.mask_seconds,
            accepted_token_ids=outcome.accepted_token_ids,
            logprobs=[logprob.to_proto() for logprob in outcome.logprobs],
        )

    def Decode(self, request: verify_pb2.DecodeRequest, context) -> Iterator[verify_pb2.DecodeResponse]:
        """Streams the rounds the worker makes, one per batch: it goes on to the next round
        without waiting for this thread or the caller, and makes none once the call has ended."""
        made: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        ended = threading.Event()
        context.add_callback(ended.set)  # the call ended: finished, cancelled or timed out

        sampling = _sampling_of(request)
        speculation = Speculation.from_proto(request.speculation) if request.HasField("speculation") else None
        job = DecodeJob(
            request.session_id,
            request.num_verified,
            request.max_tokens,
            sampling,
            made.put,
            ended,
            speculation=speculation,
        )
        self._metrics.queue_depth.set(self._batcher.pending)
        since = time.time_ns()  # the previous token's decision; the call's arrival for the first
        future = self._batcher.submit_async(job)
        future.add_done_callback(lambda _: made.put(None))
        try:
            while (outcome := made.get()) is not None:
                self._record(outcome, since)
                yield verify_pb2.DecodeResponse(
                    token_id=outcome.next_token_id,
                    num_verified=outcome.num_verified,
                    batch_size=outcome.batch_size,
                    server_seconds=max(0, outcome.decided_ns - since) / 1e9,
                    forward_seconds=outcome.forward_seconds,
                    kernel_seconds=outcome.kernel_seconds,
                    mask_seconds=outcome.mask_seconds,
                    accepted_token_ids=outcome.accepted_token_ids,
                    num_draft_tokens=outcome.num_draft_tokens,
                    draft_seconds=outcome.draft_seconds,
                    tree=outcome.tree,
                    logprobs=[logprob.to_proto() for logprob in outcome.logprobs],
                )
                since = outcome.decided_ns
            future.result()  # raises the decode's error, after the tokens made before it
        finally:
            ended.set()

    def Release(self, request: verify_pb2.ReleaseRequest, context) -> verify_pb2.ReleaseResponse:
        self._batcher.submit(ReleaseJob(request.session_id))
        return verify_pb2.ReleaseResponse()

    def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return self._info

    def _verify_job(self, request: verify_pb2.VerifyRequest) -> VerifyJob:
        distributions = tuple(
            SparseDistribution.from_proto(d, self._loaded.vocab_size, self._config.max_support)
            for d in request.draft_distributions
        )
        sampling = _sampling_of(request)
        return VerifyJob(
            session_id=request.session_id,
            num_verified=request.num_verified,
            draft_token_ids=tuple(request.draft_token_ids),
            draft_distributions=distributions,
            sampling=sampling,
            draft_parents=tuple(request.draft_parents),
        )


def _sampling_of(request) -> SamplingParams | None:
    """A Verify or Decode call's own sampling parameters; None: the session's (Prefill's)."""
    return SamplingParams.from_proto(request.sampling) if request.HasField("sampling") else None
