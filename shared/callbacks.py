"""Callbacks: which URLs and addresses a result may be POSTed to, and how it is signed.

Pure rules, no I/O: the API checks a `callbackUrl` with them at submit (after resolving it
without blocking its loop), and the sender checks the addresses again when it sends,
then connects to one of the very addresses it checked (so a DNS answer that changed in
between, DNS rebinding, gains nothing).

Address policy (`address_refusal`):
- always refused: unspecified (0.0.0.0/8, ::), link-local (169.254.0.0/16, fe80::/10),
  multicast, broadcast and reserved ranges, documentation and benchmarking ranges, cloud
  metadata endpoints (169.254.169.254, 169.254.170.2, fd00:ec2::254, 100.100.100.200),
  Teredo and the deprecated IPv4-compatible IPv6 form;
- refused unless CALLBACK_ALLOW_PRIVATE: loopback (127.0.0.0/8, ::1), private
  (10/8, 172.16/12, 192.168/16, fc00::/7) and carrier-grade NAT (100.64.0.0/10);
- IPv6 forms that carry an IPv4 address (::ffff:a.b.c.d, NAT64 64:ff9b::/96 and
  64:ff9b:1::/48, 6to4 2002::/16) are judged by that IPv4 address;
- everything else (public unicast) is allowed.

Signature: `X-Coderunner-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">` with
the deployment's CALLBACK_SECRET, `<timestamp>` being `X-Coderunner-Timestamp` (Unix seconds).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from urllib.parse import urlsplit

import msgspec

from shared.errors import FieldError, ValidationError

__all__ = [
    "ATTEMPT_HEADER",
    "CALLBACK_DUE_LUA",
    "DELIVERY_HEADER",
    "FIELD",
    "JOB_HEADER",
    "MAX_URL_LENGTH",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "CallbackTarget",
    "IPAddress",
    "address_refusal",
    "parse_callback_url",
    "retry_delay_ms",
    "sign",
    "signature",
    "signer",
]

FIELD = "callbackUrl"
MAX_URL_LENGTH = 2048
SIGNATURE_HEADER = "X-Coderunner-Signature"
TIMESTAMP_HEADER = "X-Coderunner-Timestamp"
# `<jobId>:<attempt>`: names one delivery attempt. Every attempt of a job carries the same
# body; a receiver processes a job's result once by its `jobId`.
DELIVERY_HEADER = "X-Coderunner-Delivery"
JOB_HEADER = "X-Coderunner-Job-Id"
ATTEMPT_HEADER = "X-Coderunner-Attempt"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Lua for every script that writes a job's result: in the same step, the job's callback (if
# it has one) becomes due now, so no result is stored without its delivery queued.
# callback_due(callback hash key, due set key, now ms, ttl s, job id).
CALLBACK_DUE_LUA = """
local function callback_due(cb, due, now, ttl, id)
  if redis.call('HEXISTS', cb, 'url') == 1 then
    redis.call('HSET', cb, 'endedAtMs', now, 'nextAttemptAtMs', now)
    redis.call('EXPIRE', cb, ttl)
    redis.call('ZADD', due, now, id)
  end
