"""The API's own, rare publishes to soketi: a result the API wrote itself.

Workers publish every event of the jobs they hold. The one result the API writes (a kill
that ended a job no worker held yet) is published from here, so a client following the
channel learns of it like of any other result, as are a late subscriber's replays
(api/webhooks.py). Best effort, like every live delivery: the durable log already holds it.
And the one question the API asks soketi: which job channels have subscribers
(api/sweeper.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

import httpx
import msgspec

from shared import keys
from shared.pusher import signed_query
from shared.settings import Settings

__all__ = ["MAX_BATCH", "Owed", "RealtimePublisher"]

# Events in one batch_events request (the Pusher HTTP API's own limit, which soketi keeps).
MAX_BATCH = 10
# Publishes under way at once, and waiting for their turn, per API process. Past the second,
# one is not sent: what it owed stays owed, for a sweep (api/sweeper.py). Unbounded, a flood
# of them (a client subscribing in a loop) wedged the HTTP client's pool for good.
MAX_PUBLISHING = 8
MAX_PUBLISHES_WAITING = 1000

log = logging.getLogger(__name__)


class Owed(Protocol):
    """Events owed a job's channel until soketi took them (api.store.OwedPublish)."""

    events: list[tuple[str, bytes]]

    async def confirm(self, posts: int) -> bool: ...

    async def settle(self) -> None: ...


class RealtimePublisher:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._path = f"/apps/{settings.pusher_app_id}/events"
        self._batch_path = f"/apps/{settings.pusher_app_id}/batch_events"
        self._channels_path = f"/apps/{settings.pusher_app_id}/channels"
        self._client = httpx.AsyncClient(
            base_url=f"{settings.pusher_scheme}://{settings.pusher_host}:{settings.pusher_port}",
            timeout=settings.pusher_timeout_ms / 1000,
            limits=httpx.Limits(max_connections=MAX_PUBLISHING, max_keepalive_connections=MAX_PUBLISHING),
        )
        self._pending: set[asyncio.Task[None]] = set()
        self._turns = asyncio.Semaphore(MAX_PUBLISHING)
        self._listing_failed = False

    def publish_soon(self, channel: str, owed: Owed) -> None:
        """Publish `owed.events` (name, JSON) in order, in the background: the HTTP answer
        does not wait for soketi. Once its turn comes, only if still owed by this process (a
        sweep may have taken it meanwhile), and settled once the last of them (the result)
        went; if it did not, it stays owed for a sweep to send (api/sweeper.py)."""
        if len(self._pending) >= MAX_PUBLISHES_WAITING:
            log.warning("%d publishes to soketi waiting: %s not sent now", len(self._pending), channel)
            return
        task = asyncio.create_task(self._publish_owed(channel, owed))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish_owed(self, channel: str, owed: Owed) -> None:
        async with self._turns:
            try:
                if not await owed.confirm(math.ceil(len(owed.events) / MAX_BATCH)):
                    return  # (a sweep took it: it sends the result)
            except Exception as exc:  # (Redis away: a sweep sends it once due)
                log.warning("before publishing on %s: %s", channel, exc)
                return
            went = await self._publish(channel, owed.events)
        if went:
            try:
                await owed.settle()
            except Exception as exc:  # (Redis away: a sweep publishes the result once more)
                log.warning("after publishing on %s: %s", channel, exc)

    async def occupied_jobs(self) -> list[str] | None:
        """The ids of the jobs whose channels have subscribers now, as soketi counts them
        (all its nodes, with its Redis adapter); None when soketi does not say."""
        query = signed_query(
            "GET", self._channels_path, b"", self._settings.pusher_key, self._settings.pusher_secret, int(time.time()),
            extra={"filter_by_prefix": keys.CHANNEL_PREFIX},
        )  # fmt: skip
        try:
            async with self._turns:  # (a connection of the pool, like a publish)
                response = await self._client.get(self._channels_path, params=query)
            channels = response.json()["channels"] if response.status_code == 200 else None
            why = "" if isinstance(channels, dict) else f"{response.status_code} {response.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            channels, why = None, str(exc) or type(exc).__name__
        if not isinstance(channels, dict):
            if not self._listing_failed:  # (once until it answers again: asked every sweep)
                log.warning("soketi did not list its channels: %s", why)
            self._listing_failed = True
            return None
        self._listing_failed = False
        return [job_id for name in channels if (job_id := keys.job_id_from_channel(name)) is not None]

    async def publish(self, channel: str, events: list[tuple[str, bytes]]) -> bool:
        """One request per MAX_BATCH events (soketi keeps a batch's order), so a slow soketi
        costs one timeout, not one per event. After a batch that did not go, only the result
        still goes, if it was not in that batch; the follower sees the gap in `seq` and reads
        the log. Whether the last request went (soketi took it): the one with the result.
        At most MAX_PUBLISHING at once: the others wait for their turn."""
        async with self._turns:
            return await self._publish(channel, events)

    async def _publish(self, channel: str, events: list[tuple[str, bytes]]) -> bool:
        for start in range(0, len(events), MAX_BATCH):
            if not await self._post(channel, events[start : start + MAX_BATCH]):
                later = [event for event in events[start + MAX_BATCH :] if event[0] == "result"]
                return bool(later) and await self._post(channel, later)
        return True

    async def _post(self, channel: str, events: list[tuple[str, bytes]]) -> bool:
        # Pusher's `data` is a string holding the event's JSON.
        items = [{"name": name, "channel": channel, "data": data.decode()} for name, data in events]
        path, body = (
            (self._path, msgspec.json.encode(items[0]))
            if len(items) == 1
            else (self._batch_path, msgspec.json.encode({"batch": items}))
        )
        query = signed_query("POST", path, body, self._settings.pusher_key, self._settings.pusher_secret, int(time.time()))
        names = ",".join(name for name, _ in events)
        try:
            response = await self._client.post(path, params=query, content=body, headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            log.warning("soketi unreachable while publishing %s on %s: %s", names, channel, str(exc) or type(exc).__name__)
            return False
        if response.status_code >= 400:
            log.warning("soketi refused %s on %s: %s %s", names, channel, response.status_code, response.text[:200])
            return False
        return True

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=self._settings.pusher_timeout_ms / 1000)
        # Those still waiting for their turn stay owed in Redis (a sweep sends them), and must
        # not reach the client once it is closed.
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.wait(self._pending)
        await self._client.aclose()

