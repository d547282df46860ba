"""redis-py's asyncio client with its commands sent over one pipelined connection.

A command through redis-py's own path costs its caller several times the CPU of the round
trip itself: a pool checkout and release, a retry wrapper, a timeout context per read and
observability hooks, every time. Measured on the project's 2-core VM with uvloop: 120-150
us of CPU per GET through redis-py 8.1, about 30 us over a bare protocol with hiredis. The
worker and the API send about ten commands per job, and redis-py was close to half of
their busy time (py-spy at 4 grader clients).

LeanRedis keeps redis-py's interface (its command methods and reply callbacks, scripts,
pipelines, exceptions and Retry policy) and replaces the transport:
- every command goes out at once on one connection and is answered in order, hiredis
  parsing the replies, so concurrent callers share it without a pool;
- a pipeline (MULTI/EXEC or not) is written in one piece, so no other caller's command
  lands inside it;
- a command unanswered after `socket_timeout` ends the connection (later replies could no
  longer be matched to their commands): everything waiting on it fails with TimeoutError,
  and the client's Retry policy decides what is sent again, on a new connection, as with
  redis-py;
- a caller that stops waiting (cancelled) leaves the connection alone: its reply is read
  and dropped when it comes.

Not for: WATCH (connection state every caller would share), and blocking commands (a
BLMOVE or XREAD BLOCK holds up every command queued behind it, and one whose caller gave
up would still go on blocking in Redis, and might still move an item nobody then reads).
Those go through BlockingLeanRedis, which gives each command a connection of its own and
closes one whose caller gave up, so Redis drops the pending block (as redis-py does).
Pub/sub goes through leanredis.subscriber.

Of redis-py's connection options it honours the URL (host and port or unix path, TLS and
the ssl_* options in _TLS_OPTIONS, username, password, db; another ssl_* option is refused), socket_timeout, socket_connect_timeout, client_name, protocol and
retry; socket_keepalive and health_check_interval have no effect on command connections
(the command timeout is what notices a dead peer; the Subscriber PINGs its own).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import ssl
from typing import Any

import hiredis
import redis.utils
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, RedisError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["BlockingLeanRedis", "DialError", "DialTimeoutError", "LeanRedis", "NeverSent"]


class NeverSent(Exception):
    """Marks an error raised before the command was written to any connection (its dial
    failed): Redis certainly never ran it, so a caller that must not send a command twice
    may still send it again, or by another way."""


class DialError(RedisConnectionError, NeverSent):
    """The connection could not be made (refused, unreachable): nothing was sent."""


class DialTimeoutError(RedisTimeoutError, NeverSent):
    """The connection was not made in time: nothing was sent."""

# redis-py's own reply options (redis.client's EMPTY_RESPONSE and NEVER_DECODE).
_EMPTY_RESPONSE = "EMPTY_RESPONSE"
_NEVER_DECODE = "NEVER_DECODE"

# RESP3 push messages (hiredis >= 3.2 gives them a type of their own).
_PUSH = getattr(hiredis, "PushNotification", None)
# The protocol redis-py's own connections speak unless told (3 from redis-py 6 on): reply
# callbacks are chosen for it, so this connection speaks it too.
_DEFAULT_PROTOCOL = getattr(redis.utils, "DEFAULT_RESP_VERSION", 2)

# What hiredis hands back for "no whole reply yet": its default, False, is also a reply
# (RESP3's boolean false), which would then be dropped and every later reply shifted.
NOT_ENOUGH_DATA = object()

_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))


def _pack(args: tuple[Any, ...]) -> bytes:
    name = args[0]
    if isinstance(name, str) and " " in name:  # "SCRIPT LOAD": the server wants two words
        args = (*name.split(), *args[1:])
    try:
        return hiredis.pack_command(args)
    except TypeError as exc:  # what redis-py's encoder raises for a value it cannot send
        raise DataError(f"Invalid input: {exc}") from None


def _error(message: str) -> RedisError:
    """The exception redis-py raises for an error reply (NOSCRIPT is NoScriptError, LOADING
    a BusyLoadingError that its Retry policy retries, ...)."""
    code = message.split(" ")[0]
    found = BaseParser.EXCEPTION_CLASSES.get(code)
    if found is None:
        return ResponseError(message)
    message = message[len(code) + 1 :]
    if isinstance(found, dict):
        found = found.get(message, ResponseError)
    return found(message)


def _fresh(error: RedisError) -> RedisError:
    """A copy for one more caller: an exception object raised in several tasks would gather
    all their tracebacks."""
    return type(error)(*error.args)



# The TLS options of redis-py's that the dial applies (any other is refused, not ignored).
_TLS_OPTIONS = frozenset(
    {"ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_cert_reqs", "ssl_check_hostname", "ssl_min_version",
     "ssl_ciphers", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_include_verify_flags",
     "ssl_exclude_verify_flags"}
)  # fmt: skip

class _Waiting:
    """A command, or a pipeline of `count` commands (`count` None: one command, answered
    by its reply rather than a list), sent and not yet answered in full."""

    __slots__ = ("count", "deadline", "future", "replies")

    def __init__(self, future: asyncio.Future[Any], count: int | None, deadline: float) -> None:
        self.future = future
        self.count = count
        self.replies: list[Any] = []
        self.deadline = deadline


class _Connection(asyncio.Protocol):
    def __init__(self, address: str, timeout_s: float | None) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._reader = hiredis.Reader(replyError=_error, notEnoughData=NOT_ENOUGH_DATA)
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        # Set once the connection is unusable; every later send fails with it at once.
        self.broken: RedisError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
            if _PUSH is not None and isinstance(reply, _PUSH):
                continue  # RESP3 out-of-band news (none is asked for here): not a reply
            if not waiting:
                self._end(RedisConnectionError(f"Redis at {self._address} sent a reply nobody asked for"))
                return
            head = waiting[0]
            future = head.future
            if head.count is None:
                waiting.popleft()
                if not future.done():
                    if isinstance(reply, Exception):  # an error reply, made an exception by _error
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
                continue
            head.replies.append(reply)
            if len(head.replies) == head.count:
                waiting.popleft()
                if not future.done():
                    future.set_result(head.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc else ""
        self._end(RedisConnectionError(f"Connection to Redis at {self._address} closed{why}"))

    def send(self, data: bytes, count: int | None = None) -> asyncio.Future[Any]:
        """Write `data`, one command or a pipeline of `count`, and return the future of its
        reply (for a pipeline, the list of its `count` replies)."""
        future = self._loop.create_future()
        if self.broken is not None:
            future.set_exception(_fresh(self.broken))
            return future
        deadline = self._loop.time() + self._timeout_s if self._timeout_s else 0.0
        self._waiting.append(_Waiting(future, count, deadline))
        assert self._transport is not None
        self._transport.write(data)
        if self._timer is None and self._timeout_s:
            self._timer = self._loop.call_at(deadline, self._check_deadline)
        return future

    def _check_deadline(self) -> None:
        # Replies come in order, so only the oldest command can be late: while it is not,
        # nothing is. One timer per connection, not one per command.
        self._timer = None
        if not self._waiting:
            return
        head = self._waiting[0]
        if self._loop.time() >= head.deadline:
            self._end(RedisTimeoutError(f"Redis at {self._address} did not answer within {self._timeout_s} s"))
        else:
            self._timer = self._loop.call_at(head.deadline, self._check_deadline)

    def _end(self, error: RedisError) -> None:
        if self.broken is None:
            self.broken = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting:
            future = self._waiting.popleft().future
            if not future.done():
                future.set_exception(_fresh(error))
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        self._end(RedisConnectionError(f"Connection to Redis at {self._address} closed by the client"))

    def hand_over(self, protocol: asyncio.Protocol) -> asyncio.Transport:
        """Give the (idle, handshake done) transport to another protocol; this one is done.
        Raises the connection's error if it was lost meanwhile."""
        if self.broken is not None:
            raise _fresh(self.broken)
        assert self._transport is not None and not self._waiting
        transport, self._transport = self._transport, None
        self.broken = RedisConnectionError("handed over")
        transport.set_protocol(protocol)
        return transport


