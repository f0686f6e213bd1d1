"""The router's errors in the OpenAI shape: the model the OpenAPI document describes
them with, the responses built from it, and the handlers that turn what a route raises
(ApiError, or a parameter FastAPI validated) into one.

No message may hold prompt or completion text: they name fields, never their values.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class ErrorDetail(BaseModel):
    message: str = Field(description="never prompt text")
    type: str
    param: str | None
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_response(
    status: int, message: str, *, kind: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error in the OpenAI shape; `message` must hold no prompt or completion text."""
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=None, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class ApiError(Exception):
    """An answer other than success, raised where returning one is not possible (a
    dependency) or not simpler; rendered by error_response."""

    def __init__(
        self, status: int, message: str, *, kind: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), kind=self.kind, headers=self.headers)


class RequestRefused(ApiError):
    """A generation request the router answers itself, not an engine: the one hierarchy
    both front doors map at their edge (the proxy to an HTTP answer, the picker to
    Envoy's ImmediateResponse). `outcome` labels it in kvplane_requests_total."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str,
        outcome: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, kind=kind, headers=headers)
        self.outcome = outcome


def unavailable(message: str, *, outcome: str, retry_after_s: int) -> RequestRefused:
    """A 503: no worker can take the request now; the client may try again."""
    return RequestRefused(
        503,
        message,
        kind="ServiceUnavailableError",
        outcome=outcome,
        headers={"retry-after": str(retry_after_s)},
    )


def documented(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """An error answer in an operation's `responses`: the OpenAI shape, and the headers
    it carries (OpenAPI header objects)."""
    response: dict[str, Any] = {"model": ErrorBody, "description": description}
    if headers:
        response["headers"] = headers
    return response


def required_header(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "required": True, "schema": schema}


async def api_error(request: Request, error: ApiError) -> Response:
    return error.response()


async def invalid_parameters(request: Request, error: RequestValidationError) -> Response:
    """What FastAPI's own validation refuses, as a 400 like the router's own checks
    (FastAPI would answer 422 with the offending values in its body)."""
    fields = sorted({".".join(str(part) for part in problem["loc"]) for problem in error.errors()})
    return error_response(400, "invalid " + ", ".join(fields), kind="BadRequestError")


EXCEPTION_HANDLERS: dict[
    int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]
] = {
    ApiError: api_error,
    RequestValidationError: invalid_parameters,
}
