"""Errors as the OpenAI API spells them: every failure the router answers, whether raised by a
route, by request validation, by Starlette's routing (404, 405) or by a bug, leaves as the same
JSON body (`responses.error_body`) with the status code in it."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router import responses as R

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the router refuses, with the HTTP status and the field at fault (if one)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(R.error_body(message, status, param=param), status_code=status)


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    # OpenAI answers 400, not FastAPI's 422, and names only the first bad field.
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON")
    return error_response(400, f"{where + ': ' if where else ''}{message}", where or None)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error")
    return error_response(500, f"internal error: {type(exc).__name__}")


def register_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
