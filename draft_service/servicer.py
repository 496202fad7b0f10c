"""gRPC servicer of the draft service: one bidirectional stream per session."""

from __future__ import annotations

import time
from collections.abc import Iterator

from opentelemetry.trace import SpanKind

from draft_service.config import DraftConfig
from specserve.drafting import Drafter, DraftJob, Proposal
from specserve.model.loading import LoadedModel
from specserve.protocol import model_info
from specserve.sampling import SamplingParams
from specserve.serving.batching import Batcher
from specserve.serving.metrics import ServiceMetrics
from specserve.serving.telemetry import record_span, span
from specserve.speculation import tree_of
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(
        self, drafter: Drafter, batcher: Batcher, loaded: LoadedModel, config: DraftConfig, metrics: ServiceMetrics
    ):
        self._drafter = drafter
        self._batcher = batcher
        self._metrics = metrics
        self._info = model_info(loaded, config.max_speculative_tokens, drafter.methods)

    def Draft(self, request_iterator: Iterator[draft_pb2.DraftRequest], context) -> Iterator[draft_pb2.DraftResponse]:
        session = None
        try:
            for request in request_iterator:
                started = time.perf_counter()
                if session is None:
                    session = self._drafter.open_session(
                        request.session_id, request.method, request.tenant, request.isolated, request.prompt_length
                    )
                proposal = self._propose(session, request)
                yield draft_pb2.DraftResponse(
                    num_verified=proposal.num_verified,
                    draft_token_ids=proposal.draft_token_ids,
                    draft_distributions=[d.to_proto() for d in proposal.draft_distributions],
                    draft_seconds=time.perf_counter() - started,
                    batch_size=proposal.batch_size,
                    bonus_guess=proposal.bonus_guess,
                    draft_parents=proposal.draft_parents,
                )
        finally:
            if session is not None:
                self._drafter.close_session(session)

    def _propose(self, session, request: draft_pb2.DraftRequest) -> Proposal:
        """One round's drafting, traced as a server span whose parent is the gateway's round."""
        job = DraftJob(
            session=session,
            tokens=tuple(request.tokens),
            num_verified=request.num_verified,
            num_speculative_tokens=request.num_speculative_tokens,
            sampling=SamplingParams.from_proto(request.sampling),
            min_draft_probability=request.min_draft_probability,
            want_bonus_guess=request.want_bonus_guess,
            tree=tree_of(request.tree),
        )
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": SERVICE_NAME,
            "rpc.method": "Draft",
            "specserve.k": request.num_speculative_tokens,
            "specserve.method": session.method,
        }
        with span(
            "specserve.v1.DraftService/Draft propose",
            carrier=request.trace_context,
            kind=SpanKind.SERVER,
            attributes=attributes,
        ) as server_span:
            submitted = time.time_ns()
            self._metrics.queue_depth.set(self._batcher.pending)
            proposal: Proposal = self._batcher.submit(job)
            server_span.set_attribute("specserve.batch_size", proposal.batch_size)
            record_span("drafter.queue", submitted, max(submitted, proposal.batch_started_ns))
            record_span(
                "draft.forward",
                proposal.batch_started_ns,
                proposal.batch_ended_ns,
                {"specserve.batch_size": proposal.batch_size},
            )
        self._metrics.queue_seconds.observe(max(0, proposal.batch_started_ns - submitted) / 1e9)
        return proposal

    def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return self._info
