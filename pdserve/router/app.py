"""The OpenAI-compatible front door: the FastAPI app that puts the router's pieces together.

    errors.py     OpenAI-style error bodies and the app's exception handlers
    body_limit.py the request body limit (413), chunked bodies included
    routes.py     the endpoints: tokenize, check, admit (ServingContext holds their state)
    tokenize_routes.py  vLLM's /tokenize, /detokenize and /version
    streaming.py  worker outputs → SSE chunks or one response, with per-request timing

The router never imports model code: workers do the math, the router does the talking.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from pdserve.router.body_limit import BodyLimit
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.errors import ApiError, register_error_handlers
from pdserve.router.routes import ServingContext, health_routes, openai_routes, ops_routes
from pdserve.router.tokenize_routes import tokenize_routes


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
        serving.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.serving = serving
    register_error_handlers(app)
    app.add_middleware(BodyLimit, max_request_bytes=config.max_request_bytes)
    # A dependency, not a middleware, so an unknown path is still a 404 without a key.
    auth = [] if config.api_key is None else [Depends(_api_key_check(config.api_key))]
    app.include_router(health_routes)
    app.include_router(ops_routes, dependencies=auth if config.ops_need_api_key else [])
    app.include_router(openai_routes, dependencies=auth)
    app.include_router(tokenize_routes, dependencies=auth)  # vLLM's, at the root
    return app


def _api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request) -> None:
        # compare_digest: the time taken does not tell how many leading bytes matched
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    return check_api_key
