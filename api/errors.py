"""One error envelope for every failure: `{"error": "<sentence>", "details": [...]}`."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import msgspec
from redis.exceptions import OutOfMemoryError, RedisError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from shared.errors import FieldError, ValidationError, detail_json

__all__ = ["ApiError", "error_response", "exception_handlers"]

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An HTTP error with a human sentence, optional field details and extra body fields."""

    def __init__(
        self,
        status: int,
        message: str,
        details: list[FieldError] | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details or []
        self.headers = headers or {}
        self.extra = extra


def error_response(
    status: int, message: str, details: list[FieldError] | None = None, headers: dict[str, str] | None = None, **extra: Any
) -> Response:
    body: dict[str, Any] = {"error": message, "details": [detail_json(detail) for detail in details or ()]}
    body.update(extra)
    return Response(_encoder.encode(body), status_code=status, media_type="application/json", headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    exc = cast(ApiError, exc)
    return error_response(exc.status, exc.message, exc.details, exc.headers, **exc.extra)


async def _validation_error(request: Request, exc: Exception) -> Response:
    exc = cast(ValidationError, exc)
    return error_response(400, exc.sentence, exc.details)


async def _http_exception(request: Request, exc: Exception) -> Response:
    exc = cast(HTTPException, exc)
    messages = {404: "Not found", 405: "Method not allowed"}
    return error_response(exc.status_code, messages.get(exc.status_code, str(exc.detail)), headers=exc.headers)


class _Sparse:
    """A log line said at most once every `interval_s`, with how many went unsaid since: a
    fault every request meets (Redis away) is one fault, however busy the API is."""

    def __init__(self, level: int, interval_s: float = 10.0) -> None:
        self._level = level
        self._interval_s = interval_s
        self._next = float("-inf")
        self._unsaid = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._unsaid += 1
            return
        if self._unsaid:
            message += " (and %d more since the last report)"
            args = (*args, self._unsaid)
        log.log(self._level, message, *args)
        self._next, self._unsaid = now + self._interval_s, 0


_say_redis_full = _Sparse(logging.ERROR)
_say_redis_away = _Sparse(logging.WARNING)


async def _redis_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, OutOfMemoryError):
        # At its maxmemory (with noeviction, the setting the README asks for) Redis refuses
        # every write until results and records expire: not a blip, and not the client's fault.
        _say_redis_full("redis is full (maxmemory) during %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, "The service's storage is full; retry later", retryAfterMs=5000)
    _say_redis_away("redis unavailable during %s %s: %s", request.method, request.url.path, exc)
    return error_response(503, "Redis is unavailable; retry shortly", retryAfterMs=1000)


async def _client_gone(request: Request, exc: Exception) -> Response:
    # The client left (or was cut off by a read timeout, api/server.py) while its body was
    # being read: nobody will see this answer, and it is no server error.
    log.info("client went away during %s %s", request.method, request.url.path)
    return error_response(400, "The client disconnected before the request body was complete")


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "Internal server error")


exception_handlers: dict[Any, Any] = {
    ApiError: _api_error,
    ValidationError: _validation_error,
    HTTPException: _http_exception,
    RedisError: _redis_error,
    ClientDisconnect: _client_gone,
    Exception: _unexpected,
}
