"""The request body limit, counted on the bytes as they arrive: a declared Content-Length over
the limit is refused before anything is read, and a body without one (chunked transfer
encoding) is cut off with the same 413 as soon as it passes the limit, so no body larger than
the limit is ever buffered.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware), since only a wrapper of
`receive` sees a chunked body's bytes before the endpoint buffers them all.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.errors import error_response


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes the limit. An HTTPException, so FastAPI's
    body reading passes it on as is (it turns other errors there into a 400) and the app's
    handler answers it with the OpenAI-style 413."""

    def __init__(self, max_request_bytes: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {max_request_bytes} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            response = error_response(
                413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes"
            )
            await response(scope, receive, send)
            return
        num_received = 0
        is_response_started = False

        async def counted_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal is_response_started
            is_response_started = is_response_started or message["type"] == ("http.response.start")
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as exc:
            # Reached only where no exception handler answered it (a body read outside an
            # endpoint); a response already under way cannot be replaced.
            if is_response_started:
                raise
            await error_response(413, str(exc.detail))(scope, receive, send)
