"""HTTP errors in OpenAI's shape, on every route:

    {"error": {"message": ..., "type": ..., "param": <field or null>, "code": <status or string>}}

The official `openai` client reads `error.message`. Bad input is always 400 (never FastAPI's 422);
gRPC failures map through meshlm.common.errors (503 carries `Retry-After: 1`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshlm.common.errors import ServiceError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "request_cancelled",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """Raised by route code; rendered as the OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: Any | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    @staticmethod
    def from_service_error(e: ServiceError) -> APIError:
        return APIError(e.http_status, e.message or e.code.name)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(
    status: int, message: str, *, param: str | None = None, code: Any | None = None, type: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": status if code is None else code,
        }
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: Any | None = None, type: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 503 else None
    body = error_body(status, message, param=param, code=code, type=type)
    return JSONResponse(body, status_code=status, headers=headers)


def api_error_response(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, param=e.param, code=e.code, type=e.type)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: Any) -> bool:
    """pydantic names union branches in `loc` by type ("str", "list[int]", "SomeModel")."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of pydantic/FastAPI validation errors; the message names the field and rule."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        pos = first["loc"][-1] if first.get("loc") else "?"
        return f"Invalid JSON body: {ctx.get('error', 'decode error')} (at position {pos})", None
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if not loc:
        if first.get("type") == "missing":
            return "Request body is required: a JSON object (Content-Type: application/json)", None
        return f"Request body: {first.get('msg')} (Content-Type must be application/json)", None
    param = str(loc[0])
    same = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if len(same) > 1 and len(loc) > 1 and all(len(e["loc"]) == len(first["loc"]) for e in same):
        # A union: one error per alternative, e.g. prompt: str | list[str] | list[int] | list[list[int]].
        kinds = " | ".join(str(e["loc"][-1]) for e in same)
        where = ".".join(str(p) for i, p in enumerate(loc[:-1]) if i == 0 or not _is_type_tag(p))
        return f"{where}: invalid value {_short(first.get('input'))}; expected {kinds}", param
    where = ".".join(str(p) for i, p in enumerate(loc) if i == 0 or not _is_type_tag(p))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return f"{where}: field required", param
    return f"{where}: {msg} (got {_short(first.get('input'))})", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError) -> JSONResponse:
        return api_error_response(APIError.from_service_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"Not Found: {request.method} {request.url.path}"
        response = error_response(exc.status_code, message)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
