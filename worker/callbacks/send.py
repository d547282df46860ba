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

import httpx

from shared.callbacks import CallbackTarget, IPAddress, address_refusal
from shared.settings import Settings

__all__ = ["MAX_RESPONSE_BYTES", "AttemptFailed", "Refused", "new_client", "post"]

# The answer's body is read up to this much, then the connection is dropped (nothing in it
# is used; it is read so a small answer ends its exchange cleanly).
MAX_RESPONSE_BYTES = 64 * 1024
USER_AGENT = "coderunner-callbacks/1"


# Lookups run on threads of their own. A name whose server never answers holds a lookup for
# the system resolver's whole timeout (the attempt's timeout cuts the wait, not the lookup);
# on the loop's shared resolver a few of them would stall the worker's own Redis reconnects.
# A callback waiting behind stuck lookups only fails its attempt, which is retried later.
LOOKUP_THREADS = 4
_lookups = ThreadPoolExecutor(max_workers=LOOKUP_THREADS, thread_name_prefix="callback-dns")
# The resolver call (a module attribute, so tests can stand in for DNS).
getaddrinfo = socket.getaddrinfo


class AttemptFailed(Exception):
    """The attempt got no answer (resolution, connection, timeout); worth retrying."""


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
        limits=httpx.Limits(max_connections=max(1, settings.callback_concurrency), max_keepalive_connections=0),
        headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
    )


async def resolve(target: CallbackTarget) -> list[IPAddress]:
    """The host's addresses, in the resolver's order (an IP host is its own)."""
    if target.literal:
        return [ipaddress.ip_address(target.host)]
    loop = asyncio.get_running_loop()
    try:
        lookup = functools.partial(getaddrinfo, target.host, target.port, type=socket.SOCK_STREAM)
        infos = await loop.run_in_executor(_lookups, lookup)
    except (socket.gaierror, UnicodeError) as exc:
        raise AttemptFailed(f"host {target.host} could not be resolved ({exc.args[-1] if exc.args else exc})") from None
    found: list[IPAddress] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
            if ip not in found:
                found.append(ip)
    if not found:
        raise AttemptFailed(f"host {target.host} has no IPv4 or IPv6 address")
    return found


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
) -> int:
    """POST to the first of the checked `addresses` that accepts a connection; the answer's
    HTTP status.

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
                read = 0
                async for chunk in response.aiter_raw():
                    read += len(chunk)
                    if read >= MAX_RESPONSE_BYTES:
                        break
                return response.status_code
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            last = exc
            continue
        except httpx.TimeoutException as exc:
            raise AttemptFailed(f"{type(exc).__name__} from {ip}") from None
        except httpx.HTTPError as exc:
            raise AttemptFailed(f"{type(exc).__name__} from {ip}: {exc}") from None
    raise AttemptFailed(f"could not connect to {', '.join(map(str, addresses))}: {last}")