async def _no_op(*_: Any) -> None:
    pass


class LeanRedis(Redis):
    """A redis-py asyncio client whose commands and pipelines share one connection.

    Made like a Redis client (`LeanRedis.from_url(url, socket_timeout=..., retry=...)`);
    its connection pool is used only by pub/sub.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = self.connection_pool.connection_kwargs
        if options.get("decode_responses") or self.single_connection_client:
            raise ValueError("LeanRedis answers bytes, over its own connection")
        self._options = options
        self._retry = options.get("retry")
        self._lean: _Connection | None = None
        # The dial under way, which every caller needing a connection meanwhile awaits.
        self._dialing: asyncio.Future[_Connection] | None = None
        self._closed = False
        self._tls_made = False
        self._tls_context: ssl.SSLContext | None = None

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return _LeanPipeline(self, transaction)

    def register_script(self, script: Any) -> AsyncScript:
        return _LeanScript(self, script)

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            reply = await self._request(_pack(args))
        except ResponseError:
            if _EMPTY_RESPONSE in options:
                return options[_EMPTY_RESPONSE]
            raise
        return await self._parsed(args[0], reply, options)

    async def _parsed(self, command_name: Any, reply: Any, options: dict[str, Any]) -> Any:
        """The reply as redis-py gives it: through the command's reply callback, if any."""
        callback = self.response_callbacks.get(command_name)
        if callback is None:
            return reply
        options.pop(_EMPTY_RESPONSE, None)
        options.pop(_NEVER_DECODE, None)
        options.pop("keys", None)
        parsed = callback(reply, **options)
        return await parsed if inspect.isawaitable(parsed) else parsed

    async def _request(self, data: bytes, count: int | None = None) -> Any:
        """Send one command, or a pipeline of `count`, under the client's Retry policy."""
        if self._retry is None:
            return await self._send(data, count)
        return await self._retry.call_with_retry(lambda: self._send(data, count), _no_op)

    async def ping_once(self) -> None:
        """One PING outside the retry policy (sent again once, on a new connection, if the
        kept one had broken): whether Redis answers now, for a caller that would rather give
        up than wait out the retries, such as a worker on its way out."""
        try:
            await self._send(_pack(("PING",)))
        except NeverSent:
            raise
        except RedisConnectionError:
            await self._send(_pack(("PING",)))

    def _send(self, data: bytes, count: int | None = None) -> asyncio.Future[Any]:
        lean = self._lean
        if lean is not None and lean.broken is None:
            return lean.send(data, count)
        return asyncio.ensure_future(self._dial_and_send(data, count))

    async def _dial_and_send(self, data: bytes, count: int | None) -> Any:
        connection = await self._connected()
        return await connection.send(data, count)

    async def _connected(self) -> _Connection:
        """The connection, dialled if need be. Callers arriving while a dial is under way
        share its outcome (its connection, or its error, at once for all), and one of them
        giving up does not stop it for the others."""
        if self._closed:
            raise RedisError("the client is closed")
        lean = self._lean
        if lean is not None and lean.broken is None:
            return lean
        if self._dialing is None:
            self._dialing = asyncio.ensure_future(self._dial())
            self._dialing.add_done_callback(self._dialled)
        return await asyncio.shield(self._dialing)

    def _dialled(self, dialing: asyncio.Future[_Connection]) -> None:
        self._dialing = None
        if dialing.cancelled() or dialing.exception() is not None:  # retrieved: no warning
            return
        if self._closed:
            dialing.result().close()
        else:
            self._lean = dialing.result()

    async def _dial(self, resp3: bool | None = None) -> _Connection:
        """A new connection, its handshake done; RESP2 with `resp3` False (pub/sub)."""
        options = self._options
        loop = asyncio.get_running_loop()
        timeout_s = options.get("socket_timeout")
        connect_timeout_s = options.get("socket_connect_timeout") or timeout_s
        unix = issubclass(self.connection_pool.connection_class, UnixDomainSocketConnection)
        address = options.get("path") if unix else f"{options.get('host', 'localhost')}:{options.get('port', 6379)}"
        protocol = _Connection(str(address), timeout_s)
        try:
            async with asyncio.timeout(connect_timeout_s):
                if unix:
                    await loop.create_unix_connection(lambda: protocol, options["path"])
                else:
                    await loop.create_connection(
                        lambda: protocol,
                        options.get("host", "localhost"),
                        int(options.get("port", 6379)),
                        ssl=self._tls(),
                    )
                for command in self._handshake(resp3):
                    await protocol.send(_pack(command))
        except TimeoutError:
            protocol.close()
            raise DialTimeoutError(f"Timeout connecting to Redis at {address}") from None
        except OSError as exc:
            protocol.close()
            raise DialError(f"Error connecting to Redis at {address}: {exc}") from exc
        except BaseException:
            protocol.close()
            raise
        return protocol

    def _tls(self) -> ssl.SSLContext | None:
        """The TLS context, made at the first dial and kept: made afresh, it read the CA and
        certificate files on the event loop at every dial (every blocking read a client gave
        up on dials a new connection)."""
        if not self._tls_made:
            self._tls_context = self._ssl_context()
            self._tls_made = True
        return self._tls_context

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not issubclass(self.connection_pool.connection_class, SSLConnection):
            return None
        options = self._options
        unknown = sorted(
            name for name, value in options.items() if name.startswith("ssl") and name not in _TLS_OPTIONS and value is not None
        )
        if unknown:
            # Refused, not ignored: a TLS setting silently dropped is a connection that fails
            # (or, worse, one less strict than asked for) for no reason anyone can see.
            raise RedisConnectionError(f"TLS options this client does not support: {', '.join(unknown)}")
        context = ssl.create_default_context(
            cafile=options.get("ssl_ca_certs"), capath=options.get("ssl_ca_path"), cadata=options.get("ssl_ca_data")
        )
        reqs = options.get("ssl_cert_reqs")
        if isinstance(reqs, str):
            reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}.get(reqs.lower(), reqs)
        if reqs not in (None, ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise RedisConnectionError(f"ssl_cert_reqs={reqs!r}: not none, optional or required")
        if reqs == ssl.CERT_NONE or options.get("ssl_check_hostname") is False:
            context.check_hostname = False
        if reqs is not None:
            context.verify_mode = reqs
        if options.get("ssl_min_version") is not None:
            context.minimum_version = ssl.TLSVersion(options["ssl_min_version"])
        if options.get("ssl_ciphers"):
            context.set_ciphers(options["ssl_ciphers"])
        for flag in options.get("ssl_include_verify_flags") or ():
            context.verify_flags |= flag
        for flag in options.get("ssl_exclude_verify_flags") or ():
            context.verify_flags &= ~flag
        if options.get("ssl_certfile"):
            context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"), options.get("ssl_password"))
        return context

    def _handshake(self, resp3: bool | None) -> list[tuple[Any, ...]]:
        """What a new connection sends before anything else: the protocol, the URL's
        credentials and db."""
        options = self._options
        commands: list[tuple[Any, ...]] = []
        password, user = options.get("password"), options.get("username")
        credentials = (user or "default", password) if password else ()
        if resp3 is None:
            resp3 = int(options.get("protocol") or _DEFAULT_PROTOCOL) == 3
        if resp3:
            commands.append(("HELLO", 3, "AUTH", *credentials) if credentials else ("HELLO", 3))
        elif credentials:
            # (AUTH with a password alone where no user is named: Redis before 6 knows no
            # users, and refuses `AUTH default <password>`.)
            commands.append(("AUTH", *credentials) if user else ("AUTH", password))
        if int(options.get("db") or 0):
            commands.append(("SELECT", int(options["db"])))
        if options.get("client_name"):
            commands.append(("CLIENT", "SETNAME", options["client_name"]))
        return commands

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        self._closed = True
        if self._lean is not None:
            self._lean.close()
            self._lean = None
        await super().aclose(close_connection_pool)


class _LeanScript(AsyncScript):
    """redis-py's script object, called on its own LeanRedis without redis-py's per-call
    imports and pipeline checks (a quarter of a script call's CPU on the client, measured:
    about 45 us against 33 us). The same EVALSHA, loaded again on NOSCRIPT."""

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        if client is not None and client is not self.registered_client:
            return await super().__call__(keys, args, client)
        keys = keys or ()
        args = args or ()
        lean = self.registered_client
        try:
            return await lean.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await lean.script_load(self.script)
            return await lean.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


class BlockingLeanRedis(LeanRedis):
    """LeanRedis for commands that block in Redis (XREAD BLOCK): each command has a
    connection to itself, one of at most `max_connections` kept for reuse.

    A command that fails or whose caller stops waiting takes its connection with it: a
    blocking read may still be pending in Redis and would hold up the next command sent
    there. A caller finding every connection busy waits up to `pool_timeout_s` for one,
    then gets a ConnectionError, as from redis-py's BlockingConnectionPool.
    """

    def __init__(self, *args: Any, max_connections: int, pool_timeout_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._free = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._pool_timeout_s = pool_timeout_s

    @classmethod
    def from_url(cls, url: str, *, max_connections: int, pool_timeout_s: float = 5.0, **kwargs: Any) -> BlockingLeanRedis:  # type: ignore[override]
        client = cls(
            connection_pool=ConnectionPool.from_url(url, **kwargs),
            max_connections=max_connections,
            pool_timeout_s=pool_timeout_s,
        )
        client.auto_close_connection_pool = True  # its own pool, closed with it (as from redis-py's from_url)
        return client

    async def _request(self, data: bytes, count: int | None = None) -> Any:
        # A slot is taken once per command, outside the retry policy: a pool that stays full
        # is "No connection available." after pool_timeout_s, as with redis-py, not retried.
        await self._take_slot()
        try:
            return await super()._request(data, count)
        finally:
            self._free.release()

    async def _take_slot(self) -> None:
        if not self._free.locked():
            await self._free.acquire()  # free: no wait, and no timer to set up
            return
        try:
            await asyncio.wait_for(self._free.acquire(), self._pool_timeout_s)
        except TimeoutError:
            raise RedisConnectionError("No connection available.") from None

    async def _send(self, data: bytes, count: int | None = None) -> Any:  # type: ignore[override]
        if self._closed:
            raise RedisError("the client is closed")
        connection = None
        while self._idle and connection is None:
            connection = self._idle.pop()
            if connection.broken is not None:
                connection = None
        if connection is None:
            connection = await self._dial()
        try:
            reply = await connection.send(data, count)
        except BaseException:
            connection.close()
            raise
        if self._closed:
            connection.close()
        else:
            self._idle.append(connection)
        return reply

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        self._closed = True
        for connection in self._idle:
            connection.close()
        self._idle.clear()
        await super().aclose(close_connection_pool)


class _LeanPipeline(Pipeline):
    """redis-py's Pipeline, executed as one write on the LeanRedis connection."""

    def __init__(self, client: LeanRedis, transaction: bool) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction, None)
        self._client = client

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = self.command_stack
        try:
            if not stack:
                return []
            if self.scripts or self.watching:
                raise RedisError("a LeanRedis pipeline takes plain commands only (no scripts, no WATCH)")
            packed = [_pack(args) for args, _ in stack]
            transaction = self.is_transaction or self.explicit_transaction
            if transaction:
                packed = [_MULTI, *packed, _EXEC]
            replies = await self._client._request(b"".join(packed), len(packed))
            if transaction:
                replies = self._exec_replies(replies)
            results: list[Any] = []
            for (args, options), reply in zip(stack, replies, strict=True):
                if isinstance(reply, Exception):
                    error = reply
                    if raise_on_error:
                        raise error
                    results.append(error)
                else:
                    results.append(await self._client._parsed(args[0], reply, dict(options)))
            return results
        finally:
            await self.reset()

    @staticmethod
    def _exec_replies(replies: list[Any]) -> list[Any]:
        """The commands' replies from MULTI's, each QUEUED and EXEC's."""
        answer = replies[-1]
        if isinstance(answer, Exception):
            # EXECABORT: a command was refused while queueing; like redis-py, raise why.
            refused = next((r for r in replies[1:-1] if isinstance(r, Exception)), None)
            raise refused if refused is not None else answer
        if answer is None:
            raise WatchError("Watched variable changed.")
        return answer  # type: ignore[no-any-return]
