"""Every error the server sends: `{"error": {"message", "type", "param", "code"}}`.

Messages are capped (MAX_MESSAGE_CHARS): they name the field and the rule, never echo a whole
input back (a 1 MB prompt must not come back in a 1 MB error). FastAPI's own 422 validation
errors and Starlette's 404/405 are rewritten into the same shape; anything unexpected is a
500 in that shape, logged with its traceback here and never sent to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetllm.engine.async_engine import EngineUnhealthyError, RequestAbortedError
from fleetllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from fleetllm.errors import (
    EngineShutdownError,
    EngineSleepingError,
    FleetLLMError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1024
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable_error"}
# Union-typed fields: pydantic reports one error per branch; say once what is accepted.
_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id "
              "lists (token ids are ints >= 0)",
    "input": "must be a string, a list of strings, a list of token ids or a list of token-id "
             "lists (token ids are ints >= 0)",
    "stop": "must be a non-empty string or a list of non-empty strings",
    "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}
_LOC_PREFIXES = {"body", "query", "path", "header", "cookie"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """At most `limit` characters, and always encodable (a lone surrogate from the request,
    echoed back, is written as its escape: an error must never fail to be sent)."""
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit - 15] + "... (truncated)"


def error_body(status: int, message: str, param: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=truncate(message), type=type or _TYPES.get(status, "error"),
                     param=None if param is None else truncate(param, 128), code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type), status_code=status,
                        headers=headers)


def api_error_from(e: BaseException) -> APIError:
    """The HTTP error for an exception from the engine or the request's own processing."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineUnhealthyError | EngineShutdownError | EngineSleepingError
                  | RequestAbortedError):
        return APIError(503, _plain(e))
    if isinstance(e, ValueError):  # InvalidRequestError, ConfigurationError (bad params)
        return APIError(400, _plain(e), getattr(e, "param", None))
    if isinstance(e, RequestFailedError):  # accepted, then failed in the engine: say why
        return APIError(500, _plain(e))
    logger.error("unexpected error serving a request", exc_info=e)
    return APIError(500, "internal server error")


def _plain(e: BaseException) -> str:
    """The message without the "[E007] " code prefix: the HTTP status says it already."""
    text = str(e)
    if isinstance(e, FleetLLMError):
        text = text.removeprefix(f"[{e.code}] ")
    return text


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One readable 400 from pydantic's list of errors (the first field's)."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [x for x in first.get("loc", ()) if x not in _LOC_PREFIXES]
    if first.get("type") == "unsupported_field":  # raised for the object: name the field
        loc.append(first["ctx"]["field"])
    if first.get("type") == "extra_forbidden":
        return _unknown_fields([e for e in errors if e.get("type") == "extra_forbidden"])
    if not loc:
        return APIError(400, str(first.get("msg", "invalid request")))
    field_errors = [e for e in errors if [x for x in e.get("loc", ())
                                          if x not in _LOC_PREFIXES][:1] == loc[:1]]
    path = [str(x) for x in loc if isinstance(x, int) or _is_field(x)]
    param = ".".join(path) or str(loc[0])
    names = [i for i, x in enumerate(path) if not x.isdigit()]
    name = path[names[-1]] if names else ""
    if name in _UNION_HINTS and len(field_errors) > 1:  # one error per union branch
        param = ".".join(path[:names[-1] + 1])
        return APIError(400, f"{param}: {_UNION_HINTS[name]}", param)
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param)


def _unknown_fields(errors: list[dict[str, Any]]) -> APIError:
    """Every unknown field at once, so a client fixes them in one go."""
    names = [".".join(str(x) for x in e["loc"] if x not in _LOC_PREFIXES) for e in errors]
    listed = ", ".join(truncate(name, 64) for name in names[:10])
    plural = len(names) > 1
    return APIError(400, f"unknown field{'s' if plural else ''} {listed}: this server does "
                    f"not implement {'them' if plural else 'it'}", names[0])


def _is_field(x: Any) -> bool:
    """Field names (snake_case), not pydantic's union-branch tags (`list[int]`, `str`, ...)."""
    return isinstance(x, str) and x.isidentifier() and x.islower() and x not in {
        "str", "int", "float", "bool", "list", "dict", "none"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: "not found", 405: "method not allowed"}.get(exc.status_code,
                                                                     str(exc.detail))
        return error_response(exc.status_code, f"{message}: {request.method} "
                              f"{truncate(request.url.path, 200)}",
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = api_error_from(exc)
        return error_response(err.status, err.message, err.param)
