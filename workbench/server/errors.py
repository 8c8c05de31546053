"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Owns: the `APIError` exception that serving code raises, the translation of pydantic validation
errors into one message naming the parameter and the allowed range, and the exception handlers
that make every failure (FastAPI's 422, unknown routes, anything unexpected) an OpenAI-shaped
body with a real status code. Messages never contain stack traces or file paths. Does not own:
deciding what is valid (protocol.py, SamplingParams.validate, the engine).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("workbench.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable"}


class APIError(Exception):
    """A request failure with its HTTP status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --- pydantic errors -> one clear message -------------------------------------------------------

_EXPECTED = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
             "bool_type": "a boolean", "dict_type": "an object", "list_type": "an array",
             "model_type": "an object", "int_parsing": "an integer", "float_parsing": "a number"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def param_path(loc: tuple[Any, ...]) -> str | None:
    """`('messages', 0, 'content')` -> `messages[0].content` (None for the whole body)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40])
    return "an array" if isinstance(value, list) else "an object"


def _range_text(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """'[0.0, 2.0]'-style range of a top-level field from its Field constraints, when it has both bounds."""
    if model is None or len(loc) != 1 or loc[0] not in model.model_fields:
        return None
    lo = hi = None
    lo_open = hi_open = False
    for m in model.model_fields[loc[0]].metadata:
        for attr, is_lo, is_open in (("ge", True, False), ("gt", True, True), ("le", False, False), ("lt", False, True)):
            val = getattr(m, attr, None)
            if val is not None:
                if is_lo:
                    lo, lo_open = val, is_open
                else:
                    hi, hi_open = val, is_open
    if lo is None or hi is None:
        return None
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def validation_message(err: dict[str, Any], model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """(message, param) for one pydantic error dict."""
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):  # FastAPI's location prefix is not a parameter
        loc = loc[1:]
    param, kind, value = param_path(loc), err.get("type", ""), err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "json_invalid":
        return f"request body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
    if kind == "missing":
        return f"{param} is required", param
    if kind == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if kind == "finite_number":
        return f"{param} must be a finite number", param
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        rng = _range_text(model, loc)
        allowed = f"in {rng}" if rng else f"{op} {ctx.get(key)}"
        return f"{param} must be {allowed}, got {_json_kind(value)}", param
    if kind in _EXPECTED:
        return f"{param or 'request body'} must be {_EXPECTED[kind]}, got {_json_kind(value)}", param
    if kind == "literal_error":
        return f"{param} must be one of {ctx.get('expected')}, got {_json_kind(value)}", param
    if kind == "value_error":
        msg = str(ctx.get("error", err.get("msg", "")))
        if param is None and model is not None:  # a model-level rule: its message starts with the field
            lead = msg.split(" ", 1)[0]
            param = lead if lead in model.model_fields else None
        return (msg if param is None or msg.startswith(param) else f"{param}: {msg}"), param
    return f"{param or 'request body'}: {err.get('msg', 'invalid value')}", param


def from_validation_error(exc: ValidationError | RequestValidationError,
                          model: type[BaseModel] | None = None) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    message, param = validation_message(dict(first), model)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param)


# --- handlers -----------------------------------------------------------------------------------


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Every failure leaves as an OpenAI-shaped body; FastAPI's 422 becomes 400. `on_error(status)`
    is told about each error response (metrics)."""

    def respond(exc: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(exc.status)
        return exc.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return respond(APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return respond(APIError(500, f"internal server error ({type(exc).__name__})"))
