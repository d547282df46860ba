"""Best-effort delivery of job events to soketi, through its Redis adapter or the Pusher HTTP API.

Redis holds the durable log; this is only the live view, so it must never stall a run:
each job gets an ordered in-memory lane drained by one task, bursts go out through the
batch endpoint (soketi accepts up to 10 events per batch), requests have a short
timeout, and after a failure the publisher backs off for a moment instead of making
every job wait for a dead server (output is shed meanwhile; a stage or a result is
still tried, one at a time, and one that gets through ends the pause).

With PUSHER_PUBLISH=redis, events go out as PUBLISHes on the channel soketi's Redis adapter
listens to (a soketi started with SOKETI_ADAPTER_DRIVER=redis on the same Redis), in the
message form soketi's own nodes use to pass events to each other. Every soketi node then
sends them to its subscribers. That is one Redis round trip on a kept connection, where
HTTP costs a request that soketi parses and checks, and answers only after it has sent
the event on. An event no soketi node heard (PUBLISH reached no subscriber: soketi down,
restarting, or not on the adapter) goes through HTTP instead.

soketi answers every HTTP API request with `Connection: close`, so each delivery is one
short connection, dialled while the previous delivery is under way so that an event never
waits for a handshake; a few lines of asyncio streams do that with a fraction of the CPU a
general-purpose client spends, which matters on a busy two-core worker.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
import time
from collections import deque
from typing import Literal
from urllib.parse import urlencode

import msgspec
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from leanredis import LeanRedis, NeverSent
from shared import keys
from shared.eventlog import CHUNK_EVENTS
from shared.pusher import signed_query
from shared.settings import Settings

__all__ = ["JobLane", "Publisher"]

log = logging.getLogger(__name__)

# How long a lane's late-replay claim (keys.late_replay_key) is kept: the API's webhook
# handler looks for it only as a late mark lands, seconds after the job's events.
LATE_REPLAY_CLAIM_S = 3600

MAX_BATCH = 10
BACKOFF_S = 2.0
# Per channel: what soketi may be handed at once, the steady rate after that, and how much
# may wait in the worker before the oldest output is shed.
LANE_BURST_BYTES = 512 * 1024
LANE_RATE_BYTES_S = 4 * 1024 * 1024
LANE_MAX_PENDING_BYTES = 16 * 1024 * 1024
AUDIENCE_RECHECK_S = 1.0
# A lane that could not ask for the late-replay claim (Redis away) asks again this often,
# its events waiting in order meanwhile; a closing lane, for this long past its timeout
# (what it still holds then is its stages and its result).
CLAIM_RETRY_S = 0.5
CLAIM_PATIENCE_S = 15.0
# What a lane keeps of the events it found nobody following, for a follower it learns of
# late (see JobLane._keep_unheard).
LANE_UNHEARD_KEEP_BYTES = 256 * 1024
MAX_IDLE_CONNECTIONS = 16
# An open connection older than this is not used: the server may have timed it out (uWS,
# under soketi, closes an idle HTTP connection after 10 s).
IDLE_CONNECTION_S = 5.0


class _Event(msgspec.Struct, frozen=True):
    channel: str
    name: str
    data: str


class _Batch(msgspec.Struct, frozen=True):
    batch: list[_Event]


class _Message(msgspec.Struct, frozen=True):
    """What a soketi node sends its subscribers (the Pusher protocol's event frame)."""

    event: str
    channel: str
    data: str


class _AdapterMessage(msgspec.Struct, frozen=True):
    """soketi's Redis adapter message (HorizontalAdapter.send): a node ignores only its own
    uuid, and `data` is the frame as text."""

    uuid: str
    appId: str
    channel: str
    data: str
    exceptingId: str | None = None


# Events a client shows the same when it gets one twice (see _publish_through_redis).
_SAFE_TWICE = CHUNK_EVENTS | {"stage"}


def adapter_channel(prefix: str) -> str:
    """The Redis channel soketi's Redis adapter listens to (SOKETI_ADAPTER_REDIS_PREFIX)."""
    return f"{prefix}#redis-adapter" if prefix else "redis-adapter"


_encoder = msgspec.json.Encoder()


class DeliveryError(Exception):
    """soketi could not be reached or did not answer in time."""


class Publisher:
    def __init__(self, settings: Settings, redis: Redis | None = None) -> None:
        self._redis = redis
        self._key = settings.pusher_key
        self._secret = settings.pusher_secret
        self._app_id = settings.pusher_app_id
        self._host = settings.pusher_host
        self._port = settings.pusher_port
        self._ssl = ssl.create_default_context() if settings.pusher_scheme == "https" else None
        self._timeout_s = settings.pusher_timeout_ms / 1000
        self._down_until = 0.0
        # The delivery under way while paused (see deliver): "answered", "failed" or
        # "cancelled" once it is over.
        self._probe: asyncio.Future[str] | None = None
        self._adapter = adapter_channel(settings.pusher_redis_prefix) if settings.pusher_publish == "redis" else None
        self._uuid = "coderunner-worker-" + secrets.token_hex(8)
        self._redis_fallback_said_until = 0.0
        # Publishes get a client of their own that never sends a command twice: a PUBLISH
        # whose answer was lost may have gone out, and sending it again could double a
        # result (the shared client retries, which suits the fenced, idempotent scripts).
        self._publish_redis = (
            LeanRedis.from_url(
                settings.redis_url,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
            if self._adapter is not None
            else None
        )
        self.sent = 0
        # Of `sent`, those soketi heard through its Redis adapter.
        self.sent_via_redis = 0
        self.failed = 0
        self.dropped = 0
        # Events not sent because nobody followed the channel (a grader's job).
        self.unheard = 0
        self.audience_checks = 0
        # Open connections ready for a request, with when each was opened: kept-alive ones
        # (a Pusher HTTP API that allows them) and pre-dialled ones. soketi closes each
        # connection after its answer, so the next one is dialled right after, off the path
        # of the event that will use it.
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
        # The dial under way, if any (a set, so a finished one drops out by itself).
        self._dialler: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        """Close the kept connections and report the tally."""
        for task in list(self._dialler):
            task.cancel()
        await asyncio.gather(*self._dialler, return_exceptions=True)
        for _reader, writer, _opened in self._idle:
            writer.close()
        self._idle.clear()
        if self._publish_redis is not None:
            await self._publish_redis.aclose()
        log.info(
            "live events: %d delivered (%d through Redis), %d refused or unreachable, %d dropped, %d unheard"
            " (%d audience checks)",
            self.sent, self.sent_via_redis, self.failed, self.dropped, self.unheard, self.audience_checks,
        )  # fmt: skip

    async def occupied(self, channel: str) -> Literal["none", "present", "replayed", "unknown"]:
        """Whether anyone may follow `channel`: "present" once the API signed a subscription
        to it (a private channel admits nobody else) or soketi's webhook reported one, else
        "none"; "replayed" when the API's webhook handler found the job ended and publishes
        its log itself (keys.late_replay_key: it takes that claim in the same script that
        sets the mark, so a look that finds the mark finds the claim too); "unknown" when
        Redis cannot tell (the lane then sends only under a claim of its own). A pipelined
        read on a kept connection, where asking soketi would cost a request of its own."""
        self.audience_checks += 1
        job_id = keys.job_id_from_channel(channel)
        if self._redis is None or job_id is None:
            return "present"
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.exists(keys.audience_key(job_id))  # (first: see above)
                pipe.get(keys.late_replay_key(job_id))
                marked, claim = await pipe.execute()
        except (RedisError, OSError):
            return "unknown"
        if claim is not None and bytes(claim).startswith(b"api"):
            return "replayed"
        return "present" if marked else "none"

    async def claim_late_replay(self, channel: str, token: str) -> bool | None:
        """Whether this lane (`token`) may publish what went by before its follower was known
        (see keys.late_replay_key): False when the API's webhook handler took the claim (it
        publishes the whole log of the job, which had ended by then); None when that cannot
        be told now (Redis away: the lane asks again, as a double result must never be and
        a lost one must not either). The claim carries the lane's token, so a SET whose
        answer was lost and was sent again is still ours."""
        job_id = keys.job_id_from_channel(channel)
        if self._redis is None or job_id is None:
            return True
        key = keys.late_replay_key(job_id)
        try:
            if await self._redis.set(key, token, nx=True, ex=LATE_REPLAY_CLAIM_S):
                return True
            held = await self._redis.get(key)
        except (RedisError, OSError) as exc:
            log.warning("channel %s: cannot tell yet who publishes its late follower's events (%s)", channel, exc)
            return None
        return held is not None and bytes(held) == token.encode()

    async def _request(self, path: str, query: dict[str, str], body: bytes, method: str = "POST") -> tuple[int, bytes]:
        head = (
            f"{method} {path}?{urlencode(query)} HTTP/1.1\r\n"
            f"Host: {self._host}:{self._port}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        while True:
            ready = self._ready_connection()
            reused = ready is not None
            reader, writer = ready if ready is not None else await self._dial()
            self._predial()
            try:
                writer.write(head + body)
                status, answer, keep = await self._read_answer(reader)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, DeliveryError) as exc:
                writer.close()
                stale = isinstance(exc, ConnectionResetError | BrokenPipeError) or (
                    isinstance(exc, asyncio.IncompleteReadError) and not exc.partial
                )
                if reused and stale:
                    continue  # the server had closed the kept connection: once more on a new one
                if isinstance(exc, OSError | DeliveryError):
                    raise
                raise DeliveryError(f"broken answer: {exc!r}") from None
            except BaseException:
                writer.close()  # cancelled mid-answer: the connection's state is unknown
                raise
            if keep and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append((reader, writer, time.monotonic()))
            else:
                writer.close()
            return status, answer

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self._host, self._port, ssl=self._ssl)

    def _ready_connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The newest open connection young enough that the server has not timed it out."""
        while self._idle:
            reader, writer, opened = self._idle.pop()
            if time.monotonic() - opened < IDLE_CONNECTION_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    def _predial(self) -> None:
        """Dial the connection the next request will use, unless one is ready or on its way."""
        if self._idle or self._dialler or time.monotonic() < self._down_until:
            return

        async def dial() -> None:
            try:
                reader, writer = await asyncio.wait_for(self._dial(), self._timeout_s)
            except (OSError, TimeoutError):
                return  # the next request dials (and reports) for itself
            if len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append((reader, writer, time.monotonic()))
            else:
                writer.close()

        task = asyncio.create_task(dial(), name="soketi-predial")
        self._dialler.add(task)
        task.add_done_callback(self._dialler.discard)

    @staticmethod
    async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        """Status, body, and whether the connection may carry the next request."""
        header = await reader.readuntil(b"\r\n\r\n")
        status_line, _, fields = header.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise DeliveryError(f"unexpected answer {status_line[:80]!r}")
        headers = {}
        for line in fields.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        length = headers.get(b"content-length", b"")
        if length.isdigit():
            answer = await reader.readexactly(int(length))
            keep = headers.get(b"connection") != b"close"
        else:  # no length: the body runs to the end of the connection
            answer, keep = await reader.read(-1), False
        return int(parts[1]), answer, keep

    def lane(self, channel: str) -> JobLane:
        return JobLane(self, channel)

    async def deliver(self, events: list[_Event]) -> bool:
        """Hand `events` to soketi. False when they surely did not reach it (shed while
        paused, or refused): a result among them can be sent again without being doubled.
        True when they did, or may have (a request that timed out may have gone through)."""
        if self._publish_redis is not None:
            events = await self._publish_through_redis(self._publish_redis, events)
            if not events:
                return True
        paused = time.monotonic() < self._down_until
        if paused:
            # Paused after a failure, output is shed; a stage or a result (another job's,
            # perhaps, whose client waits for nothing else) goes as a probe, one at a time:
            # one that gets through ends the pause, and a soketi that still does not answer
            # holds up one delivery, not every job's. One that comes while a probe is out
            # waits for its answer and goes as it went (a result dropped because another
            # job's was in flight would leave its client no later seq to notice it by).
            kept = [event for event in events if event.name not in CHUNK_EVENTS]
            self.dropped += len(events) - len(kept)
            if not kept:
                return False
            events = kept
            while self._probe is not None:
                outcome = await asyncio.shield(self._probe)
                if outcome == "failed":
                    self.dropped += len(events)
                    return False
                # "answered", or "cancelled" (its own job gave up on it, soketi told nothing):
                # this goes, as the next probe if a pause is on again, unless another waiter
                # became that probe first (a delivery failed as this one's answer came): then
                # it waits for that one, so there is never more than one probe out.
            paused = time.monotonic() < self._down_until
            if paused:
                probe = self._probe = asyncio.get_running_loop().create_future()
        if len(events) == 1:
            path = f"/apps/{self._app_id}/events"
            body = _encoder.encode({"name": events[0].name, "channel": events[0].channel, "data": events[0].data})
        else:
            path = f"/apps/{self._app_id}/batch_events"
            body = _encoder.encode(_Batch(events))
        params = signed_query("POST", path, body, self._key, self._secret, int(time.time()))
        if not paused:
            probe = None
        outcome = "cancelled"
        try:
            status, answer = await asyncio.wait_for(self._request(path, params, body), self._timeout_s)
            outcome = "answered"
        except (OSError, TimeoutError, DeliveryError) as exc:
            outcome = "failed"
            self.failed += len(events)
            self._down_until = time.monotonic() + BACKOFF_S
            # Once as a pause begins (a probe that fails within it is no news), or a soketi
            # that stays down would be a line for every job.
            log.log(logging.DEBUG if paused else logging.WARNING,
                    "soketi unreachable (%s); live output shed for %.0fs", exc.__class__.__name__, BACKOFF_S)  # fmt: skip
            return True  # (it may have got there: never sent twice)
        finally:
            if probe is not None:
                if outcome == "answered":
                    self._down_until = 0.0  # the probe got through: soketi answers again
                # Those waiting for it go as it went (see above).
                probe.set_result(outcome)
                if self._probe is probe:
                    self._probe = None
        if status >= 400:
            self.failed += len(events)
            log.warning("soketi refused %d events: %s %r", len(events), status, answer[:200])
            return False
        self.sent += len(events)
        return True

    @property
    def adapter(self) -> str | None:
        """soketi's adapter channel, when events go through Redis (else None)."""
        return self._adapter

    def adapter_message(self, channel: str, name: str, data: str) -> bytes:
        """An event as a PUBLISH on the adapter channel carries it (see _AdapterMessage)."""
        return _encoder.encode(
            _AdapterMessage(
                uuid=self._uuid,
                appId=self._app_id,
                channel=channel,
                data=_encoder.encode(_Message(name, channel, data)).decode(),
            )
        )

    async def _publish_through_redis(self, redis: Redis, events: list[_Event]) -> list[_Event]:
        """PUBLISH each event to soketi's adapter channel; returns those no node heard."""
        assert self._adapter is not None
        messages = [self.adapter_message(event.channel, event.name, event.data) for event in events]
        try:
            if len(messages) == 1:
                heard = [await redis.publish(self._adapter, messages[0])]
            else:
                async with redis.pipeline(transaction=False) as pipe:
                    for message in messages:
                        pipe.publish(self._adapter, message)
                    heard = await pipe.execute()
        except NeverSent as exc:
            # Redis never had them (its connection could not be made: Redis restarting, say):
            # they go over soketi's HTTP API instead, which needs no Redis.
            now = time.monotonic()
            if now >= self._redis_fallback_said_until:  # (once a while: an outage is one fault)
                self._redis_fallback_said_until = now + 10.0
                log.warning("live events go over HTTP: Redis is unreachable for publishing (%s)", exc)
            return events
        except (RedisError, OSError) as exc:
            # Unknown whether they got out (Redis died with them in flight, most likely before
            # it passed them on). Output and stages go again over HTTP: each carries its seq,
            # a client drops a seq it has (SPEC §5), and one that does not (the seed's React
            # hook keys output by seq, and a stage only sets the phase) shows nothing twice.
            # What such a client appends to a list (an artifact, a test's result) or acts on
            # once (the result) is not sent twice, ever.
            again = [event for event in events if event.name in _SAFE_TWICE]
            self.failed += len(events) - len(again)
            log.warning("publishing %d live events through Redis failed (%d go over HTTP): %s", len(events), len(again), exc)
            return again
        unheard = [event for event, receivers in zip(events, heard, strict=True) if not receivers]
        self.sent += len(events) - len(unheard)
        self.sent_via_redis += len(events) - len(unheard)
        return unheard


class JobLane:
    """Events of one channel, delivered in order by a single drain task.

    soketi buffers at most 1 MiB for a subscriber that reads slower than events come, and
    silently drops the rest. A lane therefore paces itself: bursts up to LANE_BURST_BYTES go
    at once, more flows at LANE_RATE_BYTES_S, which any client on a sane link keeps up with.
    What a lane cannot deliver in time (an output flood, a slow soketi) is dropped oldest
    chunk first, never a stage or the result; a client sees the gap in `seq` and reads it
    from the durable log.
    """

    def __init__(self, publisher: Publisher, channel: str) -> None:
        self._publisher = publisher
        self._channel = channel
        # Whether someone follows the channel: unknown until the first delivery, then
        # looked up again at most every AUDIENCE_RECHECK_S while nobody does.
        self._audience = False
        self._audience_checked_at: float | None = None
        # Events waiting, each with its size in bytes (what the pacing and the bounds count).
        self._pending: deque[tuple[_Event, int]] = deque()
        self._pending_bytes = 0
        self._wakeup = asyncio.Event()
        # Set while the drain waits with nothing queued or under way (see flush).
        self._idle = asyncio.Event()
        self._closing = False
        self._tokens = float(LANE_BURST_BYTES)
        self._unsent: list[_Event] = []
        self._unheard: list[tuple[_Event, int]] = []
        self._unheard_bytes = 0  # (all that was ever kept: the bound is for the lane's life)
        self._unheard_cut = False
        # Some event found nobody following, or a look could not tell: once a follower is
        # known, this lane sends only under the late-replay claim. Whether it does (None:
        # not asked yet; see _may_deliver).
        self._must_claim = False
        self._cleared: bool | None = None
        self._claim_token: str | None = None
        self._refilled_at = time.monotonic()
        # The result surely did not reach soketi (see Publisher.deliver): still owed.
        self.result_lost = False
        self._task = asyncio.create_task(self._drain(), name=f"publish:{channel}")

    def send(self, name: str, data: bytes) -> None:
        """Queue an event (payload already JSON-encoded); never waits."""
        self._pending.append((_Event(self._channel, name, data.decode()), len(data)))
        self._pending_bytes += len(data)
        if self._pending_bytes > LANE_MAX_PENDING_BYTES:
            self._shed(LANE_MAX_PENDING_BYTES // 2)
        self._wakeup.set()

    def _shed(self, keep_bytes: int) -> None:
        """Drop the oldest chunk events until at most `keep_bytes` wait (order kept)."""
        kept: deque[tuple[_Event, int]] = deque()
        for event, size in self._pending:
            if self._pending_bytes > keep_bytes and event.name in CHUNK_EVENTS:
                self._pending_bytes -= size
                self._publisher.dropped += 1
                continue
            kept.append((event, size))
        self._pending = kept

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(LANE_BURST_BYTES, self._tokens + (now - self._refilled_at) * LANE_RATE_BYTES_S)
        self._refilled_at = now

    async def _pace(self, size: int) -> None:
        self._refill()
        if self._tokens < size:
            await asyncio.sleep((size - self._tokens) / LANE_RATE_BYTES_S)
            self._tokens = float(size)
            self._refilled_at = time.monotonic()
        self._tokens -= size

    async def _drain(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                self._idle.set()
                if self._unheard and not self._audience:
                    # Events kept for a follower who may be on the way (a webhook's mark):
                    # look again now and then, so a program waiting on its stdin after a
                    # prompt gets the prompt shown before it writes anything more. (A timer
                    # that sets the wakeup: cheaper than wait_for's task, every idle spell
                    # of every job nobody follows.)
                    timer = asyncio.get_running_loop().call_later(AUDIENCE_RECHECK_S, self._wakeup.set)
                    await self._wakeup.wait()
                    timer.cancel()
                    if not self._pending and not self._closing and await self._heard():
                        self._replay_unheard()
                else:
                    await self._wakeup.wait()
                self._idle.clear()
                continue
            taken = [self._pending.popleft() for _ in range(min(MAX_BATCH, len(self._pending)))]
            batch = [event for event, _ in taken]
            size = sum(n for _, n in taken)
            self._pending_bytes -= size
            # Until its delivery begins, a batch is still close()'s to send should time run out.
            self._unsent = batch
            if not await self._heard():
                self._unsent = []
                self._publisher.unheard += len(batch)
                self._keep_unheard(taken)
                continue
            may = await self._may_deliver()
            if may is None:
                # Who publishes cannot be told now: these wait (in order) and it is asked again.
                self._unsent = []
                self._pending.extendleft(reversed(taken))
                self._pending_bytes += size
                await asyncio.sleep(CLAIM_RETRY_S)
                continue
            if not may:
                self._unsent = []  # (the API publishes the whole log: these are in it)
                continue
            if self._unheard:
                self._unsent = []
                self._pending.extendleft(reversed(taken))
                self._pending_bytes += size
                self._replay_unheard()
                continue
            await self._pace(size)
            # Once a request may have reached soketi, sending it again could double a result.
            self._unsent = []
            await self._deliver(batch)

    async def _deliver(self, batch: list[_Event]) -> None:
        went = await self._publisher.deliver(batch)
        if any(event.name == "result" for event in batch):
            self.result_lost = not went

    async def _may_deliver(self) -> bool | None:
        """Whether to publish, a follower being known. A lane that let events go by unheard
        learned of its follower late (soketi's webhook for a subscription signed outside the
        API): the API's webhook handler publishes the whole log of a job that had ended by
        the time the mark landed, so this lane publishes only if it takes the job's
        late-replay claim first, and nothing more if it does not. None: not known yet (the
        claim could not be asked; it is, again, next time)."""
        if self._cleared is None:
            if not self._must_claim:
                return True
            if self._claim_token is None:
                self._claim_token = f"worker:{secrets.token_hex(8)}"  # (one: a claim asked again is still ours)
            self._cleared = await self._publisher.claim_late_replay(self._channel, self._claim_token)
            if self._cleared is None:
                return None
        if not self._cleared and self._unheard:
            self._publisher.unheard -= len(self._unheard)  # (the API publishes them)
            self._unheard = []
        return self._cleared

    def _replay_unheard(self) -> None:
        """Followed after all: what went by unheard goes out first, in order (before all
        that waits: the lane has delivered nothing while nobody was known to follow)."""
        self._pending.extendleft(reversed(self._unheard))
        self._pending_bytes += sum(size for _, size in self._unheard)
        self._publisher.unheard -= len(self._unheard)
        self._unheard = []

    @property
    def followed(self) -> bool:
        """Whether the lane has known of a follower (and so delivered what it was given)."""
        return self._audience

    def _keep_unheard(self, taken: list[tuple[_Event, int]]) -> None:
        """Keep events that found nobody following, up to LANE_UNHEARD_KEEP_BYTES (then the
        first ones only: a follower sees the gap in `seq` and reads the log). A subscription
        signed outside the API is marked by soketi's webhook (api/webhooks.py) a moment after
        it was made, which may be after the job's first events went by here."""
        self._must_claim = True
        for event, size in taken:
            if self._unheard_cut or self._unheard_bytes + size > LANE_UNHEARD_KEEP_BYTES:
                self._unheard_cut = True  # (and nothing after the gap either)
                return
            self._unheard.append((event, size))
            self._unheard_bytes += size

    @property
    def adapter(self) -> str | None:
        return self._publisher.adapter

    def direct_mode(self, size: int) -> Literal["always", "followed"] | None:
        """Whether events of `size` bytes may skip this lane: PUBLISHed to soketi's adapter by
        the very script that logs them (one Redis round trip, not two), "followed" meaning
        only if the script finds the job's audience mark. Only when that keeps the lane's
        rules: events go through Redis, nothing waits here or is under way (so nothing is
        overtaken), no event went by unheard unless this lane holds the late-replay claim,
        and the pacing has room for them. "followed" only while the lane has never looked
        for a follower. The caller holds its log's lock, and sends the lane nothing else
        until it reports back (published_directly)."""
        if self._publisher.adapter is None or self._closing or self._pending or self._unheard:
            return None
        if not self._idle.is_set() or self._task.done():
            return None
        if self._cleared is False or (self._must_claim and self._cleared is not True):
            return None
        if not self._audience and self._audience_checked_at is not None:
            # Nobody followed at the last look (a grader's job, nearly always): the lane
            # takes these, and their messages are not built for a script that would find no
            # mark. A follower who subscribed since is heard through the lane's own look.
            return None
        self._refill()
        if self._tokens < size:
            return None
        return "always" if self._audience else "followed"

    def adapter_message(self, name: str, data: bytes) -> bytes:
        return self._publisher.adapter_message(self._channel, name, data.decode())

    def published_directly(self, count: int, size: int, followed: bool) -> None:
        """`count` events (`size` bytes) went out through the script that logged them, which
        found the audience mark (`followed`) or, asked "followed", did not; the caller sends
        the rest of what it offered through send(), in order."""
        self.learned_audience(followed)
        self._tokens -= size
        self._publisher.sent += count
        self._publisher.sent_via_redis += count

    def wants_audience(self) -> bool:
        """Whether an append to the job's log should read the audience mark: as long as
        nobody is known to follow. The read rides inside the append's own script (no round
        trip), so every event logged after a subscription was signed is published."""
        return not self._audience

    def knows_nobody_follows(self) -> bool:
        """Whether the lane has looked for a follower (or an append did) and found none."""
        return not self._audience and self._audience_checked_at is not None

    def learned_audience(self, present: bool) -> None:
        """The answer, read along with an append to the job's log (saves _heard a look)."""
        self._audience_checked_at = time.monotonic()
        self._audience = self._audience or present

    async def _heard(self) -> bool:
        """A job nobody follows (a grader's) costs soketi nothing, and Redis one look. Each
        append to the log reads the mark too (wants_audience), so a client that subscribes
        later hears every event logged after its subscription was signed; what came before
        is in the durable log, as for any late joiner. Events that reach the lane without an
        append of their own (the backlog at start) use this look, made at most every
        AUDIENCE_RECHECK_S while nobody follows."""
        if self._audience:
            return True
        now = time.monotonic()
        if self._audience_checked_at is None or now - self._audience_checked_at >= AUDIENCE_RECHECK_S:
            self._audience_checked_at = now
            answer = await self._publisher.occupied(self._channel)
            if answer == "replayed":
                self._cleared = False  # the API publishes the job's log: nothing from here
            elif answer == "unknown":
                self._must_claim = True
            if answer != "none":
                self._audience = True  # (a "yes" learned meanwhile stays)
        return self._audience

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every event queued so far has been delivered (or found unheard), at most
        `timeout_s`; the lane stays open. Returns whether it got there in time."""
        if self._task.done():
            return True
        if self._pending:
            self._idle.clear()  # (the drain may not have woken for them yet)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float) -> None:
        """Deliver what is queued (up to `timeout_s`), then stop. Past the time, what is
        left of the output is dropped and the rest (the result) still goes."""
        self._closing = True
        self._wakeup.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            return
        except TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        kept = [event for event, _ in self._unheard] if self._audience else []
        self._publisher.unheard -= len(kept)
        self._unheard = []
        left = [*kept, *self._unsent, *(event for event, _ in self._pending)]
        rest = [event for event in left if event.name not in CHUNK_EVENTS]
        self._publisher.dropped += len(left) - len(rest)
        if len(left) > len(rest):
            log.warning("channel %s: %d live output events not delivered in time", self._channel, len(left) - len(rest))
        self._pending.clear()
        self._unsent = []
        if not rest or not await self._heard():
            self._publisher.unheard += len(rest)
            return
        may = await self._may_deliver()
        patience = asyncio.get_running_loop().time() + CLAIM_PATIENCE_S
        while may is None and asyncio.get_running_loop().time() < patience:
            # Who publishes them cannot be told yet (Redis away as the lane asked for its
            # late-replay claim): the result among them is worth waiting for a while.
            await asyncio.sleep(CLAIM_RETRY_S)
            may = await self._may_deliver()
        if may is None:
            self._publisher.failed += len(rest)
            self.result_lost = any(event.name == "result" for event in rest)
            log.warning("channel %s: %d live events (the result among them) not delivered: "
                        "who publishes them could not be told", self._channel, len(rest))  # fmt: skip
            return
        if not may:
            self._publisher.unheard += len(rest)
            return
        for start in range(0, len(rest), MAX_BATCH):
            await self._deliver(rest[start : start + MAX_BATCH])
