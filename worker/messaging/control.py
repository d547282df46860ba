"""Per-job control channels (`ctrl:<id>`, `stdin:<id>`) over one shared pub/sub connection.

Each message goes to the job that subscribed as soon as it is parsed (leanredis.subscriber).
`subscribe` returns only once Redis has confirmed both channels, so a caller that checks the
durable start flag afterwards cannot miss a start published in between.

Pub/sub is only the fast path: every signal it carries is also stored (the start flag,
the kill flag, the stdin stream), and a job re-reads those when a message may be missing.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from leanredis import LeanRedis
from leanredis.subscriber import Subscriber
from shared import keys
from shared.codec import decode_stored
from shared.messages import CtrlMessage, StdinFrame

__all__ = ["ControlBus", "Subscription"]

log = logging.getLogger(__name__)


class Subscription:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.ctrl: asyncio.Queue[CtrlMessage] = asyncio.Queue()
        self.stdin: asyncio.Queue[StdinFrame] = asyncio.Queue()
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        # ControlBus.generation when the subscription was asked for: a different one later
        # means the connection was replaced since, and messages may have been lost.
        self.generation = 0


class ControlBus:
    def __init__(self, redis: LeanRedis) -> None:
        self._subscriber = Subscriber(redis, self._on_message)
        self._subs: dict[str, Subscription] = {}

    @property
    def generation(self) -> int:
        """How many times the pub/sub connection was (re)established."""
        return self._subscriber.connections

    async def start(self) -> None:
        await self._subscriber.start()

    async def aclose(self) -> None:
        await self._subscriber.aclose()

    async def subscribe(self, job_id: str, timeout_s: float = 5.0) -> Subscription:
        sub = Subscription(job_id)
        sub.generation = self.generation
        channels = (keys.ctrl_channel(job_id), keys.stdin_channel(job_id))
        loop = asyncio.get_running_loop()
        for channel in channels:
            sub._confirmed[channel] = loop.create_future()
            self._subs[channel] = sub
        try:
            self._subscriber.subscribe(*channels)
            await asyncio.wait_for(asyncio.gather(*sub._confirmed.values()), timeout_s)
        except BaseException:
            await self.unsubscribe(sub)
            raise
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        channels = (keys.ctrl_channel(sub.job_id), keys.stdin_channel(sub.job_id))
        for channel in channels:
            self._subs.pop(channel, None)
        self._subscriber.unsubscribe(*channels)

    def _on_message(self, kind: bytes, raw_channel: bytes, data: bytes | int) -> None:
        channel = raw_channel.decode()
        sub = self._subs.get(channel)
        if sub is None:
            return
        if kind == b"subscribe":
            future = sub._confirmed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
            return
        if kind != b"message":
            return
        try:
            if channel.startswith("ctrl:"):
                sub.ctrl.put_nowait(decode_stored(CtrlMessage, data))  # type: ignore[arg-type]
            else:
                sub.stdin.put_nowait(decode_stored(StdinFrame, data))  # type: ignore[arg-type]
        except msgspec.MsgspecError:
            log.warning("job %s: ignored malformed control message on %s", sub.job_id, channel)
