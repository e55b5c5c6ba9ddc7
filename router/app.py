"""The OpenAI-compatible front door: the FastAPI app that puts the router's pieces together.

    errors.py     OpenAI-style error bodies and the app's exception handlers
    routes.py     the endpoints: tokenize, check, admit (ServingContext holds their state)
    streaming.py  worker outputs → SSE chunks or one response, with per-request timing

The router never imports model code: workers do the math, the router does the talking.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Response

from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.errors import ApiError, error_response, register_error_handlers
from pdserve.router.routes import ServingContext, openai_routes, ops_routes

CallNext = Callable[[Request], Awaitable[Response]]


def build_app(config: RouterConfig, dispatcher: Dispatcher | None = None) -> FastAPI:
    """The router's app; `dispatcher` replaces the one built from `config` (tests).

    Loads the tokenizer now, so a bad checkpoint directory fails here, not at startup."""
    serving = ServingContext.create(config, dispatcher)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        serving.dispatcher.start()
        serving.controller.start()
        yield
        await serving.controller.close()
        await serving.dispatcher.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.serving = serving
    register_error_handlers(app)
    app.middleware("http")(_body_limit(config.max_request_bytes))
    app.include_router(ops_routes)
    # A dependency, not a middleware, so an unknown path is still a 404 without a key.
    auth = [] if config.api_key is None else [Depends(_api_key_check(config.api_key))]
    app.include_router(openai_routes, dependencies=auth)
    return app


def _body_limit(max_request_bytes: int) -> Callable[[Request, CallNext], Awaitable[Response]]:
    """Refuses a body over the limit by its Content-Length, before reading it."""

    async def limit_body(request: Request, call_next: CallNext) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            return error_response(413, f"request body of {length} bytes exceeds the limit of "
                                       f"{max_request_bytes} bytes")
        return await call_next(request)

    return limit_body


def _api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    async def check_api_key(request: Request) -> None:
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    return check_api_key
