"""Errors the serving layers raise; the app maps each to OpenAI's error envelope
`{"error": {"message", "type", "code", "param"}}` with its HTTP status."""

from __future__ import annotations


class AxonHTTPError(Exception):
    status_code = 400
    error_type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.param = param
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        error = {
            "message": self.message,
            "type": self.error_type,
            "code": self.code,
            "param": self.param,
        }
        error.update(self.extra)
        return {"error": error}


class BadRequest(AxonHTTPError):
    status_code = 400


class ContextLengthExceeded(AxonHTTPError):
    status_code = 400
    code = "context_length_exceeded"


class ModelNotFound(AxonHTTPError):
    status_code = 404
    error_type = "not_found_error"
    code = "model_not_found"


class Unprocessable(AxonHTTPError):
    status_code = 422


class Overloaded(AxonHTTPError):
    """Too many requests queued for a model: 429 with Retry-After."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "too_many_requests"


class ModelUnavailable(AxonHTTPError):
    """The model is loading, poisoned or recovering: 503 with Retry-After."""

    status_code = 503
    error_type = "service_unavailable"
    code = "model_unavailable"


class Unauthorized(AxonHTTPError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class EngineDead(AxonHTTPError):
    """The engine process faulted or died while serving the request."""

    status_code = 503
    error_type = "service_unavailable"
    code = "engine_failed"


class Forbidden(AxonHTTPError):
    """A valid key that does not open this route (the inference key on a node-management one)."""

    status_code = 403
    error_type = "permission_error"
    code = "admin_key_required"
