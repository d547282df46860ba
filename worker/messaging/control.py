"""Per-job control channels (`ctrl:<id>`, `stdin:<id>`) over one shared pub/sub connection.

A single reader task dispatches messages to the job that subscribed. `subscribe` returns
only once Redis has confirmed both channels, so a caller that checks the durable start
flag afterwards cannot miss a start published in between.

Pub/sub is only the fast path: every signal it carries is also stored (the start flag,
the kill flag, the stdin stream), and a job re-reads those when a message may be missing.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from shared import keys
from shared.codec import decode_stored
from shared.messages import CtrlMessage, StdinFrame
from worker.tasks import cancel_and_wait, raise_if_cancelled

__all__ = ["ControlBus", "Subscription"]

log = logging.getLogger(__name__)



class _CountingPubSub(PubSub):
    """Counts (re)connections: messages published while it was disconnected are lost, so a
    new connection tells parked jobs to re-read their durable flags."""

    connections = 0

    async def on_connect(self, connection):  # type: ignore[no-untyped-def]
        self.connections += 1
        await super().on_connect(connection)


class Subscription:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.ctrl: asyncio.Queue[CtrlMessage] = asyncio.Queue()
        self.stdin: asyncio.Queue[StdinFrame] = asyncio.Queue()
        self._confirmed: dict[str, asyncio.Future[None]] = {}


class ControlBus:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pubsub = _CountingPubSub(redis.connection_pool, ignore_subscribe_messages=False)
        self._subs: dict[str, Subscription] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def generation(self) -> int:
        """How many times the pub/sub connection was (re)established."""
        return self._pubsub.connections

    async def start(self) -> None:
        # A placeholder subscription keeps the connection in pub/sub mode for the reader.
        await self._pubsub.subscribe("ctrl:__worker__")
        self._reader = asyncio.create_task(self._read(), name="control-reader")

    async def aclose(self) -> None:
        if self._reader is not None:
            await cancel_and_wait([self._reader])
        await self._pubsub.aclose()

    async def subscribe(self, job_id: str, timeout_s: float = 5.0) -> Subscription:
        sub = Subscription(job_id)
        channels = (keys.ctrl_channel(job_id), keys.stdin_channel(job_id))
        loop = asyncio.get_running_loop()
        for channel in channels:
            sub._confirmed[channel] = loop.create_future()
            self._subs[channel] = sub
        try:
            async with self._lock:
                await self._pubsub.subscribe(*channels)
            await asyncio.wait_for(asyncio.gather(*sub._confirmed.values()), timeout_s)
        except BaseException:
            await self.unsubscribe(sub)
            raise
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        channels = (keys.ctrl_channel(sub.job_id), keys.stdin_channel(sub.job_id))
        for channel in channels:
            self._subs.pop(channel, None)
        try:
            async with self._lock:
                await self._pubsub.unsubscribe(*channels)
        except RedisError as exc:
            log.warning("job %s: unsubscribe failed: %s", sub.job_id, exc)

    async def _read(self) -> None:
        while True:
            raise_if_cancelled()
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except RedisError as exc:
                log.warning("control channel error: %s; reconnecting", exc)
                await asyncio.sleep(0.5)
                continue
            if message is None:
                continue
            channel = message["channel"].decode() if isinstance(message["channel"], bytes) else message["channel"]
            sub = self._subs.get(channel)
            if sub is None:
                continue
            kind = message["type"]
            if kind == "subscribe":
                future = sub._confirmed.get(channel)
                if future is not None and not future.done():
                    future.set_result(None)
                continue
            if kind != "message":
                continue
            try:
                if channel.startswith("ctrl:"):
                    sub.ctrl.put_nowait(decode_stored(CtrlMessage, message["data"]))
                else:
                    sub.stdin.put_nowait(decode_stored(StdinFrame, message["data"]))
            except msgspec.MsgspecError:
                log.warning("job %s: ignored malformed control message on %s", sub.job_id, channel)
