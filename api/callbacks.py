"""The submit-time check of a `callbackUrl`: its form, and every address its host resolves to.

The rules are shared/callbacks.py's; this adds the resolution, bounded in time. The sender
resolves and checks again when it sends and connects only to an address it checked, so
this check is for the client's sake (a clear 400 now, not a failed delivery later).

A name server that never answers holds a lookup for the system resolver's own timeout: the
wait is cut at RESOLVE_TIMEOUT_S, the lookup is not. So lookups run on a few threads of their
own, never the loop's shared resolver (Redis reconnects and other callers' lookups use it),
and when all of them are taken a submission is refused at once (503, retry shortly) instead
of queueing behind names that may never answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from api.errors import ApiError
from shared.callbacks import FIELD, CallbackTarget, IPAddress, address_refusal, parse_callback_url
from shared.errors import FieldError, ValidationError
from shared.settings import Settings

__all__ = ["RESOLVE_TIMEOUT_S", "check_callback_url"]

RESOLVE_TIMEOUT_S = 3.0
# Lookups at once per API process; a timed-out lookup holds its thread until it returns.
RESOLVE_THREADS = 4
RESOLVE_RETRY_AFTER_MS = 1000


class _Lookups:
    """getaddrinfo on RESOLVE_THREADS threads of its own, refusing work when all are busy."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="callback-dns")
        self._lock = threading.Lock()
        self.busy = 0

    def submit(self, host: str, port: int) -> Future[list[Any]] | None:
        with self._lock:
            if self.busy >= self.threads:
                return None
            self.busy += 1
        future = self._executor.submit(getaddrinfo, host, port, type=socket.SOCK_STREAM)
        future.add_done_callback(self._done)  # when the thread is free, not when we stop waiting
        return future

    def _done(self, _future: Future[list[Any]]) -> None:
        with self._lock:
            self.busy -= 1


# The resolver call (a module attribute, so tests can stand in for DNS).
getaddrinfo = socket.getaddrinfo
_lookups = _Lookups(RESOLVE_THREADS)


def _refused(message: str) -> ValidationError:
    return ValidationError([FieldError(FIELD, message)])


async def check_callback_url(url: str, settings: Settings) -> CallbackTarget:
    """The checked target of `url`.

    Raises:
        ApiError: 503 when this deployment has no CALLBACK_SECRET (it cannot sign).
        ValidationError: naming `callbackUrl`: a bad form, a host that does not resolve, or
            an address the policy refuses.
    """
    if not settings.callback_secret:
        raise ApiError(
            503,
            "callbackUrl cannot be used: this deployment has no CALLBACK_SECRET configured to sign callbacks",
            details=[FieldError(FIELD, "is not available on this deployment (no CALLBACK_SECRET)")],
        )
    target = parse_callback_url(url, settings.callback_allow_http)
    if target.literal:
        addresses: list[IPAddress] = [ipaddress.ip_address(target.host)]
    else:
        addresses = await _resolve(target)
    for ip in addresses:
        why = address_refusal(ip, settings.callback_allow_private)
        if why is not None:
            # A name's addresses are not told: the API must not be a way to read internal DNS.
            where = f"is {why}" if target.literal else f"resolves to {why}"
            raise _refused(f"{where}, which this server does not call back")
    return target


async def _resolve(target: CallbackTarget) -> list[IPAddress]:
    lookup = _lookups.submit(target.host, target.port)
    if lookup is None:
        raise ApiError(
            503,
            "Too many callbackUrl hosts are being resolved at once; retry shortly",
            headers={"Retry-After": "1"},
            retryAfterMs=RESOLVE_RETRY_AFTER_MS,
        )
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.wrap_future(lookup)
    except TimeoutError:
        raise _refused(f"host {target.host} could not be resolved within {RESOLVE_TIMEOUT_S:.0f} s") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise _refused(f"host {target.host} could not be resolved ({exc.args[-1] if exc.args else exc})") from None
    except OSError:
        # getaddrinfo's EAI_SYSTEM comes as a plain OSError (the lookup itself failed here,
        # descriptors run out, say): this server's trouble, not the URL's.
        raise ApiError(
            503,
            "callbackUrl's host could not be looked up right now; retry shortly",
            headers={"Retry-After": "1"},
            retryAfterMs=RESOLVE_RETRY_AFTER_MS,
        ) from None
    found = {
        ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)
    }
    if not found:
        raise _refused(f"host {target.host} has no IPv4 or IPv6 address")
    return sorted(found, key=lambda ip: (ip.version, int(ip)))
