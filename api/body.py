"""Reading a request body with a bound on its size."""

from __future__ import annotations

from starlette.requests import Request

from api.errors import ApiError

__all__ = ["read_body"]


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; 413 past `limit` bytes (declared or streamed), before more is read."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"Request body must be at most {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"Request body must be at most {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