end
"""

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network

# (168.63.129.16: Azure's host agent, WireServer, a public address only its VMs reach.)
_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "168.63.129.16", "fd00:ec2::254")
)
_LINK_LOCAL_V4 = _V4("169.254.0.0/16")
# (network, why) in the order they are judged. `private` ones yield to CALLBACK_ALLOW_PRIVATE.
_ALWAYS_V4: tuple[tuple[_V4, str], ...] = (
    (_V4("0.0.0.0/8"), "an unspecified address"),
    (_LINK_LOCAL_V4, "a link-local address"),
    (_V4("224.0.0.0/4"), "a multicast address"),
    (_V4("240.0.0.0/4"), "a reserved address"),  # includes 255.255.255.255 (broadcast)
    (_V4("192.0.0.0/24"), "a reserved address"),
    (_V4("192.0.2.0/24"), "a documentation address"),
    (_V4("198.51.100.0/24"), "a documentation address"),
    (_V4("203.0.113.0/24"), "a documentation address"),
    (_V4("198.18.0.0/15"), "a benchmarking address"),
    (_V4("192.88.99.0/24"), "a reserved address"),
)
_PRIVATE_V4: tuple[tuple[_V4, str], ...] = (
    (_V4("127.0.0.0/8"), "a loopback address"),
    (_V4("10.0.0.0/8"), "a private address"),
    (_V4("172.16.0.0/12"), "a private address"),
    (_V4("192.168.0.0/16"), "a private address"),
    (_V4("100.64.0.0/10"), "a carrier-grade NAT address"),
)
_NAT64 = _V6("64:ff9b::/96")
# Local-use NAT64 (RFC 8215): where the IPv4 address sits depends on the operator's prefix
# length (RFC 6052), and what it reaches is the operator's network: a private destination.
_LOCAL_NAT64 = _V6("64:ff9b:1::/48")
_TEREDO = _V6("2001::/32")
# IETF protocol assignments (RFC 2928), Teredo aside: benchmarking (2001:2::/48), ORCHID
# (2001:10::/28) and the rest, special-purpose addresses no receiver of ours lives at.
_IETF_ASSIGNMENTS = _V6("2001::/23")
_IPV4_COMPATIBLE = _V6("::/96")
_GLOBAL_UNICAST_V6 = _V6("2000::/3")
_PRIVATE_V6 = (_V6("fc00::/7"), _V6("fec0::/10"))  # unique local, and the deprecated site-local
_DOCUMENTATION_V6 = (_V6("2001:db8::/32"), _V6("3fff::/20"))

_DNS_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# What a host that only an IP parser would take looks like: digits, dots and hex forms
# (`2130706433`, `127.1`, `0x7f.0.0.1`, `017.0.0.1`); only canonical dotted quads pass.
_NUMERIC_LAST_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)")


def _local_nat64_reaches_metadata(ip: ipaddress.IPv6Address) -> bool:
    """Whether a local-use NAT64 address (RFC 8215) could stand for a cloud metadata or
    link-local IPv4 address under any prefix length its operator may use (/48, /56, /64,
    /96: RFC 6052 puts the IPv4 address at a different place for each, around the u octet)."""
    n = int(ip)

    def bits(start: int, length: int) -> int:
        return (n >> (128 - start - length)) & ((1 << length) - 1)

    candidates = (
        (bits(48, 16) << 16) | bits(72, 16),
        (bits(56, 8) << 24) | bits(72, 24),
        bits(72, 32),
        bits(96, 32),
    )
    return any(
        (v4 := ipaddress.IPv4Address(candidate)) in _METADATA or v4 in _LINK_LOCAL_V4 for candidate in candidates
    )


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return None


def address_refusal(ip: IPAddress, allow_private: bool) -> str | None:
    """Why a callback must not be sent to `ip` (e.g. "a private address"), or None if it may."""
    if ip in _METADATA:
        return "a cloud metadata address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "a scoped (link-local) address"
        if ip in _LOCAL_NAT64:
            if not allow_private:
                return "a local-use NAT64 address"
            # (Allowed as private, but metadata and link-local stay refused, as everywhere.)
            return "a local-use NAT64 address that may reach a metadata address" if _local_nat64_reaches_metadata(ip) else None
        inner = _embedded_v4(ip)
        if inner is not None:
            why = address_refusal(inner, allow_private)
            return f"{why} (embedded in IPv6)" if why else None
        if ip.is_unspecified:
            return "an unspecified address"
        if ip.is_loopback:
            return None if allow_private else "a loopback address"
        if ip.is_multicast:
            return "a multicast address"
        if ip.is_link_local:
            return "a link-local address"
        if ip in _IPV4_COMPATIBLE:
            return "a reserved address"
        if any(ip in net for net in _PRIVATE_V6):
            return None if allow_private else "a private address"
        if ip in _TEREDO:
            return "a Teredo address"
        if ip in _IETF_ASSIGNMENTS:
            return "a reserved address"
        if any(ip in net for net in _DOCUMENTATION_V6):
            return "a documentation address"
        if ip not in _GLOBAL_UNICAST_V6:
            return "a reserved address"
        return None
    for net, why in _ALWAYS_V4:
        if ip in net:
            return why
    for net, why in _PRIVATE_V4:
        if ip in net:
            return None if allow_private else why
    return None


class CallbackTarget(msgspec.Struct, frozen=True, kw_only=True):
    """A checked callback URL, split the way the sender needs it."""

    scheme: str  # "https" or "http"
    host: str  # lower-case DNS name, or an IP address without brackets
    port: int
    target: str  # path and query, at least "/"
    literal: bool  # `host` is an IP address (nothing to resolve)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def host_key(self) -> str:
        """The receiver a delivery goes to, `host:port`: what CALLBACK_MAX_PER_HOST counts by."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def url_for(self, ip: IPAddress) -> str:
        """The URL that connects to `ip` (one of the host's checked addresses)."""
        where = f"[{ip}]" if isinstance(ip, ipaddress.IPv6Address) else str(ip)
        return f"{self.scheme}://{where}:{self.port}{self.target}"


