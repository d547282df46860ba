"""One attempt at POSTing a callback: resolve once, check every address, connect only to a
checked one, with bounded time and a bounded read of the answer.

The request goes to the checked IP address itself; the `Host` header and (for https) the
TLS server name and certificate check keep the URL's host name. Redirects are not followed
(a 3xx is a failed attempt), no proxy from the environment is used, and no connection is
kept for another request (a pooled connection is keyed by address, not by host name).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from publicsuffixlist import PublicSuffixList

from shared.callbacks import CallbackTarget, IPAddress, address_refusal
from shared.settings import Settings

__all__ = ["MAX_RESPONSE_BYTES", "AttemptFailed", "Refused", "Resolver", "checked", "new_client", "post"]

# The answer's body is read up to this much, then the connection is dropped (nothing in it
# is used; it is read so a small answer ends its exchange cleanly).
MAX_RESPONSE_BYTES = 64 * 1024
# ...and for at most this long: the status line is the receiver's answer, so a body that
# stalls or breaks off after a 2xx must not turn a delivered callback into a retry.
MAX_RESPONSE_READ_S = 1.0
USER_AGENT = "coderunner-callbacks/1"


# Lookups run on threads of their own. A name whose server never answers holds a lookup for
# the system resolver's whole timeout (the attempt's timeout cuts the wait, not the lookup);
# on the loop's shared resolver a few of them would stall the worker's own Redis reconnects.
LOOKUP_THREADS = 8
# Lookups at once under one registrable domain (example.com, shop.co.uk, you.github.io: the
# Public Suffix List's): names under a domain whose server never answers (any number of
# them, `*.example.com`) hold at most this many threads.
LOOKUPS_PER_DOMAIN = 2
# The resolver call (a module attribute, so tests can stand in for DNS).
getaddrinfo = socket.getaddrinfo


class AttemptFailed(Exception):
    """The attempt got no answer (resolution, connection, timeout); worth retrying.

    Its text is stored as the callback's `lastError`, which a job token's holder (a
    browser) reads: never an address. `where` (the addresses tried) is for the log only.
    """

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


class Refused(Exception):
    """The URL's host resolves to an address the policy refuses; not retried."""


