"""Reading a request body with a bound on its size, and on what all bodies in flight hold
together."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from api.auth import Principal
from api.errors import ApiError
from shared.errors import FieldError

__all__ = ["ANONYMOUS", "SMALL_BODY_BYTES", "WEBHOOKS", "BodyBudget", "holder_of", "read_body"]

# Bodies up to this size are counted apart from bigger ones: big uploads under way never
# keep an IDE's job or a stdin frame out.
SMALL_BODY_BYTES = 256 * 1024
RETRY_AFTER_MS = 1000
# Whom a body is counted against besides its pool (BodyBudget.body's `holder`): None for the
# API token's holder (the deployment's own backend), which may use either pool whole; a job
# token's caller ("job:<id>"); ANONYMOUS, a body read before any token (a channel auth with
# its token in the body); or WEBHOOKS, soketi's signed webhooks, read before their signature
# can be checked. Those two have a share each: bodies sent as webhooks by anyone (the app key
# they name is public) must not keep a browser's channel auth out, nor the other way round.
ANONYMOUS = "anonymous"
WEBHOOKS = "webhooks"
# Of each pool: what all job tokens' bodies may hold together, and one job token's; what all
# bodies read before a token may hold. A browser's stdin frames trickled in over a few hundred
# connections held the whole small pool (every execute a 503), and their request heads alone,
# declaring 512 KiB each, the whole big one.
JOB_TOKENS_SHARE = 2
ONE_JOB_TOKEN_SHARE = 16
ANONYMOUS_SHARE = 16


def holder_of(principal: Principal) -> str | None:
    """Whom a body sent with `principal`'s token counts against (see ANONYMOUS)."""
    return principal.caller if principal.job_id is not None else None


class BodyBudget:
    """The bytes of request bodies this API process holds at once. Without a bound, clients
    sending many bodies at once (large executes, or thousands of small bodies trickled in
    over as many connections) could hold the process's memory many times over, and every
    client would lose the API with it.

    Two pools: big bodies (past SMALL_BODY_BYTES) count what they declare from their first
    byte; small ones count what has arrived. Either is counted until its handler returns
    (`body`) or until it is read (`read`), and a body that would pass its pool, or its
    holder's share of it (see JOB_TOKENS_SHARE), is a 503 with `retryAfterMs`, read no
    further. A small body is in one read, so counting it costs nothing when nobody is
    trickling bodies in."""

    def __init__(self, max_bytes: int, small_max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.small_max_bytes = small_max_bytes
        self.held = 0
        self.small_held = 0
        # (pool, "job tokens" / a job token's caller / ANONYMOUS / WEBHOOKS) -> bytes held.
        self._shares: dict[tuple[bool, str], int] = {}

    @contextlib.asynccontextmanager
    async def body(
        self, request: Request, limit: int, too_big: ApiError | None = None, holder: str | None = None
    ) -> AsyncIterator[bytes]:
        """The whole body (read_body's checks), counted until the block ends, against
        `holder`'s share too (see ANONYMOUS)."""
        big = small = 0

        def count(size: int, arrived: bool) -> None:
            nonlocal big, small
            if size > SMALL_BODY_BYTES or big:
                wanted = size - big
                if wanted > 0:
                    self._take(True, wanted, holder, limit)
                    big += wanted
                if small:
                    # (A body of no declared size that grew big moves to the other pool.)
                    self._give(False, small, holder)
                    small = 0
            elif arrived and size > small:
                self._take(False, size - small, holder, limit)
                small = size

        try:
            yield await read_body(request, limit, count, too_big)
        finally:
            self._give(True, big, holder)
            self._give(False, small, holder)

    async def read(
        self, request: Request, limit: int, too_big: ApiError | None = None, holder: str | None = None
    ) -> bytes:
        """The whole body, counted while it arrives: for bodies handled at once once read."""
        async with self.body(request, limit, too_big, holder) as body:
            return body

    def _limits(self, big: bool, holder: str | None, body_limit: int = 0) -> list[tuple[str, int]]:
        """The shares a holder's body counts against, each at least one body of the largest
        size the route takes (`body_limit`), so that one always gets in when nothing else of
        that holder's is in flight."""
        pool = self.max_bytes if big else self.small_max_bytes
        if holder is None:
            return []
        if holder in (ANONYMOUS, WEBHOOKS):
            return [(holder, max(pool // ANONYMOUS_SHARE, body_limit))]
        return [
            ("job tokens", max(pool // JOB_TOKENS_SHARE, body_limit)),
            (holder, max(pool // ONE_JOB_TOKEN_SHARE, body_limit)),
        ]

    def _take(self, big: bool, wanted: int, holder: str | None, body_limit: int) -> None:
        held, most = (self.held, self.max_bytes) if big else (self.small_held, self.small_max_bytes)
        shares = self._limits(big, holder, body_limit)
        if held + wanted > most or any(self._shares.get((big, name), 0) + wanted > cap for name, cap in shares):
            raise _busy("large " if big else "")
        if big:
            self.held += wanted
        else:
            self.small_held += wanted
        for name, _cap in shares:
            self._shares[(big, name)] = self._shares.get((big, name), 0) + wanted

    def _give(self, big: bool, size: int, holder: str | None) -> None:
        if not size:
            return
        if big:
            self.held -= size
        else:
            self.small_held -= size
        for name, _cap in self._limits(big, holder):
            left = self._shares[(big, name)] - size
            if left:
                self._shares[(big, name)] = left
            else:
                del self._shares[(big, name)]


def _busy(kind: str = "") -> ApiError:
    return ApiError(
        503,
        f"Too many {kind}requests are being received at once; retry shortly",
        headers={"Retry-After": str(max(1, RETRY_AFTER_MS // 1000))},
        retryAfterMs=RETRY_AFTER_MS,
    )


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
    request: Request, limit: int, count: Callable[[int, bool], None] | None = None, too_big: ApiError | None = None
) -> bytes:
    """The whole body; 413 past `limit` bytes (declared or streamed), before more is read
    (`too_big`, when the route says more than the limit). `count` is told the declared size
    (arrived False), then the size so far as the body arrives (it may raise to refuse the
    body)."""
    too_big = too_big or ApiError(
        413, f"Request body must be at most {limit} bytes", details=[FieldError("body", f"must be at most {limit} bytes")]
    )
    declared = declared_length(request)
    if declared is not None:
        if declared > limit:
            raise too_big
        if count is not None:
            count(declared, False)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        if count is not None:
            count(size, True)
        chunks.append(chunk)
    return b"".join(chunks)
