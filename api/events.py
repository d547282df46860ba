"""`GET /v1/jobs/:id/events`: the durable event log as Server-Sent Events.

Every event a job ever emitted is in its Redis stream, so a client that subscribed late,
or lost its WebSocket, fetches exactly what it missed: `Last-Event-ID` (or `?after=`)
names the last seq it has, the stream resumes after it, and it ends after `result`. A
resume from the result or later is a 204 (No Content), which ends an EventSource for good.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from api.state import AppState
from api.store import JobStore, StoredStatus
from api.streams import EventPace, StreamSlot, StreamSlots
from shared.errors import FieldError, ValidationError
from shared.eventlog import entry_json
from shared.messages import TERMINAL_STATES

__all__ = ["job_events"]

T = TypeVar("T")

BLOCK_MS = 15000


_SEQ = re.compile(r"-?[0-9]{1,18}")


def _after(request: Request) -> int:
    field, raw = "Last-Event-ID", request.headers.get("last-event-id")
    if not raw:
        field, raw = "after", request.query_params.get("after")
    if raw is None or raw == "":
        return -1
    if not _SEQ.fullmatch(raw):
        raise ValidationError([FieldError(field, "must be an integer event seq (Last-Event-ID or ?after=)")])
    return int(raw)


async def _stream(
    store: JobStore,
    job_id: str,
    after_seq: int,
    pace: EventPace,
    pace_key: str,
    draining: asyncio.Event | None = None,
    caller: str | None = None,
) -> AsyncIterator[bytes]:
    draining = draining or asyncio.Event()
    # A resume starts where the client left off, not at the log's first entry.
    cursor = await store.seek_events(job_id, after_seq) if after_seq >= 0 else "0"
    backlog = True
    while True:
        if backlog:
            entries = await store.events(job_id, cursor, None)
        else:
            entries = await _unless_draining(store.events(job_id, cursor, BLOCK_MS), draining)
            if entries is None:
                # This process is stopping (api/__main__.py): the stream ends, and its
                # EventSource comes back in a second with Last-Event-ID, to another process
                # or to this one restarted.
                yield b"retry: 1000\n\n"
                return
        if backlog and not entries:
            backlog = False
            if _over(await store.status(job_id), after_seq):
                return
            continue
        if not entries:
            yield b": keep-alive\n\n"
            if _over(await store.status(job_id), after_seq):
                return
            continue
        await pace.spend(pace_key, len(entries), caller)
        for entry_id, seq, name, fields in entries:
            cursor = entry_id
            if seq > after_seq:
                yield b"id: %d\nevent: %s\ndata: %s\n\n" % (seq, name.encode(), entry_json(seq, fields))
            if name == "result":
                return


def _over(status: StoredStatus | None, after_seq: int) -> bool:
    """Nothing more can come: the job is gone, ended without a result in its log, or ended
    with its result at or before the client's cursor (the result landed between the 204
    check and the seek, which then began past it)."""
    if status is None:
        return True
    if status.state not in TERMINAL_STATES:
        return False
    return status.result is None or status.result.seq <= after_seq


_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class _AdmittedStream(StreamingResponse):
    """A stream that gives its slot back however it ends (result, client gone, error)."""

    def __init__(self, body: AsyncIterator[bytes], slot: StreamSlot) -> None:
        super().__init__(body, media_type="text/event-stream", headers=_HEADERS)
        self._body = body
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()
            await self._body.aclose()  # type: ignore[attr-defined]


async def job_events(request: Request) -> Response:
    """SSE of every event of the job after `Last-Event-ID`/`?after=`; ends after `result`.

    Refused before any byte of the stream: 429 past the per-job or per-caller bound, 503
    when every stream of this process is in use (see api/streams.py).
    """
    state: AppState = request.app.state.coderunner
    slots: StreamSlots = request.app.state.event_streams
    status = await state.visible_job(request, url_token=True)
    after_seq = _after(request)
    if status.result is not None and after_seq >= status.result.seq:
        # The client has the result already: nothing will ever follow. A 204 makes a
        # browser's EventSource stop; an empty 200 would have it reconnect every few seconds.
        return Response(status_code=204)
    principal = state.auth.principal(request, url_token=request.query_params.get("token"))
    if request.method == "HEAD":
        # What a GET would answer, without its body: streamed, a HEAD would hold a stream
        # slot and its connection until the job ends, for bytes the server throws away.
        slots.check(status.job_id, principal.caller)
        return Response(media_type="text/event-stream", headers=_HEADERS)
    slot = slots.acquire(status.job_id, principal.caller)
    pace: EventPace = request.app.state.event_pace
    # (Paced by the job's owner, whose token and every job token it was given share a
    # bucket: keyed by caller, each job token's own full bucket multiplied the pace. A job
    # token spends a share of its own first, so that one cannot take all of it.)
    paced_as = status.owner or principal.caller
    token = principal.caller if principal.job_id is not None else None
    draining: asyncio.Event = request.app.state.draining
    body = _stream(state.store, status.job_id, after_seq, pace, paced_as, draining, token)
    return _AdmittedStream(body, slot)


async def _unless_draining(read: Coroutine[Any, Any, T], draining: asyncio.Event) -> T | None:
    """`read`'s answer, or None once `draining` is set first (the read cancelled)."""
    if draining.is_set():
        read.close()
        return None
    reading = asyncio.ensure_future(read)
    stop = asyncio.ensure_future(draining.wait())
    try:
        await asyncio.wait({reading, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reading, stop):
            task.cancel()
        await asyncio.gather(reading, stop, return_exceptions=True)
    if reading.done() and not reading.cancelled():
        return reading.result()
    return None
