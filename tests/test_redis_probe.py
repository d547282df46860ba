"""RedisProbe (worker/messaging/probe.py): a stopping worker's one question to Redis, against
a real redis-server that is up, killed and frozen on purpose."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff

from leanredis import LeanRedis
from tests.test_leanredis import Server
from worker.messaging.probe import RedisProbe


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _client(server: Server) -> LeanRedis:
    # The worker's command client retries for seconds; the probe must not.
    return LeanRedis.from_url(server.url, socket_timeout=5, retry=Retry(ConstantBackoff(1.0), 8))


async def test_redis_up_answers_and_redis_down_does_not_at_once(server: Server) -> None:
    client = _client(server)
    try:
        probe = RedisProbe(client, timeout_s=1.0, remember_away_s=0.2)
        assert await probe.answers()
        server.stop()
        began = time.monotonic()
        assert not await probe.answers()
        assert time.monotonic() - began < 0.5
        server.start()
        assert not await probe.answers()  # "away" stands a moment: the stop's next steps
        await asyncio.sleep(0.25)
        assert await probe.answers()  # then Redis is asked again
    finally:
        await client.aclose()


async def test_callers_asking_together_share_one_ping_and_a_frozen_redis_costs_its_bound_once(server: Server) -> None:
    client = _client(server)
    pings = 0
    ping_once = client.ping_once

    async def counted() -> None:
        nonlocal pings
        pings += 1
        await ping_once()

    client.ping_once = counted  # type: ignore[method-assign]
    try:
        probe = RedisProbe(client, timeout_s=0.3, remember_away_s=5.0)
        assert await probe.answers()
        server.pause()
        try:
            began = time.monotonic()
            # A stop hands back every parked job at once, then recovers and unregisters.
            answers = await asyncio.gather(*(probe.answers() for _ in range(50)))
            assert answers == [False] * 50
            assert not await probe.answers()
            took = time.monotonic() - began
        finally:
            server.resume()
        assert pings == 2
        assert 0.25 < took < 1.0
    finally:
        await client.aclose()
