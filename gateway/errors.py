"""Errors the gateway answers in OpenAI's shape."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value")
