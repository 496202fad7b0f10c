"""gRPC servicer of the draft service: one bidirectional stream per session."""

from __future__ import annotations

import time
from collections.abc import Iterator

from draft_service.config import DraftConfig
from draft_service.engine import Drafter, DraftJob, Proposal
from specserve.batching import Batcher
from specserve.models import LoadedModel
from specserve.protocol import model_info
from specserve.sampling import SamplingParams
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, drafter: Drafter, batcher: Batcher, loaded: LoadedModel, config: DraftConfig):
        self._drafter = drafter
        self._batcher = batcher
        self._info = model_info(loaded, config.max_speculative_tokens)

    def Draft(self, request_iterator: Iterator[draft_pb2.DraftRequest], context) -> Iterator[draft_pb2.DraftResponse]:
        session = None
        try:
            for request in request_iterator:
                started = time.perf_counter()
                if session is None:
                    session = self._drafter.open_session(request.session_id)
                proposal: Proposal = self._batcher.submit(
                    DraftJob(
                        session=session,
                        tokens=tuple(request.tokens),
                        num_verified=request.num_verified,
                        num_speculative_tokens=request.num_speculative_tokens,
                        sampling=SamplingParams.from_proto(request.sampling),
                    )
                )
                yield draft_pb2.DraftResponse(
                    num_verified=proposal.num_verified,
                    draft_token_ids=proposal.draft_token_ids,
                    draft_distributions=[d.to_proto() for d in proposal.draft_distributions],
                    draft_seconds=time.perf_counter() - started,
                )
        finally:
            if session is not None:
                self._drafter.close_session(session)

    def GetModelInfo(self, request, context) -> common_pb2.ModelInfo:
        return self._info
