"""Reading a request body with a bound on its size, and on what all big bodies in flight
hold together."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from api.errors import ApiError

__all__ = ["SMALL_BODY_BYTES", "BodyBudget", "read_body"]

# Bodies up to this size are never counted: an IDE's job or a stdin frame always gets in.
SMALL_BODY_BYTES = 256 * 1024
RETRY_AFTER_MS = 1000


class BodyBudget:
    """The bytes of big request bodies (past SMALL_BODY_BYTES) this API process holds at
    once, from their first byte until their handler returns: without a bound, a client
    sending many large executes at once (up to MAX_REQUEST_BYTES each) could hold the
    process's memory many times over, and every client would lose the API with it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    @contextlib.asynccontextmanager
    async def body(self, request: Request, limit: int, too_big: ApiError | None = None) -> AsyncIterator[bytes]:
        """The whole body (read_body's checks), counted against the budget until the block
        ends, by what it declares or else by what has arrived; a 503 with `retryAfterMs`
        when it would pass the budget, read no further."""
        taken = 0

        def count(size: int) -> None:
            nonlocal taken
            wanted = size - taken if size > SMALL_BODY_BYTES else 0
            if wanted <= 0:
                return
            if self.held + wanted > self.max_bytes:
                raise ApiError(
                    503,
                    "Too many large requests are being received at once; retry shortly",
                    headers={"Retry-After": str(max(1, RETRY_AFTER_MS // 1000))},
                    retryAfterMs=RETRY_AFTER_MS,
                )
            self.held += wanted
            taken += wanted

        try:
            yield await read_body(request, limit, count, too_big)
        finally:
            self.held -= taken


def declared_length(request: Request) -> int | None:
    """The body size the request declares (Content-Length), or None. Leading zeros are fine
    (HTTP allows them, and the parser does not refuse a long run of them): a length of more
    than 18 digits counts as more than any limit, before int() refuses to read it at all."""
    declared = request.headers.get("content-length")
    if not declared or not (declared.isascii() and declared.isdigit()):
        return None
    digits = declared.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else 10**18


async def read_body(
    request: Request, limit: int, count: Callable[[int], None] | None = None, too_big: ApiError | None = None
) -> bytes:
    """The whole body; 413 past `limit` bytes (declared or streamed), before more is read
    (`too_big`, when the route says more than the limit). `count` is told the declared size,
    then the size so far as the body arrives (it may raise to refuse the body)."""
    too_big = too_big or ApiError(413, f"Request body must be at most {limit} bytes")
    declared = declared_length(request)
    if declared is not None:
        if declared > limit:
            raise too_big
        if count is not None:
            count(declared)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        if count is not None:
            count(size)
        chunks.append(chunk)
    return b"".join(chunks)