def new_client(settings: Settings, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """The client one sender uses for every attempt (its TLS context is built once, here;
    `verify` is for tests that trust a certificate of their own)."""
    total_s = settings.callback_timeout_ms / 1000
    return httpx.AsyncClient(
        verify=verify,
        timeout=httpx.Timeout(total_s, connect=settings.callback_connect_timeout_ms / 1000),
        follow_redirects=False,
        trust_env=False,
        # No cap of the pool's own: the sender already bounds its attempts in flight, and
        # httpcore 1.0.9's pool keeps a connection for good when a request is cancelled
        # after the connection was assigned but before it opened (encode/httpcore#1093;
        # an attempt's timeout can land there). With a cap, enough of those would fail every
        # later delivery of this worker with PoolTimeout, until a restart.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
    )


@functools.cache
def _suffix_list() -> PublicSuffixList:
    """The list shipped with the package (parsed once, about 0.1 s; never fetched)."""
    return PublicSuffixList()


class _Lookup:
    __slots__ = ("on_thread", "task", "waiters")

    def __init__(self) -> None:
        self.task: asyncio.Future[list[Any]] | None = None
        self.waiters = 0
        self.on_thread = False


class Resolver:
    """One sender's name lookups, so that names that never resolve cannot hold up the rest.

    A lookup runs on a thread and cannot be stopped once it does. So callbacks to one name
    share its lookup while it runs; at most LOOKUPS_PER_DOMAIN names of one domain are looked
    up at once and at most LOOKUP_THREADS in all, the rest waiting their turn without a
    thread; and a lookup whose every caller has given up before its turn never runs.
    """

    def __init__(self, threads: int = LOOKUP_THREADS, per_domain: int = LOOKUPS_PER_DOMAIN) -> None:
        self._suffixes = _suffix_list()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="callback-dns")
        self._threads = asyncio.Semaphore(threads)
        self._per_domain = per_domain
        self._domains: dict[str, tuple[asyncio.Semaphore, int]] = {}  # (its turns, lookups queued or running)
        self._running: dict[tuple[str, int], _Lookup] = {}

    async def resolve(self, target: CallbackTarget) -> list[IPAddress]:
        """The host's addresses, in the resolver's order (an IP host is its own).

        Raises:
            AttemptFailed: the name does not resolve, or has no IPv4 or IPv6 address.
        """
        if target.literal:
            return [ipaddress.ip_address(target.host)]
        key = (target.host, target.port)
        lookup = self._running.get(key)
        if lookup is None:
            lookup = self._running[key] = _Lookup()
            lookup.task = asyncio.ensure_future(self._lookup(lookup, *key))
            lookup.task.add_done_callback(lambda task: self._done(key, lookup, task))
        assert lookup.task is not None
        lookup.waiters += 1
        try:
            infos = await asyncio.shield(lookup.task)
        except (socket.gaierror, UnicodeError) as exc:
            raise AttemptFailed(f"host {target.host} could not be resolved ({exc.args[-1] if exc.args else exc})") from None
        finally:
            lookup.waiters -= 1
            if not lookup.waiters and not lookup.on_thread and not lookup.task.done():
                # Nobody waits for it any more and it has not begun: drop it from the queue.
                self._forget(key, lookup)
                lookup.task.cancel()
        found: list[IPAddress] = []
        for family, _type, _proto, _name, sockaddr in infos:
            if family in (socket.AF_INET, socket.AF_INET6):
                ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
                if ip not in found:
                    found.append(ip)
        if not found:
            raise AttemptFailed(f"host {target.host} has no IPv4 or IPv6 address")
        return found

    def _done(self, key: tuple[str, int], lookup: _Lookup, task: asyncio.Future[list[Any]]) -> None:
        self._forget(key, lookup)
        if not task.cancelled():
            task.exception()  # (seen, even when every caller gave up waiting for it)

    def _forget(self, key: tuple[str, int], lookup: _Lookup) -> None:
        if self._running.get(key) is lookup:
            del self._running[key]

    async def _lookup(self, lookup: _Lookup, host: str, port: int) -> list[Any]:
        name = host.rstrip(".").lower()
        domain = self._suffixes.privatesuffix(name) or name
        turns, queued = self._domains.get(domain) or (asyncio.Semaphore(self._per_domain), 0)
        self._domains[domain] = (turns, queued + 1)
        try:
            async with turns, self._threads:
                lookup.on_thread = True
                found = self._executor.submit(getaddrinfo, host, port, type=socket.SOCK_STREAM)
                return await asyncio.wrap_future(found)
        finally:
            turns, queued = self._domains[domain]
            if queued > 1:
                self._domains[domain] = (turns, queued - 1)
            else:
                del self._domains[domain]

    def close(self) -> None:
        """Stop waiting for lookups (the threads end once their lookups return)."""
        for lookup in list(self._running.values()):
            if lookup.task is not None:
                lookup.task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


def checked(target: CallbackTarget, addresses: list[IPAddress], allow_private: bool) -> list[IPAddress]:
    """`addresses` if the policy allows every one of them.

    Raises:
        Refused: saying why the first refused address is (not which it is: the job's owner
            reads this, and must not learn internal DNS from it).
    """
    for ip in addresses:
        why = address_refusal(ip, allow_private)
        if why is not None:
            raise Refused(f"{target.host} is {why}" if target.literal else f"{target.host} resolves to {why}")
    return addresses


async def post(
    client: httpx.AsyncClient,
    target: CallbackTarget,
    addresses: list[IPAddress],
    headers: dict[str, str],
    content: Callable[[], AsyncIterator[bytes]],
    answered: Callable[[int], None] = lambda status: None,
) -> int:
    """POST to the first of the checked `addresses` that accepts a connection; the answer's
    HTTP status, also given to `answered` the moment it is known (the caller's own deadline
    may fall while the body is read).

    Raises:
        AttemptFailed: no address could be reached, or the exchange broke off.
    """
    headers = {**headers, "Host": target.host_header}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" and not target.literal else {}
    last: Exception | None = None
    for ip in addresses:
        try:
            async with client.stream(
                "POST", target.url_for(ip), headers=headers, content=content(), extensions=extensions
            ) as response:
                answered(response.status_code)
                try:
                    async with asyncio.timeout(MAX_RESPONSE_READ_S):
                        read = 0
                        async for chunk in response.aiter_raw():
                            read += len(chunk)
                            if read >= MAX_RESPONSE_BYTES:
                                break
                except (httpx.HTTPError, TimeoutError):
                    pass  # the connection is dropped; the status stands
                return response.status_code
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            last = exc
            continue
        except httpx.TimeoutException as exc:
            raise AttemptFailed(type(exc).__name__, where=str(ip)) from None
        except httpx.HTTPError as exc:
            raise AttemptFailed(f"{type(exc).__name__}: {exc}", where=str(ip)) from None
    raise AttemptFailed(f"could not connect: {last}", where=", ".join(map(str, addresses)))
