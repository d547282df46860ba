"""LeanRedis (leanredis/): redis-py's interface over one pipelined connection, against a
real redis-server of the test's own (stopped, killed and restarted on purpose)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from launcher.stack import free_port
from leanredis import BlockingLeanRedis, LeanRedis
from leanredis.scripts import FLAGS_RECHECK_S, OomTolerantScript
from leanredis.subscriber import Subscriber
from tests.helpers import dies_with_the_tests, self_signed_certificate
from worker.messaging.probe import RedisProbe


class Server:
    """A redis-server child in its own process group, on a port of its own."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.port = free_port()
        self.socket = str(tmp / "redis.sock")
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--unixsocket", self.socket, *self.extra]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=dies_with_the_tests(signal.SIGKILL)
        )
        deadline = time.monotonic() + 10
        while not os.path.exists(self.socket):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            if os.path.exists(self.socket):
                os.unlink(self.socket)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def plain(server: Server) -> AsyncIterator[Redis]:
    client = Redis.from_url(server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def lean(server: Server) -> AsyncIterator[LeanRedis]:
    client = LeanRedis.from_url(server.url, socket_timeout=5)
    yield client
    await client.aclose()


async def test_replies_are_redis_pys(plain: Redis, lean: LeanRedis) -> None:
    await plain.set("s", "v")
    await plain.hset("h", mapping={"a": "1", "b": "2"})
    await plain.zadd("z", {"m": 1.5, "n": 2})
    await plain.xadd("x", {"f": "1"}, id="1-1")
    await plain.xadd("x", {"f": "2"}, id="1-2")
    script = "return {KEYS[1], ARGV[1], 7, false, redis.call('GET', KEYS[1])}"
    calls = [
        lambda c: c.get("s"),
        lambda c: c.get("missing"),
        lambda c: c.hmget("h", ["a", "missing", "b"]),
        lambda c: c.hgetall("h"),
        lambda c: c.hget("h", "a"),
        lambda c: c.exists("s", "h", "missing"),
        lambda c: c.getrange("s", 0, 10),
        lambda c: c.zrange("z", 0, -1, withscores=True),
        lambda c: c.xrange("x"),
        lambda c: c.xread({"x": "0-0"}, count=1),
        lambda c: c.xread({"missing": "0-0"}),
        lambda c: c.ttl("s"),
        lambda c: c.config_get("maxmemory*"),
        lambda c: c.register_script(script)(keys=["s"], args=["a"]),
    ]
    for call in calls:
        assert await call(lean) == await call(plain)
    assert await lean.set("t", "1", ex=60) is True
    assert await lean.set("t", "1", nx=True) is None
    assert await lean.incr("n") == 1
    assert await lean.publish("nobody", "x") == 0


async def test_scripts_are_loaded_again_after_a_flush(lean: LeanRedis) -> None:
    script = lean.register_script("return ARGV[1] .. '!'")
    assert await script(args=["a"]) == b"a!"
    await lean.script_flush()
    with pytest.raises(NoScriptError):
        await lean.evalsha(script.sha, 0, "b")
    assert await script(args=["b"]) == b"b!"  # NOSCRIPT: loaded again, sent again


async def test_an_oom_tolerant_script_writes_at_maxmemory(lean: LeanRedis, plain: Redis) -> None:
    await plain.config_set("maxmemory", 1)  # below what the server holds: growing writes are refused
    try:
        text = "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('GET', KEYS[1])"
        with pytest.raises(ResponseError, match="maxmemory"):
            await lean.register_script(text)(keys=["k"], args=["plain"])
        assert await OomTolerantScript(lean, text)(keys=["k"], args=["flagged"]) == b"flagged"
    finally:
        await plain.config_set("maxmemory", 0)


async def test_without_script_flags_the_script_runs_plain(lean: LeanRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    script = OomTolerantScript(lean, "return ARGV[1]")
    tried = []

    async def old_server(keys: object = None, args: object = None) -> None:
        tried.append(args)  # what a Redis before 7 answers the flag line with
        raise ResponseError("Error compiling script (new function): user_script:1: unexpected symbol near '#'")

    flagged, script._flagged = script._flagged, old_server  # type: ignore[assignment]
    assert await script(args=["a"]) == b"a" and await script(args=["b"]) == b"b"
    assert tried == [["a"]]  # found out once
    # Upgraded in place: once FLAGS_RECHECK_S has passed, the flag is tried again and kept.
    upgraded = []

    async def new_server(keys: object = None, args: object = None) -> object:
        upgraded.append(args)
        return await flagged(keys, args)

    script._flagged = new_server  # type: ignore[assignment]
    assert await script(args=["c"]) == b"c" and upgraded == []  # not before the recheck
    later = time.monotonic() + FLAGS_RECHECK_S + 1
    monkeypatch.setattr("leanredis.scripts._clock", lambda: later)
    assert await script(args=["d"]) == b"d" and await script(args=["e"]) == b"e"
    assert upgraded == [["d"], ["e"]]
    # A script that does not compile at all says so, flags or none.
    with pytest.raises(ResponseError, match="compiling"):
        await OomTolerantScript(lean, "return (")()


async def test_pipelines_with_and_without_a_transaction(lean: LeanRedis) -> None:
    async with lean.pipeline(transaction=True) as pipe:
        pipe.set("k", "v")
        pipe.hset("h", "f", "1")
        pipe.hgetall("h")
        pipe.exists("k", "h")
        assert await pipe.execute() == [True, 1, {b"f": b"1"}, 2]
    async with lean.pipeline(transaction=False) as pipe:
        pipe.get("k")
        pipe.incr("k")  # not a number: its error takes its place
        pipe.get("missing")
        got = await pipe.execute(raise_on_error=False)
    assert got[0] == b"v" and isinstance(got[1], ResponseError) and got[2] is None
    async with lean.pipeline(transaction=False) as pipe:
        pipe.exists("k")  # one command: still a list of one reply
        assert await pipe.execute() == [1]
    async with lean.pipeline(transaction=True) as pipe:
        pipe.incr("k")
        with pytest.raises(ResponseError, match="not an integer"):
            await pipe.execute()
    async with lean.pipeline(transaction=True) as pipe:
        pipe.execute_command("SET", "k")  # refused while queueing: the transaction is dropped
        with pytest.raises(ResponseError, match="wrong number of arguments"):  # as redis-py
            await pipe.execute()
    assert await lean.get("k") == b"v"  # and the connection still answers in order


async def test_concurrent_callers_each_get_their_own_reply(lean: LeanRedis) -> None:
    async def one(i: int) -> None:
        assert await lean.incrby(f"c{i % 7}", i) >= i
        await lean.set(f"k{i}", i)
        assert await lean.get(f"k{i}") == str(i).encode()

    async def atomic(i: int) -> None:
        # Each transaction is written in one piece: nothing of another lands between its
        # INCR and its GET.
        async with lean.pipeline(transaction=True) as pipe:
            pipe.incr("shared")
            pipe.get("shared")
            counted, seen = await pipe.execute()
        assert seen == str(counted).encode()

    await asyncio.gather(*(one(i) for i in range(300)), *(atomic(i) for i in range(100)))
    assert await lean.get("shared") == b"100"


async def test_a_cancelled_caller_does_not_shift_the_replies(lean: LeanRedis) -> None:
    await lean.set("k", "v")
    slow = asyncio.ensure_future(lean.blpop(["empty"], timeout=0.3))
    await asyncio.sleep(0.05)
    slow.cancel()
    # Queued behind the BLPOP: its reply (None) comes first and must go to nobody.
    assert await lean.get("k") == b"v"
    assert await lean.hget("nothing", "f") is None
    assert slow.cancelled()


async def test_a_silent_server_fails_every_waiting_command_at_the_timeout(server: Server) -> None:
    client = LeanRedis.from_url(server.url, socket_timeout=0.3)
    try:
        await client.set("k", "v")
        server.pause()
        started = time.monotonic()
        gathered = asyncio.gather(*(client.get("k") for _ in range(5)), return_exceptions=True)
        answers = await asyncio.wait_for(gathered, 5)
        waited = time.monotonic() - started
        assert all(isinstance(a, RedisTimeoutError) for a in answers), answers
        assert len({id(a) for a in answers}) == 5  # one exception each: no shared tracebacks
        assert 0.25 <= waited < 1.5, waited
        server.resume()
        assert await client.get("k") == b"v"  # on a new connection
    finally:
        server.resume()
        await client.aclose()


async def test_a_lost_connection_is_dialled_again_under_the_retry_policy(server: Server, plain: Redis) -> None:
    client = LeanRedis.from_url(server.url, socket_timeout=2, retry=Retry(ConstantBackoff(0.05), 3))
    bare = LeanRedis.from_url(server.url, socket_timeout=2, retry=Retry(NoBackoff(), 0))
    try:
        await client.set("k", "v")
        assert await bare.get("k") == b"v"
        killed = await plain.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 2
        assert await client.get("k") == b"v"
        # With no retries, a command sent before the loss was noticed fails; the next one
        # dials again. Either way nothing hangs.
        try:
            assert await bare.get("k") == b"v"
        except RedisConnectionError:
            assert await bare.get("k") == b"v"
        # The server itself goes away and comes back (empty: no persistence).
        server.stop()
        with pytest.raises(RedisConnectionError):
            await bare.get("k")
        server.start()
        assert await client.get("k") is None
        await client.set("k", "again")
        assert await bare.get("k") == b"again"
    finally:
        await client.aclose()
        await bare.aclose()


async def test_ping_once_answers_at_once_and_never_retries(server: Server, plain: Redis) -> None:
    # A worker on its way out asks once whether Redis is there before its last writes: the
    # client's retry policy (several seconds of backoff) must not apply, but a connection
    # that broke while Redis stayed up must not pass for Redis being down either.
    client = LeanRedis.from_url(server.url, socket_timeout=2, retry=Retry(ConstantBackoff(1.0), 5))
    try:
        await client.ping_once()
        assert await plain.client_kill_filter(_type="normal", skipme=True) >= 1
        await client.ping_once()  # the kept connection had broken: a new one answers
        # The connection lost with the PING itself in flight: sent once more, on a new one.
        lean = client._lean
        assert lean is not None
        send = lean.send

        def lost_in_flight(data: bytes, count: int | None = None) -> asyncio.Future[Any]:
            future = send(data, count)
            lean._end(RedisConnectionError("lost with the PING in flight"))
            return future

        lean.send = lost_in_flight  # type: ignore[method-assign]
        await client.ping_once()
        assert client._lean is not lean
        server.stop()
        began = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await client.ping_once()
        assert time.monotonic() - began < 0.5  # refused: no backoff, no second dial's wait
        server.start()
        await client.ping_once()
        server.pause()
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.ping_once(), 0.3)  # frozen: the caller's bound
        finally:
            server.resume()
        await client.ping_once()
    finally:
        await client.aclose()


# The worker's probe (worker/messaging/probe.py), built on ping_once: a stopping worker's
# one question to Redis.
def _probe_client(server: Server) -> LeanRedis:
    # The worker's command client retries for seconds; the probe must not.
    return LeanRedis.from_url(server.url, socket_timeout=5, retry=Retry(ConstantBackoff(1.0), 8))


async def test_redis_up_answers_and_redis_down_does_not_at_once(server: Server) -> None:
    client = _probe_client(server)
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
    client = _probe_client(server)
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


async def test_password_db_and_unix_socket_from_the_url(tmp_path: Path) -> None:
    server = Server(tmp_path, "--requirepass", "s3cret")
    server.start()
    try:
        tcp = LeanRedis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/3", socket_timeout=5)
        unix = LeanRedis.from_url(f"unix://:s3cret@{server.socket}?db=3", socket_timeout=5)
        admin = Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0")
        wrong = LeanRedis.from_url(f"redis://:nope@127.0.0.1:{server.port}/0", socket_timeout=5)
        try:
            await tcp.set("k", "tcp")
            assert await unix.get("k") == b"tcp"
            assert await admin.get("k") is None  # it went to db 3, not 0
            assert await admin.execute_command("SELECT", 3) and await admin.get("k") == b"tcp"
            with pytest.raises(RedisConnectionError):  # AuthenticationError is one
                await wrong.get("k")
        finally:
            for client in (tcp, unix, admin, wrong):
                await client.aclose()
    finally:
        server.stop()


async def test_pubsub_still_uses_redis_pys_pool(lean: LeanRedis) -> None:
    pubsub = lean.pubsub()
    try:
        await pubsub.subscribe("news")
        assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"  # type: ignore[index]
        assert await lean.publish("news", "hello") == 1
        message = await pubsub.get_message(timeout=2)
        assert message is not None and message["data"] == b"hello"
    finally:
        await pubsub.aclose()


class Heard:
    """What a Subscriber handed to its callback, with a way to wait for one more."""

    def __init__(self) -> None:
        self.items: list[tuple[bytes, bytes, bytes | int]] = []
        self._more = asyncio.Event()

    def __call__(self, kind: bytes, channel: bytes, data: bytes | int) -> None:
        self.items.append((kind, channel, data))
        self._more.set()

    async def wait_for(self, item: tuple[bytes, bytes, bytes | int], times: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until `item` has been heard `times` times in all."""
        async with asyncio.timeout(timeout_s):
            while self.items.count(item) < times:
                self._more.clear()
                await self._more.wait()


@contextlib.asynccontextmanager
async def subscribed(client: LeanRedis, unsubscribe_within_s: float = 0.0) -> AsyncIterator[tuple[Subscriber, Heard]]:
    """A started Subscriber on `client`, and what it hears; closed on the way out."""
    heard = Heard()
    subscriber = Subscriber(
        client, heard, on_ready=lambda: heard(b"ready", b"", 0), unsubscribe_within_s=unsubscribe_within_s
    )
    await subscriber.start()
    try:
        yield subscriber, heard
    finally:
        await subscriber.aclose()


async def test_subscriber_delivers_confirmations_and_messages(lean: LeanRedis) -> None:
    async with subscribed(lean) as (subscriber, heard):
        subscriber.subscribe("a", "b")
        await heard.wait_for((b"subscribe", b"b", 2))
        assert await lean.publish("a", "one") == 1
        await heard.wait_for((b"message", b"a", b"one"))
        subscriber.unsubscribe("a")
        await heard.wait_for((b"unsubscribe", b"a", 1))
        assert await lean.publish("a", "two") == 0
        assert await lean.publish("b", "three") == 1
        await heard.wait_for((b"message", b"b", b"three"))
        assert (b"message", b"a", b"two") not in heard.items
        assert subscriber.connections == 1


async def test_a_channel_is_confirmed_by_its_last_subscribe_only(lean: LeanRedis) -> None:
    # Subscribed, dropped and subscribed again before Redis answered: the first answer must
    # not pass for the last, or the caller would take "subscribed" while the UNSUBSCRIBE
    # between was still to come, and miss what is published in that window.
    async with subscribed(lean) as (subscriber, heard):
        await heard.wait_for((b"ready", b"", 0))
        subscriber.subscribe("a")
        subscriber.unsubscribe("a")
        subscriber.subscribe("a")
        await heard.wait_for((b"subscribe", b"a", 1))
        kinds = [item[0] for item in heard.items if item[1] == b"a"]
        assert kinds == [b"unsubscribe", b"subscribe"], heard.items
        assert await lean.publish("a", "at once") == 1
        await heard.wait_for((b"message", b"a", b"at once"))


async def test_a_dropped_channel_is_unsubscribed_with_the_next_subscribe_or_after_a_while(
    lean: LeanRedis, plain: Redis
) -> None:
    async with subscribed(lean, unsubscribe_within_s=0.5) as (subscriber, heard):
        await heard.wait_for((b"ready", b"", 0))
        subscriber.subscribe("a", "b")
        await heard.wait_for((b"subscribe", b"b", 2))
        assert subscriber._pushes is not None
        transport = subscriber._pushes.transport
        assert transport is not None
        writes: list[bytes] = []
        write = transport.write
        transport.write = lambda data: (writes.append(data), write(data))[-1]  # type: ignore[method-assign]

        # Dropped: nothing is written yet, and what the channel carries meanwhile reaches
        # the owner (who ignores it).
        subscriber.unsubscribe("a")
        await asyncio.sleep(0.05)
        assert writes == []
        assert await plain.publish("a", "late") == 1
        # The next SUBSCRIBE takes the UNSUBSCRIBE along: one write, answered in order.
        subscriber.subscribe("c")
        await heard.wait_for((b"subscribe", b"c", 2))
        assert len(writes) == 1 and writes[0].count(b"UNSUBSCRIBE") == 1 and writes[0].count(b"SUBSCRIBE") == 2
        kinds = [item[:2] for item in heard.items if item[0] != b"message"]
        assert kinds[-2:] == [(b"unsubscribe", b"a"), (b"subscribe", b"c")], heard.items
        assert await plain.publish("a", "gone") == 0

        # With no SUBSCRIBE to go along with, it is written on its own, within the time.
        del writes[:]
        subscriber.unsubscribe("b")
        await heard.wait_for((b"unsubscribe", b"b", 1))
        assert writes == [b"*2\r\n$11\r\nUNSUBSCRIBE\r\n$1\r\nb\r\n"]
        assert await plain.publish("b", "gone") == 0

        # Dropped and wanted again before it went: it was never unsubscribed, and is
        # confirmed again (the owner may be waiting for that).
        del writes[:], heard.items[:]
        subscriber.unsubscribe("c")
        subscriber.subscribe("c")
        await heard.wait_for((b"subscribe", b"c", 1))
        await asyncio.sleep(0.7)  # (past the time: no UNSUBSCRIBE was left owed)
        assert [item[:2] for item in heard.items] == [(b"subscribe", b"c")], heard.items
        assert b"UNSUBSCRIBE" not in b"".join(writes)
        assert await plain.publish("c", "still") == 1

        # A channel dropped just before the connection is replaced is not subscribed again,
        # and its UNSUBSCRIBE is not written on the new connection.
        subscriber.unsubscribe("c")
        await plain.client_kill_filter(_type="pubsub")
        await heard.wait_for((b"ready", b"", 0))
        assert subscriber._drop_timer is None and not subscriber._dropped
        assert await plain.publish("c", "gone") == 0


class _BusyRedis:
    """A Redis that answers -BUSY 50 ms into a script (busy-reply-threshold), with a lean and
    a plain client on it, and a script that loops until killed."""

    def __init__(self, tmp_path: Path) -> None:
        self.server = Server(tmp_path, "--busy-reply-threshold", "50")
        self._looping: asyncio.Future[Any] | None = None
        self._busy: Redis | None = None

    async def __aenter__(self) -> _BusyRedis:
        self.server.start()
        self.lean = LeanRedis.from_url(self.server.url)
        self.plain = Redis.from_url(self.server.url)
        return self

    async def loop_a_script(self) -> None:
        """Start a script that runs until killed, and wait until Redis answers -BUSY."""
        self._busy = Redis.from_url(self.server.url)
        self._looping = asyncio.ensure_future(self._busy.eval("local i = 0 while true do i = i + 1 end", 0))
        await asyncio.sleep(0.3)  # past the threshold

    async def __aexit__(self, *_exc: object) -> None:
        if self._looping is not None:
            self._looping.cancel()
            with contextlib.suppress(BaseException):
                await self._looping
        for client in (self._busy, self.plain, self.lean):
            if client is not None:
                await client.aclose()
        self.server.stop()


async def test_a_subscribe_refused_while_a_script_runs_is_written_again(tmp_path: Path) -> None:
    # Redis refuses SUBSCRIBE with -BUSY while a script runs past busy-reply-threshold: one
    # error for the command, naming no channel. Its channel then waited for an answer that
    # never came (a job's subscription timed out, and every later one for the same channel
    # on this connection swallowed its own answer as the refused one's).
    async with _BusyRedis(tmp_path) as redis, subscribed(redis.lean) as (subscriber, heard):
        await heard.wait_for((b"ready", b"", 0))
        await redis.loop_a_script()
        subscriber.subscribe("a")
        await asyncio.sleep(0.3)
        assert (b"subscribe", b"a", 1) not in heard.items
        await redis.plain.script_kill()
        await heard.wait_for((b"subscribe", b"a", 1))  # written again, answered
        assert await redis.plain.publish("a", "through") == 1
        await heard.wait_for((b"message", b"a", b"through"))
        # The channel's count is right: dropped and taken again, its answer comes.
        subscriber.unsubscribe("a")
        subscriber.subscribe("a")
        await heard.wait_for((b"subscribe", b"a", 1), times=2)
        assert subscriber.connections == 1


async def test_a_ready_mark_answered_after_a_refused_subscribe_stands_for_nothing() -> None:
    """SUBSCRIBE refused (-BUSY), then the script ends before the ready mark (a PING written
    after it) is answered: the mark's answer used to make the connection ready, and its owner
    re-read its durable state, with the channel not subscribed for another 0.1 s, a signal
    published then lost until the next poll. Ready waits for the SUBSCRIBE written again."""
    from leanredis.subscriber import READY_MARK, _Pushes

    written: list[bytes] = []
    transport = SimpleNamespace(write=written.append, is_closing=lambda: False, abort=lambda: None)
    refused: list[tuple[bytes, list[bytes]]] = []
    pushes = _Pushes(lambda *_: None, "test", lambda command, channels: refused.append((command, channels)))
    pushes.transport = transport  # type: ignore[assignment]
    mark = b"*2\r\n$4\r\npong\r\n$%d\r\n%s\r\n" % (len(READY_MARK), READY_MARK)
    pushes.send("SUBSCRIBE", b"a")
    pushes.mark()
    pushes.data_received(b"-BUSY Redis is busy running a script\r\n" + mark)
    assert refused == [(b"SUBSCRIBE", [b"a"])] and not pushes.ready.done()
    pushes.send("SUBSCRIBE", b"a")  # (what Subscriber._subscribe_again writes, with a mark)
    pushes.mark()
    pushes.data_received(b"*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n" + mark)
    assert pushes.ready.done()
    pushes.connection_lost(None)


async def test_a_subscriber_connecting_while_a_script_runs_gets_ready_once_it_ends(tmp_path: Path) -> None:
    # Its SUBSCRIBE and its ready marks all refused, over and over: once the script is
    # killed, the SUBSCRIBE written again and a mark after it make it ready.
    async with _BusyRedis(tmp_path) as redis:
        await redis.loop_a_script()
        heard = Heard()
        subscriber = Subscriber(redis.lean, heard, on_ready=lambda: heard(b"ready", b"", 0))
        subscriber.subscribe("a")
        await subscriber.start()
        try:
            await asyncio.sleep(0.5)
            assert not subscriber.ready
            await redis.plain.script_kill()
            await heard.wait_for((b"ready", b"", 0))
            assert (b"subscribe", b"a", 1) in heard.items and subscriber.ready
            assert await redis.plain.publish("a", "through") == 1
            await heard.wait_for((b"message", b"a", b"through"))
        finally:
            await subscriber.aclose()


async def test_an_unsubscribe_refused_while_a_script_runs_is_written_again(tmp_path: Path) -> None:
    # Only a refused SUBSCRIBE was written again: a refused UNSUBSCRIBE left the connection
    # subscribed to a finished job's channels until it was replaced, Redis sending it their
    # messages all along.
    async with _BusyRedis(tmp_path) as redis, subscribed(redis.lean) as (subscriber, heard):
        subscriber.subscribe("a", "b")
        await heard.wait_for((b"subscribe", b"b", 2))
        await redis.loop_a_script()
        subscriber.unsubscribe("a")
        await asyncio.sleep(0.3)
        await redis.plain.script_kill()
        deadline = asyncio.get_running_loop().time() + 5
        while await redis.plain.publish("a", "late") != 0:
            assert asyncio.get_running_loop().time() < deadline, "still subscribed to a dropped channel"
            await asyncio.sleep(0.05)
        assert await redis.plain.publish("b", "kept") == 1  # (the other one stays)
        assert subscriber.connections == 1


async def test_subscriber_is_ready_only_once_its_channels_are_subscribed_again(lean: LeanRedis, plain: Redis) -> None:
    # A reader woken by on_ready reads the stored copy of what pub/sub may have lost: had it
    # read before the new connection's SUBSCRIBE took effect, a message published in
    # between would be lost as well, with nothing to wake the reader again.
    async with subscribed(lean) as (subscriber, heard):
        await heard.wait_for((b"ready", b"", 0))
        subscriber.subscribe("a", "b", "c")
        await heard.wait_for((b"subscribe", b"c", 3))
        for turn in (2, 3):
            del heard.items[:]
            await plain.client_kill_filter(_type="pubsub")
            await heard.wait_for((b"ready", b"", 0))
            assert subscriber.connections == turn and subscriber.ready
            assert heard.items[-1] == (b"ready", b"", 0), heard.items
            confirmed = {item[1] for item in heard.items if item[0] == b"subscribe"}
            assert confirmed == {b"a", b"b", b"c"}, heard.items
            assert await plain.publish("b", "at once") == 1  # nothing more to wait for
            await heard.wait_for((b"message", b"b", b"at once"))


async def test_subscriber_comes_back_with_its_channels(server: Server, lean: LeanRedis, plain: Redis) -> None:
    async with subscribed(lean) as (subscriber, heard):
        subscriber.subscribe("kept", "dropped")
        await heard.wait_for((b"subscribe", b"dropped", 2))
        subscriber.unsubscribe("dropped")
        await heard.wait_for((b"unsubscribe", b"dropped", 1))
        await plain.client_kill_filter(_type="pubsub")
        # Back on a new connection, subscribed again to what is still wanted, and counted.
        await heard.wait_for((b"subscribe", b"kept", 1), times=2)
        assert subscriber.connections == 2
        assert await lean.publish("kept", "after") == 1
        await heard.wait_for((b"message", b"kept", b"after"))
        assert await plain.publish("dropped", "x") == 0
        # The server goes away for a while, then comes back empty.
        server.stop()
        await asyncio.sleep(0.3)
        assert not subscriber.ready
        server.start()
        await heard.wait_for((b"subscribe", b"kept", 1), times=3)
        assert subscriber.connections >= 3
        await _published_and_heard(server, heard, "kept", "again")


async def _published_and_heard(server: Server, heard: Heard, channel: str, data: str) -> None:
    """Publish on a client of its own (one subscriber hears it), and wait until it is heard."""
    publisher = Redis.from_url(server.url)
    try:
        assert await publisher.publish(channel, data) == 1
    finally:
        await publisher.aclose()
    await heard.wait_for((b"message", channel.encode(), data.encode()))


async def test_a_quiet_subscriber_connection_is_checked_and_replaced(server: Server) -> None:
    client = LeanRedis.from_url(server.url, socket_timeout=0.3, health_check_interval=0.3)
    try:
        async with subscribed(client) as (subscriber, heard):
            subscriber.subscribe("c")
            await heard.wait_for((b"subscribe", b"c", 1))
            server.pause()  # half-open as far as the client can tell: nothing answers
            await asyncio.sleep(1.0)
            server.resume()
            await heard.wait_for((b"subscribe", b"c", 1), times=2)
            assert subscriber.connections >= 2
    finally:
        server.resume()
        await client.aclose()


async def test_a_subscribe_left_unanswered_ends_the_connection_long_before_a_health_check(server: Server) -> None:
    """A half-open connection (nothing answers: the path to Redis gone without a FIN) used to
    keep a SUBSCRIBE unanswered, and its owner ready, until the next health check (30 s).
    An unanswered command now ends it within socket_timeout, and the keeper dials again."""
    client = LeanRedis.from_url(server.url, socket_timeout=0.3, health_check_interval=30)
    try:
        async with subscribed(client) as (subscriber, heard):
            subscriber.subscribe("c")
            await heard.wait_for((b"subscribe", b"c", 1))
            server.pause()
            subscriber.subscribe("d")
            await asyncio.sleep(0.8)
            assert not subscriber.ready, "still believed subscribed with its SUBSCRIBE unanswered"
            server.resume()
            deadline = asyncio.get_running_loop().time() + 10
            while not (subscriber.ready and subscriber.connections >= 2):
                assert asyncio.get_running_loop().time() < deadline, "never subscribed again"
                await asyncio.sleep(0.05)
            await _published_and_heard(server, heard, "d", "hello")
    finally:
        server.resume()
        await client.aclose()


async def test_blocking_reads_each_have_a_connection(server: Server, plain: Redis) -> None:
    pool = BlockingLeanRedis.from_url(server.url, max_connections=3, pool_timeout_s=0.3, socket_timeout=5)
    try:
        # Three reads block at once, each on its own connection; one write wakes them all.
        readers = [asyncio.ensure_future(pool.xread({"s": "$"}, block=3000)) for _ in range(3)]
        await asyncio.sleep(0.2)
        started = time.monotonic()
        # A fourth finds all three busy: refused after the pool timeout, as redis-py's pool does.
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await pool.xread({"s": "$"}, block=3000)
        assert 0.25 <= time.monotonic() - started < 1.0
        await plain.xadd("s", {"f": "v"})
        answers = await asyncio.wait_for(asyncio.gather(*readers), 2)
        assert all(a and a[0][1][0][1] == {b"f": b"v"} for a in answers), answers
        # A read whose caller gave up takes its connection along: what comes next is not
        # queued behind a block still pending in Redis.
        gave_up = asyncio.ensure_future(pool.xread({"t": "$"}, block=3000))
        await asyncio.sleep(0.1)
        gave_up.cancel()
        started = time.monotonic()
        assert await pool.xread({"s": "0-0"}, count=1, block=3000)
        assert await pool.get("missing") is None
        assert time.monotonic() - started < 0.5
        clients = await plain.client_list()
        assert sum(1 for c in clients if c["cmd"] == "xread") <= 1  # the abandoned one, if Redis has not seen it go yet
    finally:
        await pool.aclose()


async def test_a_resp3_false_reply_is_a_reply(lean: LeanRedis) -> None:
    # hiredis's "no whole reply yet" must not be mistaken for RESP3's false (nor dropped,
    # which would hand every later reply to the caller before its own).
    await lean.set("k", "v")
    answers = await asyncio.wait_for(
        asyncio.gather(lean.eval("redis.setresp(3); return false", 0), lean.get("k"), lean.get("missing")), 5
    )
    assert answers == [False, b"v", None]


async def test_values_redis_py_cannot_send_are_a_data_error(lean: LeanRedis) -> None:
    with pytest.raises(DataError):
        await lean.execute_command("SET", "k", None)
    assert await lean.set("k", "still fine") is True


async def test_a_cancelled_blocking_claim_moves_nothing_later(server: Server, plain: Redis) -> None:
    # The worker's claim client: a BLMOVE cut short (the worker stopping) must not stay
    # pending in Redis and move a job into a claimed list nobody reads any more.
    claims = BlockingLeanRedis.from_url(server.url, max_connections=1, socket_timeout=5)
    try:
        claim = asyncio.ensure_future(claims.blmove("queue", "claimed", 2, "RIGHT", "LEFT"))
        await asyncio.sleep(0.1)
        claim.cancel()
        await asyncio.sleep(0.1)
        await plain.lpush("queue", "job-1")
        await asyncio.sleep(0.2)
        assert await plain.lrange("queue", 0, -1) == [b"job-1"]
        assert await plain.lrange("claimed", 0, -1) == []
        assert await claims.blmove("queue", "claimed", 1, "RIGHT", "LEFT") == b"job-1"  # the next claim works
    finally:
        await claims.aclose()


async def test_callers_waiting_for_a_dial_share_its_outcome(server: Server) -> None:
    client = LeanRedis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        await client.set("k", "v")
        server.pause()  # the connection times out; the re-dial cannot finish its handshake
        with pytest.raises(RedisTimeoutError):
            await client.get("k")
        started = time.monotonic()
        answers = await asyncio.gather(*(client.get("k") for _ in range(6)), return_exceptions=True)
        assert all(isinstance(a, RedisTimeoutError) for a in answers), answers
        assert time.monotonic() - started < 1.2  # one dial's timeout for all, not one after another
    finally:
        server.resume()
        await client.aclose()


async def test_a_full_blocking_pool_is_not_retried(server: Server) -> None:
    pool = BlockingLeanRedis.from_url(
        server.url, max_connections=1, pool_timeout_s=0.3, socket_timeout=5, retry=Retry(ConstantBackoff(0.1), 6)
    )
    try:
        busy = asyncio.ensure_future(pool.blpop(["empty"], timeout=3))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await pool.get("k")
        assert time.monotonic() - started < 1.0  # the pool's wait once, not seven times
        busy.cancel()
    finally:
        await pool.aclose()


async def test_a_closed_client_dials_nothing_more(server: Server) -> None:
    client = LeanRedis.from_url(server.url, socket_timeout=5, retry=Retry(ConstantBackoff(0.05), 3))
    pool = BlockingLeanRedis.from_url(server.url, max_connections=2, socket_timeout=5)
    in_flight = asyncio.ensure_future(client.blpop(["empty"], timeout=1))
    reading = asyncio.ensure_future(pool.blpop(["empty"], timeout=0.5))
    await asyncio.sleep(0.1)
    await client.aclose()
    await pool.aclose()
    assert isinstance((await asyncio.gather(in_flight, return_exceptions=True))[0], RedisError)
    await asyncio.gather(reading, return_exceptions=True)  # answered after the close, or failed
    assert client._lean is None and pool._idle == []
    with pytest.raises(RedisError):
        await client.get("k")


def _tls_server(tmp_path: Path, alt_name: str) -> tuple[Server, int, Path]:
    """A started redis-server that also takes TLS, with a self-signed certificate for
    `alt_name`: the server, its TLS port, and the certificate (its own CA)."""
    cert, key = self_signed_certificate(tmp_path, alt_name)
    server = Server(tmp_path)
    tls_port = free_port()
    server.extra = ("--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                    "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")  # fmt: skip
    server.start()
    return server, tls_port, cert


async def test_tls_from_a_rediss_url(tmp_path: Path) -> None:
    server, tls_port, cert = _tls_server(tmp_path, "IP:127.0.0.1")
    url = f"rediss://127.0.0.1:{tls_port}/0"
    try:
        client = LeanRedis.from_url(f"{url}?ssl_ca_certs={cert}", socket_timeout=5)
        pool = BlockingLeanRedis.from_url(f"{url}?ssl_ca_certs={cert}", max_connections=1, socket_timeout=5)
        unverified = LeanRedis.from_url(url, socket_timeout=5)  # the system's CAs do not know this one
        try:
            await client.set("k", "over tls")
            assert await pool.get("k") == b"over tls"
            async with subscribed(client) as (subscriber, heard):
                subscriber.subscribe("c")
                await heard.wait_for((b"subscribe", b"c", 1))
                assert await client.publish("c", "x") == 1
                await heard.wait_for((b"message", b"c", b"x"))
            with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                await unverified.get("k")
            # Each blocking read given up on dials a new connection: the TLS context (its CA
            # file read on the event loop) is made once per client, not at every dial.
            made = []
            real = ssl.create_default_context
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(1) or real(*a, **k))
                fresh = BlockingLeanRedis.from_url(f"{url}?ssl_ca_certs={cert}", max_connections=1, socket_timeout=5)
                try:
                    for _ in range(3):
                        read = asyncio.ensure_future(fresh.blpop(["nothing"], 5))
                        await asyncio.sleep(0.05)
                        read.cancel()  # (its connection is closed: the next read dials anew)
                        with contextlib.suppress(asyncio.CancelledError):
                            await read
                    assert await fresh.get("k") == b"over tls"
                finally:
                    await fresh.aclose()
            assert len(made) == 1, made
        finally:
            for c in (client, pool, unverified):
                await c.aclose()
    finally:
        server.stop()


def test_auth_names_a_user_only_when_the_url_does() -> None:
    # (Redis before 6 knows no users: `AUTH default <password>` is refused there.)
    assert LeanRedis.from_url("redis://:pw@127.0.0.1/0")._handshake(resp3=False) == [("AUTH", "pw")]
    assert LeanRedis.from_url("redis://me:pw@127.0.0.1/0")._handshake(resp3=False) == [("AUTH", "me", "pw")]
    assert LeanRedis.from_url("redis://:pw@127.0.0.1/0")._handshake(resp3=True) == [("HELLO", 3, "AUTH", "default", "pw")]


async def test_tls_options_are_applied_or_refused_never_ignored(tmp_path: Path) -> None:
    # A certificate for another name (a managed Redis reached by its address): refused,
    # unless the URL turns the hostname check off; an option this client cannot apply is
    # named rather than dropped.
    server, tls_port, cert = _tls_server(tmp_path, "DNS:redis.internal")
    base = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    clients = {
        "strict": LeanRedis.from_url(base, socket_timeout=5, retry=Retry(NoBackoff(), 0)),
        "no-hostname": LeanRedis.from_url(f"{base}&ssl_check_hostname=false&ssl_min_version=771", socket_timeout=5),
        "unknown": LeanRedis.from_url(f"{base}&ssl_validate_ocsp=true", socket_timeout=5, retry=Retry(NoBackoff(), 0)),
        # Built directly, redis-py fills every ssl_* option it has, None where unset.
        "direct": LeanRedis(host="127.0.0.1", port=tls_port, ssl=True, ssl_ca_certs=str(cert), ssl_check_hostname=False, socket_timeout=5),
    }
    try:
        with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await clients["strict"].get("k")
        assert await clients["no-hostname"].set("k", "v") and await clients["no-hostname"].get("k") == b"v"
        assert await clients["direct"].get("k") == b"v"
        with pytest.raises(RedisConnectionError, match="ssl_validate_ocsp"):
            await clients["unknown"].get("k")
    finally:
        for client in clients.values():
            await client.aclose()
        server.stop()


async def test_a_subscriber_reconnecting_while_redis_loads_its_data_gets_ready(tmp_path: Path) -> None:
    # Redis takes connections and SUBSCRIBE while it loads its dataset, but answers the
    # ready mark's PING with -LOADING: the mark must be asked for again, or the subscriber
    # (and every worker's claiming with it) would wait for good.
    server = Server(tmp_path, "--dir", str(tmp_path), "--loading-process-events-interval-bytes", "1024")
    server.start()
    client = LeanRedis.from_url(server.url, socket_timeout=5)
    try:
        plain = Redis.from_url(server.url)
        await plain.eval("for i = 1, 20000 do redis.call('SET', 'k' .. i, 'v') end", 0)
        await plain.save()
        await plain.aclose()
        async with subscribed(client) as (subscriber, heard):
            subscriber.subscribe("kept")
            await heard.wait_for((b"ready", b"", 0))
            server.stop()
            server.extra = (*server.extra, "--key-load-delay", "100")  # about 2 s of loading
            server.start()
            started = time.monotonic()
            await heard.wait_for((b"subscribe", b"kept", 1), times=2)
            while True:
                probe = Redis.from_url(server.url)
                try:
                    await probe.ping()
                    break
                except RedisError:
                    await asyncio.sleep(0.05)  # loading
                finally:
                    await probe.aclose()
            loaded = time.monotonic()
            assert loaded - started > 0.5, "Redis loaded too fast for this test to mean anything"
            await heard.wait_for((b"ready", b"", 0), times=2, timeout_s=2)
            assert subscriber.ready and subscriber.connections == 2
    finally:
        await client.aclose()
        server.stop()


@pytest.mark.parametrize("ready_first", [False, True], ids=["dropped-at-once", "dropped-once-ready"])
async def test_a_connection_dropped_before_it_is_ready_is_dialled_again_with_a_pause(server: Server, ready_first: bool) -> None:
    # A listener that takes each connection and closes it (a Redis at maxclients, a proxy
    # with nothing behind it), or answers the ready mark and then closes (an output-buffer
    # kill), is a failed dial, not a reason to dial again at once.
    dials = 0

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dials
        dials += 1
        if ready_first:
            await reader.read(1024)
            writer.write(b"$21\r\ncoderunner:subscribed\r\n")
            await writer.drain()
        writer.close()

    port = free_port()
    listener = await asyncio.start_server(drop, "127.0.0.1", port)
    redirect = LeanRedis.from_url(server.url, socket_timeout=1)
    client = LeanRedis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=1)
    try:
        async with subscribed(redirect) as (subscriber, _heard):
            # Start on the real server, then point the same subscriber at the dropping one.
            subscriber._client = client
            subscriber._pushes.close()  # type: ignore[union-attr]
            await asyncio.sleep(1.5)
            assert 3 <= dials <= 12, dials
    finally:
        listener.close()
        await client.aclose()
        await redirect.aclose()
