"""The gateway's view of the two services: channels, stubs, start-up checks, health."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import grpc

from gateway.replicas import DNS_SCHEME, ReplicaSet, Route, split_addresses
from specserve.adaptive import Shared
from specserve.methods import registry
from specserve.methods.trees import TreeShape
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2_grpc


class IncompatibleModels(Exception):
    """The draft and the target (or the gateway's tokenizer) do not share a vocabulary."""


@dataclass(frozen=True)
class ServedModel:
    """What the gateway needs to know of the pair it serves."""

    name: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: frozenset[int]
    max_speculative_tokens: int
    local_methods: frozenset[str] = frozenset()  # drafted by the verifier itself (colocated)
    remote_methods: frozenset[str] = frozenset()  # drafted by the draft service


# A channel to a name that resolves to several addresses spreads its calls over them (the
# start-up's model queries); a session's calls go to one replica (gateway.replicas), each
# replica's channel dialling one address.
ROUND_ROBIN = ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}')


def open_channel(address: str, security: tuple = (None, []), aio: bool = False):
    """A channel to a service: TLS when security holds credentials, else plaintext."""
    credentials, extra_options = security
    options = [ROUND_ROBIN, *extra_options]
    grpc_module = grpc.aio if aio else grpc
    if credentials is not None:
        return grpc_module.secure_channel(address, credentials, options=options)
    return grpc_module.insecure_channel(address, options=options)


def wait_for_model_info(
    target: str, stub_cls, timeout_s: float, security: tuple = (None, []), stop: threading.Event | None = None
) -> common_pb2.ModelInfo:
    """Polls a service's GetModelInfo until one of its replicas answers (it may still be
    loading its model); target as gateway.replicas takes it. stop, once set, ends the wait
    within a second (TimeoutError)."""
    addresses, dns_name = split_addresses(target)
    deadline = time.monotonic() + timeout_s
    channels = [open_channel(a, security) for a in addresses or [DNS_SCHEME + dns_name]]
    try:
        stubs = [stub_cls(channel) for channel in channels]
        while True:
            if stop is not None and stop.is_set():
                raise TimeoutError(f"stopped while waiting for {target}")
            wait = min(1.0, max(0.1, deadline - time.monotonic())) / len(stubs)
            for stub in stubs:
                try:
                    return stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=wait, wait_for_ready=True)
                except grpc.RpcError as error:
                    details = error.details()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {target} within {timeout_s:.0f} s: {details}")
            time.sleep(0.5)
    finally:
        for channel in channels:
            channel.close()


def check_pair(target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None, gateway_fingerprint: str) -> None:
    """draft: the draft service's model, None without a draft service."""
    if draft is not None and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleModels(
            f"the draft model {draft.model_name!r} and the target model {target.model_name!r} have different "
            f"vocabularies (tokenizer fingerprints {draft.tokenizer_fingerprint} and {target.tokenizer_fingerprint}); "
            "speculative decoding needs a draft that shares the target's tokenizer"
        )
    if gateway_fingerprint != target.tokenizer_fingerprint:
        raise IncompatibleModels(
            f"the gateway's tokenizer (fingerprint {gateway_fingerprint}) is not the target model's "
            f"({target.tokenizer_fingerprint}); point --tokenizer at the target's directory"
        )


REMOTE_METHODS = frozenset(registry.names(registry.DRAFT_SERVICE))


def served_model(
    target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None, name: str, draft_service: bool = False
) -> ServedModel:
    """What the pair serves. draft: the draft service's model, None without a draft service
    or (draft_service true) while it has not answered yet: its methods are served (as
    target-only rounds until it answers), within the verifier's K."""
    local = frozenset(target.local_methods)
    max_k = target.max_speculative_tokens
    remote = REMOTE_METHODS - local if draft_service else frozenset()
    if draft is not None:
        max_k = min(max_k, draft.max_speculative_tokens)
        remote = frozenset(draft.local_methods or REMOTE_METHODS) - local  # an older service does not say
    return ServedModel(
        name=name or target.model_name,
        vocab_size=target.vocab_size,
        max_context_length=target.max_context_length,
        eos_token_ids=frozenset(target.eos_token_ids),
        max_speculative_tokens=max_k,
        local_methods=local,
        remote_methods=remote,
    )


@dataclass(frozen=True)
class Deadlines:
    """How long calls may take. The draft's is short: a slow draft costs a target-only round,
    never the request. A verifier that is down (restarting) is waited for up to verify_retry_s."""

    rpc_timeout_s: float = 60.0
    draft_timeout_s: float = 5.0
    verify_retry_s: float = 60.0
    draft_backoff_s: float = 1.0  # first pause after a draft failure; doubles up to 32x


