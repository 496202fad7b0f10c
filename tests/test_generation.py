"""The gateway's Decode streams against a scripted verifier (breaks that real processes make
only by chance)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc

from gateway.clients import Deadlines
from gateway.generation import GenerationPlan, SpeculationStats, generate
from gateway.replicas import ReplicaSet
from specserve.sampling import SamplingParams
from specserve.v1 import verify_pb2


class _Stream:
    """A Decode call as grpc.aio gives it: read() until EOF, or an error where the script says."""

    def __init__(self, tokens: list[int], first_length: int, end):
        self._responses = [verify_pb2.DecodeResponse(token_id=t, num_verified=first_length + i, batch_size=1)
                           for i, t in enumerate(tokens)]  # fmt: skip
        self._end = end
        self.cancelled = False

    async def read(self):
        if self._responses:
            return self._responses.pop(0)
        if self._end == "stall":
            await asyncio.sleep(3600)
        if isinstance(self._end, grpc.StatusCode):
            raise grpc.aio.AioRpcError(self._end, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")
        return grpc.aio.EOF

    def done(self) -> bool:
        return self.cancelled or (not self._responses and self._end != "stall")

    async def code(self):
        if self._end == "stall":
            await asyncio.sleep(3600)
        return self._end if isinstance(self._end, grpc.StatusCode) else grpc.StatusCode.OK

    def cancel(self):
        self.cancelled = True


class _Verifier:
    """A target whose next token is the sequence's length; Decode calls follow a script."""

    def __init__(self, script):
        self.script = list(script)  # per Decode call: (tokens it streams, how it ends)
        self.calls: list[str] = []
        self.streams: list[_Stream] = []

    async def Prefill(self, request, **_):
        self.calls.append(f"Prefill {len(request.token_ids)}")
        return verify_pb2.PrefillResponse(next_token_id=len(request.token_ids), num_verified=len(request.token_ids) + 1)

    def Decode(self, request, **_):
        self.calls.append(f"Decode {request.num_verified} {request.max_tokens}")
        count, end = self.script.pop(0)
        tokens = [request.num_verified + i for i in range(min(count, request.max_tokens))]
        self.streams.append(_Stream(tokens, request.num_verified + 1, end))
        return self.streams[-1]

    async def Release(self, request, **_):
        self.calls.append("Release")
        return verify_pb2.ReleaseResponse()


class _Channel:
    """Enough of a channel for a replica's health stub (never called here)."""

    def unary_unary(self, *args, **kwargs):
        return None

    unary_stream = unary_unary


def _target_only(verifier: _Verifier, prompt: list[int], max_tokens: int) -> list[int]:
    replicas = ReplicaSet("verifier:1", lambda address, server_name: _Channel(), lambda channel: verifier)
    backends = SimpleNamespace(
        verifiers=replicas, rpc_timeout_s=0.2, deadlines=Deadlines(verify_retry_s=5), detached=set()
    )
    plan_ = GenerationPlan(prompt, max_tokens, SamplingParams(temperature=0), "none", 4)

    async def run():
        return [t async for tokens in generate(backends, plan_, SpeculationStats()) for t in tokens]

    return asyncio.run(run())


def test_a_decode_stream_that_breaks_goes_on_from_the_gateways_sequence():
    # The verifier dies after 3 tokens, then has lost the session, then stalls after 2 more:
    # each time the gateway prefills its own sequence again and decodes on; no token is lost.
    verifier = _Verifier([(3, grpc.StatusCode.UNAVAILABLE), (0, grpc.StatusCode.FAILED_PRECONDITION),
                          (2, "stall"), (100, None)])  # fmt: skip
    assert _target_only(verifier, [5, 6], 12) == list(range(2, 14))
    assert verifier.calls == ["Prefill 2", "Decode 3 11", "Prefill 6", "Decode 7 7", "Prefill 7", "Decode 8 6",
                              "Prefill 10", "Decode 11 3", "Release"]  # fmt: skip
    assert all(stream.cancelled for stream in verifier.streams)


def test_a_decode_stream_that_ends_early_ends_the_request():
    verifier = _Verifier([(4, None)])  # an end-of-sequence token after 4: the stream ends cleanly
    assert _target_only(verifier, [1], 20) == [1, 2, 3, 4, 5]
    assert verifier.calls == ["Prefill 1", "Decode 2 19", "Release"]
