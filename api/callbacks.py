"""The submit-time check of a `callbackUrl`: its form, and every address its host resolves to.

The rules are shared/callbacks.py's; this adds the resolution, on the event loop's resolver
(`loop.getaddrinfo`, which runs in the loop's thread pool), bounded in time. The sender
resolves and checks again when it sends and connects only to an address it checked, so
this check is for the client's sake (a clear 400 now, not a failed delivery later).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from api.errors import ApiError
from shared.callbacks import FIELD, CallbackTarget, IPAddress, address_refusal, parse_callback_url
from shared.errors import FieldError, ValidationError
from shared.settings import Settings

__all__ = ["RESOLVE_TIMEOUT_S", "check_callback_url"]

RESOLVE_TIMEOUT_S = 3.0


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
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise _refused(f"host {target.host} could not be resolved within {RESOLVE_TIMEOUT_S:.0f} s") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise _refused(f"host {target.host} could not be resolved ({exc.args[-1] if exc.args else exc})") from None
    found = {
        ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)
    }
    if not found:
        raise _refused(f"host {target.host} has no IPv4 or IPv6 address")
    return sorted(found, key=lambda ip: (ip.version, int(ip)))