class Backends:
    """Async stubs of both services' replicas (gateway.replicas), opened inside the gateway's
    event loop, and whether the draft service may be used."""

    def __init__(self, draft_address: str, verify_address: str, deadlines: Deadlines, security: tuple = (None, [])):
        """draft_address empty: no draft service (the verifier drafts for itself)."""
        self.deadlines = deadlines
        self.shared = Shared()  # what the draft service's rounds have cost so far, and their acceptance
        self.detached: set[asyncio.Task] = set()  # releases that outlive their cancelled requests
        self.rpc_timeout_s = deadlines.rpc_timeout_s

        def opener(address: str, server_name: str | None):
            credentials, options = security
            if credentials is not None and server_name and not any(k == TARGET_NAME_OVERRIDE for k, _ in options):
                options = [*options, (TARGET_NAME_OVERRIDE, server_name)]  # a replica dialled by its IP
            return open_channel(address, (credentials, options), aio=True)

        self.verifiers = ReplicaSet(verify_address, opener, verify_pb2_grpc.VerifyServiceStub)
        self.drafters = ReplicaSet(draft_address, opener, draft_pb2_grpc.DraftServiceStub) if draft_address else None
        # False until the draft service has answered and its model matches the target's: until
        # then (an outage at start-up) its methods' rounds run target-only.
        self.draft_usable = False

    @property
    def draft_configured(self) -> bool:
        return self.drafters is not None

    async def start(self) -> None:
        await self.verifiers.start()
        if self.drafters is not None:
            await self.drafters.start()

    async def health(self) -> dict:
        """What /health says: each part and whether it serves. Ready (status ok) needs one
        verifier replica serving; a draft service that is down costs drafts, not service."""
        sets = [self.verifiers] + ([self.drafters] if self.drafters is not None else [])
        verifiers, *drafters = await asyncio.gather(*(replicas.health() for replicas in sets))
        parts = {"verify": {address: _state(up) for address, up in verifiers.items()}}
        if drafters:
            drafters, usable = drafters[0], self.draft_usable
            parts["draft"] = {address: _state(up and usable) for address, up in drafters.items()}
        return {"status": "ok" if any(verifiers.values()) else "unavailable", **parts}

    async def close(self) -> None:
        if self.drafters is not None:
            await self.drafters.close()
        await self.verifiers.close()


TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"


def _state(up: bool) -> str:
    return "serving" if up else "unavailable"


class DraftStream:
    """One session's draft stream: sends only the tokens verified since the last request."""

    def __init__(
        self,
        backends: Backends,
        session_id: str,
        method: str = "draft_model",
        min_draft_probability: float = 0.0,
        tenant: str = "",
        isolated: bool = False,
        prompt_length: int = 0,
    ):
        self._backends = backends
        self._tenant, self._isolated, self._prompt_length = tenant, isolated, prompt_length
        self._session_id = session_id
        self._route = Route(backends.drafters, session_id)
        self._method = method
        self._min_draft_probability = min_draft_probability
        self._call = None
        self._sent = 0  # verified tokens the draft service has been told of
        self.last_request_bytes = 0
        self._failures = 0
        self._paused_until = 0.0

    @property
    def available(self) -> bool:
        """False while backing off after a failure, or while the draft service has not yet
        answered: those rounds run target-only."""
        return self._backends.draft_usable and time.monotonic() >= self._paused_until

    async def propose(
        self,
        sequence: list[int],
        k: int,
        sampling: common_pb2.SamplingParams,
        trace_context: dict[str, str],
        want_bonus_guess: bool = False,
        guessed: list[int] | tuple[int, ...] = (),
        tree: TreeShape | None = None,
    ) -> draft_pb2.DraftResponse:
        """Drafts after sequence, or, for a pipelined round, after sequence + guessed (tokens
        not yet verified: the service is rewound past them unless confirm() says they held).
        Raises grpc.RpcError, RuntimeError (the stream ended) or TimeoutError on failure."""
        if self._call is None:
            self._call = self._route.current().stub.Draft(timeout=None)
            self._sent = 0
        request = draft_pb2.DraftRequest(
            session_id=self._session_id,
            tokens=[*sequence[self._sent :], *guessed],
            num_verified=len(sequence) + len(guessed),
            num_speculative_tokens=k,
            sampling=sampling,
            trace_context=trace_context,
            method=self._method,
            min_draft_probability=self._min_draft_probability,
            want_bonus_guess=want_bonus_guess,
            tree=tree.to_proto() if tree is not None else None,
            tenant=self._tenant,
            isolated=self._isolated,
            prompt_length=self._prompt_length,
        )
        self.last_request_bytes = request.ByteSize()
        timeout_s = self._backends.deadlines.draft_timeout_s
        try:
            await asyncio.wait_for(self._call.write(request), timeout_s)
            response = await asyncio.wait_for(self._call.read(), timeout_s)
        except asyncio.InvalidStateError:  # the stream ended (its service died) since the last round
            raise RuntimeError("the draft stream has ended") from None
        if response is grpc.aio.EOF:
            raise RuntimeError("the draft service ended the stream")
        self._sent = len(sequence)
        self._failures = 0
        return response

    def confirm(self, length: int) -> None:
        """The guessed tokens of the last proposal were verified: the service holds length tokens."""
        self._sent = length

    def reset(self) -> None:
        """Drops a broken stream and pauses drafting (exponential backoff); the next proposal
        reopens the stream with the whole sequence."""
        if self._call is not None:
            self._call.cancel()
        self._call = None
        if len(self._backends.drafters) > 1 and self._route.failed() is not None:
            return  # another replica drafts next round, with the whole sequence (the old one's stream ended)
        pause = self._backends.deadlines.draft_backoff_s * 2 ** min(self._failures, 5)
        self._failures += 1
        self._paused_until = time.monotonic() + pause

    async def close(self) -> None:
        if self._call is not None:
            try:
                await self._call.done_writing()
            except (grpc.RpcError, asyncio.InvalidStateError):  # the stream had already ended
                pass
            self._call.cancel()
            self._call = None
