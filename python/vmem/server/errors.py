"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status the official clients map to their exception classes (400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 413, 429 ``RateLimitError``, 503)."""

from __future__ import annotations

from typing import Any, Dict, Optional

#: The ``type`` OpenAI gives each status.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request the server answers with ``status`` and an OpenAI error body. ``param`` names the
    request's parameter at fault (``"max_tokens"``, ``"messages.0.content"``); ``headers`` go
    with the response (``Retry-After`` on 429 and 503)."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        """The response's JSON body."""
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param=param, code=code)


def echo(value: Any, most: int = 80) -> str:
    """A value of the request as a message quotes it: cut to ``most`` characters (a message
    never echoes a request's megabytes)."""
    text = str(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def unknown_model(model: Any) -> ApiError:
    """The 404 for a ``model`` the server does not serve."""
    return ApiError(404, f"The model `{echo(model)}` does not exist.", param="model", code="model_not_found")


def busy(retry_after: int, why: str) -> ApiError:
    """A 429 with ``Retry-After`` (the request was not admitted: nothing was done)."""
    return ApiError(429, why, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def unavailable(retry_after: int, why: str) -> ApiError:
    """A 503 with ``Retry-After``."""
    return ApiError(503, why, code="service_unavailable", headers={"Retry-After": str(retry_after)})
