"""Errors a request can cause. Each maps to one gRPC status in specserve.serving.grpc_server and to
one HTTP status in the gateway; anything else is a bug and answers INTERNAL."""

from __future__ import annotations


class RequestError(Exception):
    """A request the service cannot honour; the service state is unchanged."""


class InvalidArgument(RequestError):
    """Malformed or out-of-range input (gRPC INVALID_ARGUMENT, HTTP 400)."""


class ResourceExhausted(RequestError):
    """The service is at capacity (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class FailedPrecondition(RequestError):
    """The caller's view of a session disagrees with the service's (gRPC FAILED_PRECONDITION).

    num_verified is the length the service holds (0 for a session it does not know), so the
    caller can resend from there or prefill again.
    """

    def __init__(self, message: str, num_verified: int):
        super().__init__(message)
        self.num_verified = num_verified


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgument(message)