def _refuse(message: str) -> ValidationError:
    return ValidationError([FieldError(FIELD, message)])


def parse_callback_url(url: str, allow_http: bool) -> CallbackTarget:
    """Check the form of a callback URL (not where it points: see `address_refusal`).

    Raises:
        ValidationError: naming `callbackUrl`.
    """
    if len(url) > MAX_URL_LENGTH:
        raise _refuse(f"must be at most {MAX_URL_LENGTH} characters")
    if not url or any(not 0x21 <= ord(ch) <= 0x7E for ch in url):
        raise _refuse("must be a non-empty ASCII URL without spaces (percent-encode the rest, punycode the host)")
    if "\\" in url:
        raise _refuse("must not contain a backslash")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. a bracketed host that is no IPv6 address
        raise _refuse(f"is not a valid URL ({exc})") from None
    allowed = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in allowed:
        raise _refuse("must be an https URL" if not allow_http else "must be an http or https URL")
    if not url.lower().startswith(f"{parts.scheme}://"):
        raise _refuse(f"must start with {parts.scheme}://")
    if "@" in parts.netloc:
        raise _refuse("must not contain credentials")
    if parts.fragment or url.endswith("#"):
        raise _refuse("must not have a fragment")
    try:
        port = parts.port
    except ValueError:
        raise _refuse("has an invalid port") from None
    host = parts.hostname or ""
    if not host:
        raise _refuse("must name a host")
    bracketed = parts.netloc.startswith("[")
    literal = False
    if bracketed:
        if "%" in host:
            raise _refuse("must not use a scoped IPv6 address")
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise _refuse("has an invalid IPv6 address") from None
        literal = True
    else:
        labels = host.split(".")
        if _NUMERIC_LAST_LABEL.fullmatch(labels[-1]):
            try:
                host = str(ipaddress.IPv4Address(host))
            except ValueError:
                raise _refuse("has a host that is neither a name nor a dotted-quad IPv4 address") from None
            literal = True
        elif len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
            raise _refuse("has an invalid host name")
    if port == 0:
        raise _refuse("has an invalid port")
    port = port or (443 if parts.scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return CallbackTarget(scheme=parts.scheme, host=host, port=port, target=target, literal=literal)


def signer(secret: str, timestamp_s: int) -> hmac.HMAC:
    """An HMAC to feed the body to (in pieces, for a streamed body); `signature()` of it is
    the `X-Coderunner-Signature` value."""
    return hmac.new(secret.encode(), f"{timestamp_s}.".encode(), hashlib.sha256)


def signature(mac: hmac.HMAC) -> str:
    return "sha256=" + mac.hexdigest()


def sign(secret: str, timestamp_s: int, body: bytes) -> str:
    """The `X-Coderunner-Signature` value of a body sent at `timestamp_s`."""
    mac = signer(secret, timestamp_s)
    mac.update(body)
    return signature(mac)


def retry_delay_ms(attempt: int, first_ms: int, max_ms: int) -> int:
    """How long to wait after failed attempt number `attempt` (1, 2, ...): doubling, capped."""
    return min(max_ms, first_ms * 2 ** min(max(attempt - 1, 0), 30))
