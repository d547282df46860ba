"""Pusher protocol signing: pure HMAC helpers, no network.

Three signatures exist in the protocol: the HTTP API request signature (server -> soketi),
the private-channel subscription signature (handed to a browser by channel-auth), and the
webhook signature (soketi -> the API, on a channel's first subscriber).
"""

from __future__ import annotations

import hashlib
import hmac
import re

import msgspec

__all__ = ["Webhook", "WebhookEvent", "channel_auth", "signed_query", "valid_socket_id", "webhook_signature"]

_SOCKET_ID = re.compile(r"[0-9]{1,20}\.[0-9]{1,20}")  # (ASCII digits; fullmatch: no newline after)


def valid_socket_id(socket_id: str) -> bool:
    """Pusher socket ids look like `123.456`; anything else is refused before signing."""
    return bool(_SOCKET_ID.fullmatch(socket_id))


def channel_auth(key: str, secret: str, socket_id: str, channel: str) -> str:
    """The `auth` value a client sends with `pusher:subscribe` for a private channel."""
    digest = hmac.new(secret.encode(), f"{socket_id}:{channel}".encode(), hashlib.sha256).hexdigest()
    return f"{key}:{digest}"


def signed_query(
    method: str, path: str, body: bytes, key: str, secret: str, timestamp_s: int, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """Query parameters that authenticate one Pusher HTTP API request (`extra`: the request's
    own, which the signature covers too)."""
    params = {
        **(extra or {}),
        "auth_key": key,
        "auth_timestamp": str(timestamp_s),
        "auth_version": "1.0",
    }
    if body:
        params["body_md5"] = hashlib.md5(body).hexdigest()
    query = "&".join(f"{k}={params[k]}" for k in sorted(params))
    to_sign = f"{method.upper()}\n{path}\n{query}"
    params["auth_signature"] = hmac.new(secret.encode(), to_sign.encode(), hashlib.sha256).hexdigest()
    return params


class WebhookEvent(msgspec.Struct, frozen=True):
    name: str
    channel: str = ""


class Webhook(msgspec.Struct, frozen=True):
    """What soketi POSTs to a webhook URL (only the fields read here)."""

    events: list[WebhookEvent]
    time_ms: int | None = None  # when it was sent (every Pusher-protocol server says)


def webhook_signature(secret: str, body: bytes) -> str:
    """`X-Pusher-Signature` of a webhook: the HMAC-SHA256 of its raw body, in hex."""
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
