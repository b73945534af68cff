"""OpenAI-shaped errors: ApiError, and FastAPI's own errors (validation, 404, 405) answered in the same shape.

Every refusal the server makes is {"error": {"message", "type", "param", "code"}} with an HTTP
status; the message names the value and what was expected.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def type_name(value: Any) -> str:
    """A JSON value's type as JSON names it: null, boolean, integer, number, string, array, object."""
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def bad_type(name: str, value: Any, expected: str) -> ApiError:
    shown = json.dumps(value)[:80]
    return ApiError(f"{name}={shown} must be {expected} (got {type_name(value)})", name, "invalid_type")


async def _api_error(request: Request, exc: ApiError):
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    shown = json.dumps(first.get("input"), default=str)[:80] if "input" in first else "?"
    return ApiError(f"{param or 'request'}={shown}: {first.get('msg', 'invalid value')}", param,
                    "invalid_value").response()


async def _http_error(request: Request, exc: StarletteHTTPException):
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(f"{request.method} {request.url.path}: {exc.detail}", None, None, exc.status_code,
                    type_).response()


def add_error_handlers(app: FastAPI) -> None:
    """Answer ApiError, FastAPI's validation errors and Starlette's HTTP errors in OpenAI's shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
