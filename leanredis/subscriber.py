"""Pub/sub on a connection of its own, handing each message to a callback as it is parsed.

redis-py's PubSub costs a worker more than its commands do: a task polling get_message, a
retry wrapper and a timeout context per read, and a round of its own for every SUBSCRIBE
(py-spy: close to a fifth of the worker's busy time at 4 grader clients, for five messages
a job). Here the connection's protocol parses what arrives and calls `on_message` at once,
and SUBSCRIBE / UNSUBSCRIBE are plain writes whose confirmations arrive as messages. An owner
that drops channels as often as it subscribes new ones (a worker: two a job) can have each
UNSUBSCRIBE wait to go out with the next SUBSCRIBE (`unsubscribe_within_s`): one write and
one answer to wake for instead of two.

The connection is kept: a keeper task re-dials one that was lost (backing off up to a
second), subscribes again to every channel still wanted, and counts the connections
(`connections`), because whatever was published while it was down is lost and the owner
must look at its durable state again: `on_ready` is called once a new connection is
subscribed to all of them (a PING sent after the SUBSCRIBE has been answered; asked again
while Redis refuses it, as it does while loading its data), so what the
owner reads then cannot miss a message the new connection would not carry. An idle
connection is checked with a PING every `health_check_interval` (30 s unless the client
says), and one that does not answer within `socket_timeout` is dropped and re-dialled, so a
half-open connection cannot silently swallow messages for long; so is one that leaves any
command (a SUBSCRIBE, an UNSUBSCRIBE, a PING) unanswered that long.

A channel's confirmation reaches `on_message` only for the last SUBSCRIBE written for it: a
channel subscribed, dropped and subscribed again before Redis answered gets the first
answer too, and taken for the last it would say "subscribed" while the UNSUBSCRIBE between
is still to come, so a message published in that window would be lost. Replies come in the
order of the commands, so each is matched to its command: a SUBSCRIBE Redis refuses (one
error for the command: -BUSY while a script runs long) is no longer awaited, and is written
again a moment later for the channels still wanted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable

import hiredis
from redis.exceptions import RedisError

from leanredis.client import NOT_ENOUGH_DATA, LeanRedis, _error, _pack

__all__ = ["Subscriber"]

log = logging.getLogger(__name__)

HEALTH_CHECK_S = 30.0
REDIAL_MIN_S = 0.05
REDIAL_MAX_S = 1.0
# A connection up this long before it was lost lets the next dial go at once.
STABLE_S = 5.0

# on_message(kind, channel, data): kind is b"message", b"subscribe" or b"unsubscribe"
# (data is then the connection's subscription count).
OnMessage = Callable[[bytes, bytes, bytes | int], None]
# on_refused(command, channels): Redis answered a SUBSCRIBE or UNSUBSCRIBE of these with an
# error.
OnRefused = Callable[[bytes, list[bytes]], None]
# The argument of the PING that follows a connection's SUBSCRIBE: its answer means the
# subscriptions are in place (a subscribed connection answers [b"pong", arg], another arg).
READY_MARK = b"coderunner:subscribed"
# How soon a ready mark refused (Redis still loading: -LOADING) is asked for again.
READY_AGAIN_S = 0.1


class _Pushes(asyncio.Protocol):
    def __init__(
        self, on_message: OnMessage, address: str, on_refused: OnRefused | None = None, answer_s: float = 5.0
    ) -> None:
        self._on_message = on_message
        self._on_refused = on_refused
        self._address = address
        # Commands written and not yet fully answered, in order: [name, channels still to
        # be answered, when written] (a SUBSCRIBE or UNSUBSCRIBE is answered once per
        # channel, a refusal once for the whole command; a PING once).
        self._sent: collections.deque[tuple[bytes, list[bytes], float]] = collections.deque()
        # A command unanswered this long ends the connection (the keeper dials again): the
        # commands' only deadline. Without it a half-open connection (the path to Redis gone
        # without a FIN) held every SUBSCRIBE unanswered, and its owner believed itself
        # subscribed, until the next health check, 30 to 65 s on.
        self._answer_s = answer_s
        self._deadline: asyncio.TimerHandle | None = None
        self._reader = hiredis.Reader(replyError=_error, notEnoughData=NOT_ENOUGH_DATA)
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_heard = self.made_at = asyncio.get_running_loop().time()
        self._again: asyncio.TimerHandle | None = None
        self.refusals = 0
        # Channels whose SUBSCRIBE was refused and not yet written again and answered.
        self.refused_pending: set[bytes] = set()

    def data_received(self, data: bytes) -> None:
        self.last_heard = asyncio.get_running_loop().time()
        reader = self._reader
        reader.feed(data)
        while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
            if isinstance(reply, Exception):
                refused = self._sent.popleft() if self._sent else None
                if refused is not None and refused[0] in (b"SUBSCRIBE", b"UNSUBSCRIBE") and self._on_refused is not None:
                    if refused[0] == b"SUBSCRIBE":
                        self.refused_pending.update(refused[1])
                    self._on_refused(refused[0], refused[1])
                self.refusals += 1
                level = logging.WARNING if self.refusals == 1 else logging.DEBUG  # (-LOADING, ten a second)
                log.log(level, "Redis at %s refused a pub/sub command: %s", self._address, reply)
                if not self.ready.done() and self._again is None:
                    # Maybe the ready mark: a Redis still loading its data (or running a
                    # long script) takes SUBSCRIBE but answers PING with an error, and
                    # nothing else would ever ask again.
                    self._again = asyncio.get_running_loop().call_later(READY_AGAIN_S, self._mark_again)
            elif reply == READY_MARK or reply == [b"pong", READY_MARK]:
                self._answered(b"PING")
                # Every command written before the mark is answered now: it stands for the
                # subscriptions only if no channel's SUBSCRIBE was refused without one written
                # again and answered since (a script may end between a refusal and the mark).
                # Else the SUBSCRIBE written again is followed by a mark of its own
                # (Subscriber._subscribe_again).
                if not self.ready.done() and not self.refused_pending:
                    self.ready.set_result(None)
            elif isinstance(reply, list) and len(reply) == 3 and reply[0] != b"pong":
                if reply[0] in (b"subscribe", b"unsubscribe"):
                    self._answered(reply[0].upper(), reply[1])
                    if reply[0] == b"subscribe" and not self.awaits(b"SUBSCRIBE", reply[1]):
                        self.refused_pending.discard(reply[1])
                self._on_message(reply[0], reply[1], reply[2])
            else:  # a health check's pong
                self._answered(b"PING")

    def _check_deadline(self) -> None:
        self._deadline = None
        if not self._sent:
            return
        loop = asyncio.get_running_loop()
        due = self._sent[0][2] + self._answer_s
        if loop.time() < due:
            self._deadline = loop.call_at(due, self._check_deadline)
            return
        log.warning(
            "pub/sub connection to Redis at %s: no answer to %s within %.1f s; connecting again",
            self._address, self._sent[0][0].decode(), self._answer_s,
        )  # fmt: skip
        self.close()

    def _answered(self, name: bytes, channel: bytes | None = None) -> None:
        """One answer to the oldest command (`channel`: which of its channels)."""
        if not self._sent or self._sent[0][0] != name:
            self._sent.clear()  # (lost track, which the order of replies rules out: start over)
            return
        channels = self._sent[0][1]
        if channel is not None and channel in channels:
            channels.remove(channel)
        if not channels:
            self._sent.popleft()

    def awaits(self, name: bytes, channel: bytes) -> bool:
        """Whether a `name` command written for `channel` is still to be answered."""
        return any(sent == name and channel in channels for sent, channels, _ in self._sent)

    def send(self, *command: bytes | str) -> None:
        """Write a SUBSCRIBE, UNSUBSCRIBE or PING, and expect its answers."""
        self.send_all([command])

    def send_all(self, commands: list[tuple[bytes | str, ...]]) -> None:
        """Write these commands in one go (one send), and expect their answers."""
        if self.transport is None or self.transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for command in commands:
            name = command[0].encode() if isinstance(command[0], str) else command[0]
            channels = [c for c in command[1:] if isinstance(c, bytes)] if name != b"PING" else []
            self._sent.append((name, channels, now))
        if self._deadline is None and self._answer_s > 0:
            self._deadline = loop.call_at(self._sent[0][2] + self._answer_s, self._check_deadline)
        self.transport.write(b"".join(_pack(command) for command in commands))

    def mark(self) -> None:
        """Ask for the ready mark (answered once everything written before it is done)."""
        self.send("PING", READY_MARK)

    def _mark_again(self) -> None:
        self._again = None
        if not self.ready.done():
            self.mark()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._again is not None:
            self._again.cancel()
        if self._deadline is not None:
            self._deadline.cancel()
        if not self.lost.done():
            self.lost.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Subscriber:
    """Subscriptions to channels, messages to `on_message`, on a connection kept alive."""

    def __init__(
        self,
        client: LeanRedis,
        on_message: OnMessage,
        on_ready: Callable[[], None] | None = None,
        unsubscribe_within_s: float = 0.0,
    ) -> None:
        self._client = client
        self._on_message = on_message
        # Called once each connection (the first included) is subscribed to every channel
        # wanted when it was made.
        self._on_ready = on_ready
        self._wanted: set[bytes] = set()
        # Channels whose SUBSCRIBE Redis refused, to be written again (see _refused).
        self._refused_again: set[bytes] = set()
        self._again: asyncio.TimerHandle | None = None
        # Channels dropped but not yet unsubscribed (see unsubscribe), and the timer that
        # writes their UNSUBSCRIBE if no SUBSCRIBE takes it along first.
        self._unsubscribe_within_s = unsubscribe_within_s
        self._dropped: dict[bytes, None] = {}
        self._drop_timer: asyncio.TimerHandle | None = None
        self._pushes: _Pushes | None = None
        self._keeper: asyncio.Task[None] | None = None
        options = client.connection_pool.connection_kwargs
        self._health_s = float(options.get("health_check_interval") or HEALTH_CHECK_S)
        self._answer_s = float(options.get("socket_timeout") or 5.0)
        # How many times a connection was made (the first included).
        self.connections = 0

    @property
    def ready(self) -> bool:
        """Whether a connection is up and subscribed to what was wanted when it was made."""
        pushes = self._pushes
        return pushes is not None and pushes.ready.done() and not pushes.lost.done()

    async def start(self) -> None:
        """Connect (raises RedisError when Redis cannot be reached), then keep connected."""
        self._pushes = await self._connect()
        self._keeper = asyncio.create_task(self._keep(), name="pubsub-keeper")

    async def aclose(self) -> None:
        if self._again is not None:
            self._again.cancel()
        self._stop_drop_timer()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._pushes is not None:
            self._pushes.close()

    def subscribe(self, *channels: str) -> None:
        """Subscribe; each channel's confirmation comes to on_message as b"subscribe" (at
        once, or once the connection is back)."""
        names = [c.encode() for c in channels]
        self._wanted.update(names)
        for name in names:
            self._dropped.pop(name, None)  # (subscribed still, and confirmed again below)
        if self._pushes is not None:
            self._pushes.send_all([*self._take_dropped(), ("SUBSCRIBE", *names)])

    def unsubscribe(self, *channels: str) -> None:
        """Drop channels. Their UNSUBSCRIBE goes along with the next SUBSCRIBE (one send,
        one answer to wake for), or `unsubscribe_within_s` from now, whichever comes first;
        the owner ignores what they carry meanwhile."""
        names = [c.encode() for c in channels]
        self._wanted.difference_update(names)
        if self._pushes is None:
            return
        if self._unsubscribe_within_s <= 0:
            self._pushes.send("UNSUBSCRIBE", *names)
            return
        self._dropped.update(dict.fromkeys(names))
        if self._drop_timer is None:
            self._drop_timer = asyncio.get_running_loop().call_later(self._unsubscribe_within_s, self._write_dropped)

    def _take_dropped(self) -> list[tuple[bytes | str, ...]]:
        """The UNSUBSCRIBE owed for dropped channels (none if none), taken."""
        self._stop_drop_timer()
        if not self._dropped:
            return []  # (never a bare UNSUBSCRIBE: that drops every channel)
        names, self._dropped = list(self._dropped), {}
        return [("UNSUBSCRIBE", *names)]

    def _write_dropped(self) -> None:
        self._drop_timer = None
        owed = self._take_dropped()
        if owed and self._pushes is not None:
            self._pushes.send_all(owed)

    def _stop_drop_timer(self) -> None:
        if self._drop_timer is not None:
            self._drop_timer.cancel()
            self._drop_timer = None

    async def _connect(self) -> _Pushes:
        # The handshake (AUTH, SELECT) as a plain RESP2 connection, then the transport goes
        # to a protocol that reads pushes.
        plain = await self._client._dial(resp3=False)
        pushes = _Pushes(self._heard, plain._address, self._refused, self._answer_s)
        pushes.transport = plain.hand_over(pushes)
        self.connections += 1
        self._refused_again.clear()
        self._dropped.clear()  # (a new connection holds only the channels wanted)
        self._stop_drop_timer()
        if self._wanted:
            pushes.send("SUBSCRIBE", *self._wanted)
        pushes.mark()
        if self._on_ready is not None:
            on_ready = self._on_ready
            pushes.ready.add_done_callback(lambda _: on_ready())
        return pushes

    def _refused(self, command: bytes, channels: list[bytes]) -> None:
        """Redis refused a SUBSCRIBE or UNSUBSCRIBE of `channels` (-BUSY: a script runs long):
        not awaited any more, and written again shortly, for those still wanted (a SUBSCRIBE)
        or still not (an UNSUBSCRIBE: else the connection stayed subscribed to them until it
        was replaced, Redis sending it their messages all along)."""
        loop = asyncio.get_running_loop()
        if command == b"UNSUBSCRIBE":
            self._dropped.update(dict.fromkeys(c for c in channels if c not in self._wanted))
            if self._dropped and self._drop_timer is None:
                self._drop_timer = loop.call_later(READY_AGAIN_S, self._write_dropped)
            return
        self._refused_again.update(channels)
        if self._again is None:
            self._again = loop.call_later(READY_AGAIN_S, self._subscribe_again)

    def _subscribe_again(self) -> None:
        self._again = None
        again = sorted(self._refused_again & self._wanted)
        self._refused_again.clear()
        pushes = self._pushes
        if pushes is not None:
            pushes.refused_pending &= self._wanted  # (a channel dropped since: no longer owed)
        if again:
            self.subscribe(*(c.decode() for c in again))
        if pushes is not None and not pushes.ready.done():
            pushes.mark()  # (a mark before this SUBSCRIBE could not stand for it)

    def _heard(self, kind: bytes, channel: bytes, data: bytes | int) -> None:
        pushes = self._pushes
        if kind == b"subscribe" and pushes is not None and pushes.awaits(b"SUBSCRIBE", channel):
            return  # not the last SUBSCRIBE of the channel: its answer is still to come
        self._on_message(kind, channel, data)

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        delay = REDIAL_MIN_S
        while True:
            pushes = self._pushes
            assert pushes is not None
            done, _ = await asyncio.wait({pushes.lost}, timeout=self._health_s)
            if not done:
                if loop.time() - pushes.last_heard < self._health_s:
                    continue
                asked = loop.time()
                pushes.send("PING")
                done, _ = await asyncio.wait({pushes.lost}, timeout=self._answer_s)
                if not done and pushes.last_heard >= asked:
                    continue
                log.warning("pub/sub connection to Redis went quiet; connecting again")
                pushes.close()
            if pushes.ready.done() and loop.time() - pushes.made_at >= STABLE_S:
                delay = REDIAL_MIN_S
            else:
                # Dropped before it was ready or soon after (a Redis at maxclients, a proxy
                # with nothing behind it, a client-output-buffer kill): a failed dial too, or
                # the keeper would spin.
                log.warning("pub/sub connection to Redis closed %s; trying again in %.2f s",
                            "soon after it was ready" if pushes.ready.done() else "before it was ready", delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, REDIAL_MAX_S)
            while True:
                try:
                    self._pushes = await self._connect()
                    break
                except (RedisError, OSError) as exc:
                    log.warning("pub/sub connection to Redis lost (%s); trying again in %.2f s", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, REDIAL_MAX_S)
