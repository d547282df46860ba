"""Signed callbacks: the address policy, the submit-time check, the delivery scripts, and a
real receiver (an HTTP server on 127.0.0.1 in this process) getting results from real stacks.

Every connection any of these tests makes goes to 127.0.0.1. Refused addresses (10.0.0.1,
169.254.169.254, ...) are only ever handed to the check that refuses them, which decides
before anything connects; host names are resolved by a stand-in resolver, never by DNS.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import http.server
import ipaddress
import itertools
import json
import logging
import re
import shutil
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from api import callbacks as api_callbacks
from api.callbacks import check_callback_url
from api.errors import ApiError
from api.store import JobStore
from launcher.stack import Stack
from shared import keys
from shared.callbacks import address_refusal, parse_callback_url, retry_delay_ms, sign
from shared.errors import ConfigError, ValidationError
from shared.limits import DEFAULT_LIMITS
from shared.messages import FileSpec, JobSpec, JobState
from shared.paths import REPO_ROOT
from shared.settings import Settings, load_settings
from tests.helpers import Api, py_job, self_signed_certificate
from worker.callbacks import CallbackSender
from worker.callbacks import send as send_module
from worker.callbacks.deliveries import Deliveries, Delivery
from worker.callbacks.send import new_client
from worker.messaging.queue import WorkerQueue

# ---------------------------------------------------------------- a receiver


class Receiver:
    """An HTTP server on 127.0.0.1 that records every request and answers from a script:
    each entry is a status to answer, ("sleep", seconds, status), ("redirect", location),
    "endless" (200 and a body that never ends) or "stalled" (200, part of its body, then
    nothing for 10 s)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        # The TLS server names clients asked for (with `tls`).
        self.server_names: list[str | None] = []
        self.hung_up = 0
        self.script: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.requests.append(
                        {"path": self.path, "headers": dict(self.headers.items()), "body": body, "at": time.time()}
                    )
                    steps = receiver.script.get(self.path.split("?")[0], [])
                    step = steps.pop(0) if steps else 200
                    receiver._arrived.notify_all()
                if step == "endless":
                    self._endless()
                    return
                if step == "stalled":
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    self.wfile.write(b"accepted")
                    self.wfile.flush()
                    time.sleep(10)
                    return
                if isinstance(step, tuple) and step[0] == "redirect":
                    self.send_response(302)
                    self.send_header("Location", step[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if isinstance(step, tuple):
                    _, seconds, step = step
                    time.sleep(seconds)
                try:
                    self.send_response(step)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the sender gave up on us already

            def _endless(self) -> None:
                """200, then a body that never ends (until the client hangs up)."""
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    for _ in range(100_000):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                except OSError:
                    receiver.hung_up += 1

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            tls.sni_callback = lambda _sock, name, _ctx: self.server_names.append(name)  # type: ignore[assignment,func-returns-value]
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def path(self, answers: list[Any] | None = None) -> str:
        """A fresh path on this receiver, answering `answers` in turn (then 200)."""
        path = f"/hook/{uuid.uuid4().hex[:8]}"
        with self._lock:
            self.script[path] = list(answers or [])
        return path

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def received(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r["path"] == path]

    def wait(self, path: str, count: int, timeout_s: float = 30) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                got = [r for r in self.requests if r["path"] == path]
                if len(got) >= count:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{path} got {len(got)} requests, wanted {count}")
                self._arrived.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def verified(secret: str, request: dict[str, Any]) -> dict[str, Any]:
    """The request's JSON body, once its signature checks out (the receiver's side)."""
    headers = request["headers"]
    timestamp = headers["X-Coderunner-Timestamp"]
    expected = hmac.new(secret.encode(), timestamp.encode() + b"." + request["body"], hashlib.sha256).hexdigest()
    assert headers["X-Coderunner-Signature"] == f"sha256={expected}"
    assert abs(time.time() - int(timestamp)) < 60
    assert headers["Content-Type"] == "application/json"
    body: dict[str, Any] = json.loads(request["body"])
    assert headers["X-Coderunner-Job-Id"] == body["jobId"]
    assert headers["X-Coderunner-Delivery"] == f"{body['jobId']}:{headers['X-Coderunner-Attempt']}"
    return body


# ---------------------------------------------------------------- the address policy (pure)

REFUSED_ALWAYS = [
    "0.0.0.0", "0.1.2.3", "169.254.169.254", "169.254.170.2", "169.254.1.1", "100.100.100.200",
    "224.0.0.1", "239.255.255.250", "255.255.255.255", "240.0.0.1", "192.0.2.1", "198.51.100.7",
    "203.0.113.9", "198.18.0.1", "::", "fd00:ec2::254", "fe80::1", "ff02::1", "2001:db8::1",
    "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "2001:0:4136:e378::1", "::7f00:1",
    "100::1", "168.63.129.16", "::ffff:168.63.129.16",
    # Special-purpose IPv6 (benchmarking, ORCHID) outside the Teredo block.
    "2001:2::1", "2001:10::1",
    # Local-use NAT64 that may stand for metadata or link-local, under a /96 or a /48 prefix.
    "64:ff9b:1::a9fe:a9fe", "64:ff9b:1:a9fe:a9:fe00::",
]  # fmt: skip
REFUSED_UNLESS_PRIVATE = [
    "127.0.0.1", "127.255.0.9", "10.0.0.1", "172.16.0.1", "172.31.255.255", "192.168.1.1", "100.64.0.1",
    "100.127.255.254", "::1", "fc00::1", "fd12:3456::1", "::ffff:10.0.0.1", "::ffff:127.0.0.1",
    "64:ff9b::a00:1", "2002:c0a8:101::1",
    # Local-use NAT64 (RFC 8215) maps by the operator's own prefix length: under a /48 the
    # low 32 bits (8.8.8.8 here) are not the IPv4 address the translator reaches.
    "64:ff9b:1:a00:0:100:808:808", "64:ff9b:1::808:808",
]  # fmt: skip
ALLOWED = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "172.32.0.1", "100.128.0.1", "2606:4700:4700::1111", "2a00:1450::1"]


@pytest.mark.parametrize("address", REFUSED_ALWAYS)
def test_policy_refuses_always(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert address_refusal(ip, allow_private=False)
    assert address_refusal(ip, allow_private=True), f"{address} must stay refused with CALLBACK_ALLOW_PRIVATE"


@pytest.mark.parametrize("address", REFUSED_UNLESS_PRIVATE)
def test_policy_refuses_private_unless_allowed(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert address_refusal(ip, allow_private=False)
    assert address_refusal(ip, allow_private=True) is None


@pytest.mark.parametrize("address", ALLOWED)
def test_policy_allows_public(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address), allow_private=False) is None


def test_policy_names_metadata() -> None:
    assert address_refusal(ipaddress.ip_address("169.254.169.254"), True) == "a cloud metadata address"
    assert address_refusal(ipaddress.ip_address("fd00:ec2::254"), True) == "a cloud metadata address"
    assert address_refusal(ipaddress.ip_address("168.63.129.16"), False) == "a cloud metadata address"
    assert "embedded" in (address_refusal(ipaddress.ip_address("::ffff:10.1.2.3"), False) or "")


BAD_URLS = {
    "http://example.com/": "https",
    "ftp://example.com/": "https",
    "javascript:alert(1)": "https",
    "file:///etc/passwd": "https",
    "https:example.com": "https://",
    "https://user:pw@example.com/": "credentials",
    "https://example.com@10.0.0.1/": "credentials",
    "https://example.com/a#frag": "fragment",
    "https:///path": "host",
    "https://example.com:0/": "port",
    "https://example.com:70000/": "port",
    "https://exa mple.com/": "ASCII",
    "https://exämple.com/": "ASCII",
    "https://example.com\\@10.0.0.1/": "backslash",
    "https://2130706433/": "dotted-quad",
    "https://127.1/": "dotted-quad",
    "https://0x7f.0.0.1/": "dotted-quad",
    "https://017.0.0.1/": "dotted-quad",
    "https://[fe80::1%25eth0]/": "scoped",
    "https://[not-ipv6]/": "IPv6",
    "https://-bad-.example.com/": "host name",
    "https://" + "a" * 2050 + ".com/": "2048",
    "": "ASCII",
}


@pytest.mark.parametrize("url", list(BAD_URLS))
def test_url_form_refused(url: str) -> None:
    with pytest.raises(ValidationError) as caught:
        parse_callback_url(url, allow_http=False)
    detail = caught.value.details[0]
    assert detail.field == "callbackUrl"
    assert BAD_URLS[url] in detail.message, detail.message


def test_url_form_accepted() -> None:
    t = parse_callback_url("https://Hooks.Example.com/grade?x=1", allow_http=False)
    assert (t.scheme, t.host, t.port, t.target, t.literal) == ("https", "hooks.example.com", 443, "/grade?x=1", False)
    assert t.host_header == "hooks.example.com"
    assert t.url_for(ipaddress.ip_address("93.184.216.34")) == "https://93.184.216.34:443/grade?x=1"
    t = parse_callback_url("http://[::1]:8080", allow_http=True)
    assert (t.host, t.port, t.target, t.literal, t.host_header) == ("::1", 8080, "/", True, "[::1]:8080")
    assert t.url_for(ipaddress.ip_address("::1")) == "http://[::1]:8080/"
    assert parse_callback_url("https://10.0.0.1:8443/x", allow_http=False).literal


def test_signature_and_backoff() -> None:
    body = b'{"jobId":"x"}'
    assert sign("s" * 16, 1700000000, body) == (
        "sha256=" + hmac.new(b"s" * 16, b"1700000000." + body, hashlib.sha256).hexdigest()
    )
    assert [retry_delay_ms(n, 1000, 60000) for n in (1, 2, 3, 4, 7, 8, 100)] == [
        1000, 2000, 4000, 8000, 60000, 60000, 60000,
    ]  # fmt: skip


def test_readme_snippet_verifies_a_signature() -> None:
    """The verification snippet in the README works, and refuses a forged or stale body."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("### Callbacks", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(code.group(1), namespace)
    verify = namespace["verify"]
    secret, body, now = "k" * 24, b'{"jobId":"abc","outcome":"completed"}', int(time.time())
    headers = {"X-Coderunner-Timestamp": str(now), "X-Coderunner-Signature": sign(secret, now, body)}
    assert verify(secret.encode(), headers, body)
    assert not verify(secret.encode(), headers, body + b" ")
    assert not verify(b"another secret", headers, body)
    stale = {"X-Coderunner-Timestamp": str(now - 3600), "X-Coderunner-Signature": sign(secret, now - 3600, body)}
    assert not verify(secret.encode(), stale, body)


def test_settings() -> None:
    base = {"CALLBACK_SECRET": "x" * 16}
    settings = load_settings({**base, "CALLBACK_ALLOW_PRIVATE": "yes", "CALLBACK_ALLOW_HTTP": "0"})
    assert settings.callback_allow_private and not settings.callback_allow_http
    for bad in ({"CALLBACK_ALLOW_PRIVATE": "maybe"}, {"CALLBACK_SECRET": "short"},
                {"CALLBACK_CONNECT_TIMEOUT_MS": "20000"}, {"CALLBACK_BACKOFF_MS": "90000"}):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            load_settings({**base, **bad})
        assert next(iter(bad)) in str(caught.value)
    # The retry window never outlives the result it sends.
    assert load_settings({**base, "RUN_RESULT_TTL": "60"}).callback_window_s == 60
    assert load_settings(base).callback_window_s == 300


async def test_submit_check_resolves_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name is resolved on the check's own threads (no blocking call on the loop),
    and every address it gives is checked: one private address among public ones refuses it."""
    settings = load_settings({"CALLBACK_SECRET": "x" * 16})
    asked: list[str] = []
    answers = {
        "public.test": ["93.184.216.34", "2606:2800:220:1::1"],
        "mixed.test": ["93.184.216.34", "10.1.2.3"],
        "meta.test": ["169.254.169.254"],
    }

    def fake_getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
        asked.append(host)
        if host not in answers:
            raise socket.gaierror(-2, "Name or service not known")
        return [(10 if ":" in a else 2, 1, 6, "", (a, port)) for a in answers[host]]

    monkeypatch.setattr(api_callbacks, "getaddrinfo", fake_getaddrinfo)
    target = await check_callback_url("https://public.test/hook", settings)
    assert target.host == "public.test" and not target.literal
    for url, why in (
        ("https://mixed.test/", "resolves to a private address"),
        ("https://meta.test/", "cloud metadata"),
        ("https://nowhere.test/", "could not be resolved"),
    ):
        with pytest.raises(ValidationError) as caught:
            await check_callback_url(url, settings)
        assert caught.value.details[0].field == "callbackUrl" and why in caught.value.details[0].message
        assert "10.1.2.3" not in caught.value.sentence  # a name's addresses are not told
    # A literal address is judged as it is: nothing to resolve.
    with pytest.raises(ValidationError):
        await check_callback_url("https://10.0.0.1/", settings)
    assert asked == ["public.test", "mixed.test", "meta.test", "nowhere.test"]
    # A failure of the lookup itself (EAI_SYSTEM is a plain OSError: descriptors run out) is
    # the server's, not the URL's: a 503 to retry, not a 500 (review) nor a 400.
    monkeypatch.setattr(api_callbacks, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(OSError(24, "Too many open files")))
    with pytest.raises(ApiError) as failed:
        await check_callback_url("https://broken.test/", settings)
    assert failed.value.status == 503 and "retry" in str(failed.value)


async def test_names_that_never_resolve_hold_only_the_checks_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name server that never answers holds a lookup past the check's timeout; such names
    fill the check's few threads, and then the next check is refused at once (503), while
    the loop's own resolver, shared with everything else in the process, stays free."""
    settings = load_settings({"CALLBACK_SECRET": "x" * 16})
    release = threading.Event()

    def stuck_getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
        release.wait(30)
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(api_callbacks, "getaddrinfo", stuck_getaddrinfo)
    monkeypatch.setattr(api_callbacks, "RESOLVE_TIMEOUT_S", 0.2)
    try:
        for n in range(api_callbacks.RESOLVE_THREADS):
            with pytest.raises(ValidationError, match="could not be resolved within"):
                await check_callback_url(f"https://stuck{n}.test/", settings)
        began = time.monotonic()
        with pytest.raises(ApiError) as busy:
            await check_callback_url("https://next.test/", settings)
        assert busy.value.status == 503 and busy.value.extra["retryAfterMs"] > 0
        assert time.monotonic() - began < 0.1  # refused at once, not after a timeout
        # The loop's resolver is untouched by all this.
        await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo("127.0.0.1", 80), 1.0)
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while api_callbacks._lookups.busy:  # the threads come back once their lookups return
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


class _StuckDns:
    """getaddrinfo standing in for DNS: names under `stuck_domain` hang until `release`,
    others answer at once with 127.0.0.1; it counts the calls and the lookups running."""

    def __init__(self, stuck_domain: str) -> None:
        self.stuck_domain = stuck_domain
        self.release = threading.Event()
        self.asked: list[str] = []
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def __call__(self, host: str, port: int, **kwargs: Any) -> list[Any]:
        with self._lock:
            self.asked.append(host)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if host.endswith(self.stuck_domain):
                self.release.wait(30)
                raise socket.gaierror(-3, "Temporary failure in name resolution")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        finally:
            with self._lock:
                self.running -= 1


async def _give_up_after(resolver: send_module.Resolver, url: str, timeout_s: float) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await resolver.resolve(parse_callback_url(url, False))


async def test_the_senders_stuck_lookups_leave_the_loops_resolver_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Callbacks to names whose server never answers time out their attempts; their lookups
    hold only the sender's own threads, never the resolver the worker reaches Redis with."""
    dns = _StuckDns(".test")
    monkeypatch.setattr(send_module, "getaddrinfo", dns)
    resolver = send_module.Resolver()
    try:
        for n in range(2 * send_module.LOOKUP_THREADS):
            await _give_up_after(resolver, f"https://stuck.domain{n}.test/", 0.1)
        await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo("127.0.0.1", 6379), 1.0)
    finally:
        dns.release.set()
        resolver.close()


async def test_one_domain_that_never_resolves_leaves_the_other_callbacks_lookups_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One tenant's callbacks to names under a domain whose server never answers (any number
    of names, and the same name again and again) hold LOOKUPS_PER_DOMAIN threads at most;
    another tenant's callback host still resolves at once. Callbacks to one name share its
    lookup, and a lookup that every caller gave up on before its turn never runs."""
    dns = _StuckDns(".evil.test")
    monkeypatch.setattr(send_module, "getaddrinfo", dns)
    resolver = send_module.Resolver()
    try:
        hostile = [f"https://n{n}.evil.test/" for n in range(3 * send_module.LOOKUP_THREADS)]
        await asyncio.gather(*(_give_up_after(resolver, url, 0.2) for url in hostile * 3))
        await asyncio.gather(*(_give_up_after(resolver, url, 0.1) for url in hostile))
        began = time.monotonic()
        (address,) = await asyncio.wait_for(resolver.resolve(parse_callback_url("https://hooks.good.test/", False)), 1)
        assert str(address) == "127.0.0.1" and time.monotonic() - began < 0.5
        assert dns.most_running == send_module.LOOKUPS_PER_DOMAIN + 1  # the good one beside them
        assert dns.asked == [*(h.split("/")[2] for h in hostile[:2]), "hooks.good.test"]
    finally:
        dns.release.set()
    await asyncio.sleep(0.2)  # the stuck lookups return; nothing queued starts after them
    assert len(dns.asked) == send_module.LOOKUPS_PER_DOMAIN + 1 and dns.running == 0
    resolver.close()


async def test_the_lookup_bound_is_per_registrable_domain_not_per_suffix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names under one public suffix (co.uk, github.io) belong to many owners: a dead name
    server under x.co.uk must not hold up a lookup under another.co.uk."""
    dns = _StuckDns(".dead.co.uk")
    monkeypatch.setattr(send_module, "getaddrinfo", dns)
    resolver = send_module.Resolver()
    try:
        await asyncio.gather(*(_give_up_after(resolver, f"https://n{n}.dead.co.uk/", 0.1) for n in range(6)))
        (address,) = await asyncio.wait_for(resolver.resolve(parse_callback_url("https://hooks.shop.co.uk/", False)), 1)
        assert str(address) == "127.0.0.1"
        assert dns.asked == ["n0.dead.co.uk", "n1.dead.co.uk", "hooks.shop.co.uk"]
    finally:
        dns.release.set()
        resolver.close()


async def test_callbacks_to_one_name_share_its_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five callbacks to one slow name make one lookup, and each gets its answer; a name
    that never answers holds one thread however often it is asked for."""
    dns = _StuckDns(".evil.test")
    monkeypatch.setattr(send_module, "getaddrinfo", dns)
    resolver = send_module.Resolver()
    try:
        await asyncio.gather(*(_give_up_after(resolver, "https://same.evil.test/", 0.1) for _ in range(5)))
        await _give_up_after(resolver, "https://same.evil.test/", 0.1)
        assert dns.asked == ["same.evil.test"]
        slow = threading.Event()
        real = dns.__call__

        def slow_dns(host: str, port: int, **kwargs: Any) -> list[Any]:
            slow.wait(5)
            return real(host, port, **kwargs)

        monkeypatch.setattr(send_module, "getaddrinfo", slow_dns)
        waiting = [asyncio.create_task(resolver.resolve(parse_callback_url("https://slow.test/", False))) for _ in range(5)]
        await asyncio.sleep(0.1)
        slow.set()
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 2)
        assert [str(a) for (a,) in answers] == ["127.0.0.1"] * 5
        assert dns.asked == ["same.evil.test", "slow.test"]
    finally:
        dns.release.set()
        resolver.close()


# ---------------------------------------------------------------- a stack without workers


@pytest.fixture(scope="module")
def bare_stack() -> Iterator[Stack]:
    """Default callback settings (https only, no private addresses) and no worker, so no
    sender: deliveries queued here stay put for the tests to take by hand."""
    with Stack(with_worker=False) as stack:
        yield stack


@pytest.fixture
def bare_api(bare_stack: Stack) -> Iterator[Api]:
    with Api(bare_stack) as client:
        yield client


@pytest.fixture
async def redis(bare_stack: Stack) -> AsyncIterator[Redis]:
    client = Redis.from_url(bare_stack.redis_url)
    yield client
    await client.aclose()


REFUSED_AT_SUBMIT = {
    "https://10.0.0.1/hook": "private",
    "https://169.254.169.254/latest/meta-data/": "metadata",
    "https://[::1]/hook": "loopback",
    "https://127.0.0.1:8443/hook": "loopback",
    "https://[fd00:ec2::254]/": "metadata",
    "https://[::ffff:192.168.0.1]/": "private",
    "https://100.64.0.1/": "carrier-grade NAT",
    "https://0.0.0.0/": "unspecified",
    "https://[fe80::1]/": "link-local",
    "http://10.0.0.1/": "https",
    "https://2130706433/": "dotted-quad",
    "https://u:p@10.0.0.1/": "credentials",
}


@pytest.mark.stack
@pytest.mark.parametrize("url", list(REFUSED_AT_SUBMIT))
def test_refused_address_is_a_400_at_submit(bare_api: Api, url: str) -> None:
    before = bare_api.get("/v1/jobs").json()["jobs"]
    response = bare_api.post("/v1/execute", json=py_job("print(1)", callbackUrl=url))
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["details"][0]["field"] == "callbackUrl"
    assert REFUSED_AT_SUBMIT[url] in body["error"], body
    assert bare_api.get("/v1/jobs").json()["jobs"] == before  # nothing was queued


@pytest.mark.stack
def test_no_secret_refuses_callbacks(make_stack: Any) -> None:
    stack = make_stack(with_worker=False, CALLBACK_SECRET="")
    api = Api(stack)
    try:
        response = api.post("/v1/execute", json=py_job("print(1)", callbackUrl="https://169.254.169.254/hook"))
        assert response.status_code == 503, response.text
        assert "CALLBACK_SECRET" in response.json()["error"]
        assert response.json()["details"][0]["field"] == "callbackUrl"
        # Without a callbackUrl nothing changes.
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 202
    finally:
        api.close()


# Deliveries these tests queue by hand but never mean to send point here: an address every
# policy refuses before connecting, so even a stray one never leaves the machine.
NEVER_SENT = "https://169.254.169.254/never-sent"


def _spec(callback_url: str | None, collect: bool = False) -> JobSpec:
    return JobSpec(
        job_id=uuid.uuid4().hex,
        language="python",
        version="3.11",
        files=[FileSpec(name="main.py", content="print(1)")],
        limits=DEFAULT_LIMITS,
        created_at_ms=int(time.time() * 1000),
        owner="owner-cb",
        collect_output=collect,
        callback_url=callback_url,
    )


async def _killed_in_queue(redis: Redis, url: str, collect: bool = False) -> str:
    """A job with a callback, ended by a kill while queued: its delivery is due now."""
    store = JobStore(redis, 86400)
    spec = _spec(url, collect)
    assert (await store.enqueue(spec, 10_000, 10_000, 600)).outcome == "queued"
    call = store.kill_call(spec.job_id, 600)
    assert (await store.run(call))[0] == 2
    assert await store.run(call)  # sent twice (its reply lost): one result, one delivery
    assert await redis.zscore(keys.CALLBACKS_DUE, spec.job_id) is not None
    return spec.job_id


@pytest.mark.stack
async def test_delivery_scripts_sent_twice(redis: Redis) -> None:
    job_id = await _killed_in_queue(redis, NEVER_SENT)
    deliveries = Deliveries(redis)
    now = int(time.time() * 1000)
    first = await deliveries.take(job_id, now, 30_000, "tok-1")
    assert first is not None and first.attempt == 1 and not first.collect
    again = await deliveries.take(job_id, now, 30_000, "tok-1")  # the same claim, its reply lost
    assert again == first
    assert await deliveries.take(job_id, now, 30_000, "tok-2") is None  # held: not due
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"attempts"] == b"1" and record[b"state"] == b"pending"
    assert await deliveries.report(first, "retry", now, next_attempt_ms=now + 1, status=500, error="HTTP 500")
    assert not await deliveries.report(first, "retry", now, next_attempt_ms=now + 1, status=500, error="HTTP 500")
    second = await deliveries.take(job_id, now + 5, 30_000, "tok-2")
    assert second is not None and second.attempt == 2
    assert not await deliveries.report(first, "delivered", now)  # a stale holder changes nothing
    assert await deliveries.report(second, "delivered", now + 6, status=204)
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"delivered" and record[b"deliveredAtMs"] == str(now + 6).encode()
    assert await redis.zscore(keys.CALLBACKS_DUE, job_id) is None
    assert await deliveries.take(job_id, now + 10**6, 30_000, "tok-3") is None


@pytest.mark.stack
async def test_finish_and_reap_queue_one_delivery(redis: Redis) -> None:
    """The worker's result scripts queue the delivery with the result, once when sent twice."""
    store = JobStore(redis, 86400)
    for how in ("finish", "reap"):
        spec = _spec(NEVER_SENT)
        await store.enqueue(spec, 10_000, 10_000, 600)
        queue = WorkerQueue(redis, "w-" + uuid.uuid4().hex[:6], 86400, 600)
        claim = await queue.claim(1.0, 0.0)
        assert claim is not None and claim.spec.job_id == spec.job_id
        assert await redis.zscore(keys.CALLBACKS_DUE, spec.job_id) is None  # not before the end
        if how == "finish":
            seq = claim.next_seq  # after the claim's stage{queued}
            for _ in range(2):
                await queue.finish(
                    spec.job_id, claim.attempt, JobState.DONE, seq, b'{"outcome":"completed","seq":%d}' % seq, None
                )
        else:
            await queue.advance(spec.job_id, claim.attempt, [], started=True)
            assert len(await queue.recover_claims(queue.worker_id)) == 1
            assert await queue.recover_claims(queue.worker_id) == []
        assert await redis.zscore(keys.CALLBACKS_DUE, spec.job_id) is not None
        record = await redis.hgetall(keys.callback_key(spec.job_id))
        assert record[b"state"] == b"pending" and record[b"attempts"] == b"0" and b"endedAtMs" in record
        assert 0 < await redis.ttl(keys.callback_key(spec.job_id)) <= 600
        await redis.zrem(keys.CALLBACKS_DUE, spec.job_id)


async def test_a_lost_jobs_run_result_callback_has_what_it_streamed(redis: Redis) -> None:
    """A collecting job lost with its worker: nobody stored its output, but its log holds what
    it streamed (live, over SSE), and its callback's RunResult has it too (it had "" both)."""
    store = JobStore(redis, 86400)
    spec = _spec(NEVER_SENT, collect=True)
    await store.enqueue(spec, 10_000, 10_000, 600)
    queue = WorkerQueue(redis, "w-" + uuid.uuid4().hex[:6], 86400, 600)
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None
    seq = claim.next_seq
    lines = [(seq + i, "stdout" if i % 2 == 0 else "stderr", "chunk", f"line {i} é\n".encode()) for i in range(1200)]
    for at in range(0, len(lines), 100):  # (more than one page of the log)
        await queue.advance(spec.job_id, claim.attempt, lines[at : at + 100], started=True)
    assert len(await queue.recover_claims(queue.worker_id)) == 1  # lost
    delivery = Delivery(job_id=spec.job_id, attempt=1, url=NEVER_SENT, collect=True, ended_at_ms=0, token="t")
    body = json.loads(b"".join([piece async for piece in (await Deliveries(redis).body(delivery)).pieces()]))
    assert body["outcome"] == "lost" and body["jobId"] == spec.job_id
    assert body["stdout"] == "".join(f"line {i} é\n" for i in range(0, 1200, 2)), body["stdout"][:80]
    assert body["stderr"] == "".join(f"line {i} é\n" for i in range(1, 1200, 2))
    assert (body["stdoutEncoding"], body["stderrEncoding"]) == ("utf8", "utf8")


@pytest.mark.stack
async def test_one_receiver_has_at_most_its_bound_in_flight(redis: Redis) -> None:
    """Past CALLBACK_MAX_PER_HOST attempts at one host:port, a delivery there is put off,
    uncounted, until one of them ends; another receiver's goes at once. A lease that ran out
    (its sender died) frees its place by itself."""
    await redis.delete(keys.CALLBACKS_DUE)
    slow = [await _killed_in_queue(redis, f"https://169.254.169.254:8443/never-sent/{i}") for i in range(4)]
    other = await _killed_in_queue(redis, "https://169.254.169.253:8443/never-sent")
    assert await redis.hget(keys.callback_key(slow[0]), "host") == b"169.254.169.254:8443"
    deliveries = Deliveries(redis)
    now = int(time.time() * 1000)
    await redis.zadd(keys.CALLBACKS_DUE, {job_id: now - 10 + i for i, job_id in enumerate(slow)})  # (in order)
    first = await deliveries.take(slow[0], now, 30_000, "tok-0", 2)
    second = await deliveries.take(slow[1], now + 1, 10_000, "tok-1", 2)
    assert isinstance(first, Delivery) and isinstance(second, Delivery)
    assert await deliveries.take(slow[2], now + 2, 30_000, "tok-2", 2) == "put off"
    assert await deliveries.take(slow[3], now + 3, 30_000, "tok-3", 2) == "put off"
    # Due again when the first lease there ends (its sender may have died), not before.
    assert await redis.zscore(keys.CALLBACKS_DUE, slow[2]) == now + 1 + 10_000
    assert await deliveries.take(slow[2], now + 4, 30_000, "tok-2", 2) is None
    assert await redis.hget(keys.callback_key(slow[2]), "attempts") == b"0"
    assert isinstance(await deliveries.take(other, now + 5, 30_000, "tok-o", 2), Delivery)
    # An attempt there ends: the delivery put off first is due at once, the next still waits.
    assert await deliveries.report(first, "retry", now + 6, next_attempt_ms=now + 60_000)
    assert await redis.zscore(keys.CALLBACKS_DUE, slow[2]) == now + 6
    assert await redis.zscore(keys.CALLBACKS_DUE, slow[3]) == now + 1 + 10_000
    third = await deliveries.take(slow[2], now + 7, 30_000, "tok-2", 2)
    assert isinstance(third, Delivery) and third.attempt == 1
    # The second attempt's sender died: when its lease runs out, its place is free again.
    assert await deliveries.take(slow[3], now + 10_000, 30_000, "tok-3", 2) is None  # not due yet
    fourth = await deliveries.take(slow[3], now + 1 + 10_000, 30_000, "tok-3", 2)
    assert isinstance(fourth, Delivery) and fourth.attempt == 1
    # With no bound, nothing is put off.
    assert isinstance(await deliveries.take(slow[0], now + 60_000, 30_000, "tok-00", 0), Delivery)
    await redis.delete(keys.CALLBACKS_DUE)


def _sender_settings(stack: Stack, **env: str) -> Settings:
    return load_settings(
        {
            "REDIS_URL": stack.redis_url,
            "CALLBACK_SECRET": stack.callback_secret,
            "CALLBACK_ALLOW_HTTP": "1",
            "CALLBACK_TIMEOUT_MS": "2000",
            "CALLBACK_CONNECT_TIMEOUT_MS": "1000",
            **env,
        }
    )


async def _one_round(sender: CallbackSender, job_id: str) -> None:
    """One round of the sender over this job's delivery alone."""
    for other in await sender.deliveries.redis.zrange(keys.CALLBACKS_DUE, 0, -1):
        if other.decode() != job_id:
            await sender.deliveries.redis.zrem(keys.CALLBACKS_DUE, other)
    await sender._round()
    while sender._inflight:
        await asyncio.gather(*sender._inflight.values(), return_exceptions=True)


@pytest.mark.stack
async def test_a_sender_whose_own_attempt_outlives_its_lease_polls_instead_of_spinning(
    bare_stack: Stack, redis: Redis
) -> None:
    # The attempt (or its report, on a slow Redis) runs past its lease: its due score is
    # then in the past, the round skips it as in flight, and must still wait a poll.
    job_id = await _killed_in_queue(redis, NEVER_SENT)
    for other in await redis.zrange(keys.CALLBACKS_DUE, 0, -1):
        if other.decode() != job_id:
            await redis.zrem(keys.CALLBACKS_DUE, other)
    sender = CallbackSender(_sender_settings(bare_stack), redis, None, "test")  # type: ignore[arg-type]
    sender._lease_ms = 50
    release = asyncio.Event()

    async def held(_delivery: Any) -> None:
        await release.wait()

    sender._deliver = held  # type: ignore[method-assign]
    rounds = 0
    take_round = sender._round

    async def counted() -> float:
        nonlocal rounds
        rounds += 1
        return await take_round()

    sender._round = counted  # type: ignore[method-assign]
    running = asyncio.create_task(sender.run())
    try:
        await asyncio.sleep(1.0)
        assert job_id in sender._inflight  # still held, its lease long over
        assert rounds <= 10, f"{rounds} rounds in a second"
    finally:
        release.set()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await sender.stop()
        await redis.zrem(keys.CALLBACKS_DUE, job_id)


@pytest.mark.stack
async def test_a_full_sender_takes_the_next_delivery_as_soon_as_an_attempt_ends(
    bare_stack: Stack, redis: Redis
) -> None:
    # One delivery at a time: the second waits, and goes as soon as the first attempt ends,
    # not at the sender's next look at the due set (a second away).
    await redis.delete(keys.CALLBACKS_DUE)
    first, second = [await _killed_in_queue(redis, NEVER_SENT) for _ in range(2)]
    sender = CallbackSender(_sender_settings(bare_stack, CALLBACK_CONCURRENCY="1"), redis, None, "test")  # type: ignore[arg-type]
    release = asyncio.Event()
    started: dict[str, float] = {}

    async def held(delivery: Any) -> None:
        started[delivery.job_id] = time.monotonic()
        await release.wait()

    sender._deliver = held  # type: ignore[method-assign]
    running = asyncio.create_task(sender.run())
    try:
        await asyncio.sleep(0.3)
        assert len(started) == 1
        released_at = time.monotonic()
        release.set()
        for _ in range(100):
            if len(started) == 2:
                break
            await asyncio.sleep(0.01)
        assert set(started) == {first, second}
        assert max(started.values()) - released_at < 0.3, max(started.values()) - released_at
    finally:
        release.set()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await sender.stop()
        await redis.zrem(keys.CALLBACKS_DUE, first, second)


@pytest.mark.stack
async def test_a_receiver_that_never_answers_leaves_the_others_their_deliveries(
    bare_stack: Stack, redis: Redis, receiver: Receiver
) -> None:
    """A tarpit (it takes the connection and never answers) is owed the first six deliveries;
    a healthy receiver's three, queued behind them, still go out at once, not after the
    tarpit's attempts have timed out and left the sender's slots."""
    await redis.delete(keys.CALLBACKS_DUE)
    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen(64)
    stuck = [await _killed_in_queue(redis, f"http://127.0.0.1:{tarpit.getsockname()[1]}/hook") for _ in range(6)]
    path = receiver.path()
    healthy = [await _killed_in_queue(redis, receiver.url(path)) for _ in range(3)]
    settings = _sender_settings(
        bare_stack, CALLBACK_ALLOW_PRIVATE="1", CALLBACK_CONCURRENCY="4", CALLBACK_MAX_PER_HOST="2",
        CALLBACK_TIMEOUT_MS="5000", CALLBACK_CONNECT_TIMEOUT_MS="1000",
    )
    began = time.monotonic()
    try:
        async with new_client(settings) as client:
            sender = CallbackSender(settings, redis, client, "test")
            running = asyncio.create_task(sender.run())
            try:
                while len(receiver.received(path)) < 3 and time.monotonic() - began < 4:
                    await asyncio.sleep(0.02)
                took = time.monotonic() - began
                assert len(receiver.received(path)) == 3, "the healthy receiver waited on the tarpit"
                assert took < 2.0, took
                attempts = [await redis.hget(keys.callback_key(job_id), "attempts") for job_id in stuck]
                assert sorted(attempts) == [b"0"] * 4 + [b"1"] * 2, attempts  # two held, four put off
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                await sender.stop()
    finally:
        tarpit.close()
        await redis.delete(keys.CALLBACKS_DUE)
    for job_id in healthy:
        assert await redis.hget(keys.callback_key(job_id), "state") == b"delivered"


@pytest.mark.stack
async def test_a_receiver_that_cannot_be_reached_keeps_its_addresses_out_of_the_record(
    bare_stack: Stack, redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`lastError` is read by a job token's holder (a browser): it says the receiver could not
    be reached, not which (internal) addresses its name resolved to. The log has them."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    job_id = await _killed_in_queue(redis, f"http://hooks.test:{port}/hook")

    def fake_getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.3", port))]

    monkeypatch.setattr(send_module, "getaddrinfo", fake_getaddrinfo)
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1")
    caplog.set_level(logging.INFO, logger="worker.callbacks.sender")
    async with new_client(settings) as client:
        await _one_round(CallbackSender(settings, redis, client, "test"), job_id)
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"lastError"].startswith(b"could not connect"), record
    assert b"127.0.0.3" not in record[b"lastError"], record
    assert "127.0.0.3" in caplog.text
    await redis.zrem(keys.CALLBACKS_DUE, job_id)


async def test_the_senders_client_leaves_the_bound_on_attempts_to_the_sender() -> None:
    # httpcore 1.0.9 keeps a pooled connection for good when a request is cancelled between
    # its assignment and its opening (encode/httpcore#1093), which an attempt's timeout can
    # do: under a pool cap of CALLBACK_CONCURRENCY, enough of those failed every later
    # delivery of the worker with PoolTimeout. The sender bounds its attempts itself.
    settings = load_settings({"PUSHER_SECRET": "x", "CALLBACK_CONCURRENCY": "2"})
    async with new_client(settings) as client:
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert pool._max_connections == sys.maxsize and pool._max_keepalive_connections == 0


@pytest.mark.stack
async def test_a_claim_answered_too_late_to_send_within_its_lease_sends_nothing(
    bare_stack: Stack, redis: Redis, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim whose answer came late (a slow Redis) leaves less of its lease than an attempt
    may take: sending then could still be under way when another sender takes the delivery,
    and the receiver would get it twice at once. The attempt is spent without a send."""
    path = receiver.path()
    job_id = await _killed_in_queue(redis, f"http://127.0.0.1:{receiver.port}{path}")
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1")
    take = Deliveries.take

    async def slow_take(self: Deliveries, job_id: str, now_ms: int, lease_ms: int, token: str, per_host: int) -> Any:
        delivery = await take(self, job_id, now_ms, lease_ms, token, per_host)
        # (as if its answer came a whole attempt's time after the lease began)
        return msgspec.structs.replace(delivery, leased_at_ms=now_ms - settings.callback_timeout_ms)

    monkeypatch.setattr(Deliveries, "take", slow_take)
    async with new_client(settings) as client:
        await _one_round(CallbackSender(settings, redis, client, "test"), job_id)
    assert receiver.received(path) == []
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"pending" and record[b"attempts"] == b"1", record
    assert record[b"lastError"].startswith(b"no answer within"), record
    await redis.zrem(keys.CALLBACKS_DUE, job_id)


@pytest.mark.stack
@pytest.mark.parametrize("collect", [False, True], ids=["event", "run-result"])
async def test_callbacks_go_out_while_redis_is_at_its_maxmemory(
    bare_stack: Stack, redis: Redis, receiver: Receiver, collect: bool
) -> None:
    """Results stored while Redis is full (their scripts allow it) queue their deliveries;
    taking, reading and reporting them must work then too, or each gets one late try."""
    path = receiver.path()
    job_id = await _killed_in_queue(redis, f"http://127.0.0.1:{receiver.port}{path}", collect=collect)
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1")
    await redis.config_set("maxmemory", 1)  # below what it holds: growing writes are refused
    try:
        with pytest.raises(ResponseError, match="maxmemory"):
            await redis.set("probe", "x")
        async with new_client(settings) as client:
            await _one_round(CallbackSender(settings, redis, client, "test"), job_id)
    finally:
        await redis.config_set("maxmemory", 0)
    (request,) = receiver.received(path)
    assert verified(bare_stack.callback_secret, request)["jobId"] == job_id
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"delivered" and record[b"lastStatus"] == b"200", record


@pytest.mark.stack
async def test_send_connects_to_the_checked_address(
    bare_stack: Stack, redis: Redis, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host name is resolved once; the request goes to a checked address of it, keeping the
    URL's Host header. An address that refuses the connection is passed over."""
    path = receiver.path()
    job_id = await _killed_in_queue(redis, f"http://hooks.test:{receiver.port}{path}")
    resolved: list[str] = []

    def fake_getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
        resolved.append(host)
        # 127.0.0.2 is loopback too, but nothing listens there on the receiver's port.
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("127.0.0.2", "127.0.0.1")]

    monkeypatch.setattr(send_module, "getaddrinfo", fake_getaddrinfo)
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1")
    async with new_client(settings) as client:
        await _one_round(CallbackSender(settings, redis, client, "test"), job_id)
    assert resolved == ["hooks.test"]
    (request,) = receiver.received(path)
    assert request["headers"]["Host"] == f"hooks.test:{receiver.port}"
    body = verified(bare_stack.callback_secret, request)
    assert body["jobId"] == job_id and body["outcome"] == "killed" and body["killedBy"] == "user"
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"delivered" and record[b"lastStatus"] == b"200"


@pytest.mark.stack
async def test_an_attempt_that_fails_in_the_sender_itself_is_reported_and_retried(
    bare_stack: Stack, redis: Redis, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of ours (here the stored result cannot be read) counts as a failed attempt:
    reported with a retry time, so the retry window still ends it, where it used to be left
    to its lease and taken again every 15 s until its record expired."""
    path = receiver.path()
    job_id = await _killed_in_queue(redis, f"http://127.0.0.1:{receiver.port}{path}")

    async def unreadable(_self: Any, _delivery: Any) -> Any:
        raise ValueError("the stored result is not JSON")

    monkeypatch.setattr("worker.callbacks.deliveries.Deliveries.body", unreadable)
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1")
    before = int(time.time() * 1000)
    async with new_client(settings) as client:
        await _one_round(CallbackSender(settings, redis, client, "test"), job_id)
    assert receiver.received(path) == []
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"pending" and record[b"attempts"] == b"1"
    assert record[b"lastError"] == b"the sender failed: ValueError"
    due = await redis.zscore(keys.CALLBACKS_DUE, job_id)
    assert due is not None and before < due <= before + settings.callback_backoff_ms + 5_000
    await redis.zrem(keys.CALLBACKS_DUE, job_id)


@pytest.mark.stack
async def test_send_refuses_a_name_that_now_resolves_private(
    bare_stack: Stack, redis: Redis, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: a name that passed at submit and resolves to a refused address when the
    result is sent is refused there, before any connection, and not retried."""
    path = receiver.path()
    job_id = await _killed_in_queue(redis, f"http://rebind.test:{receiver.port}{path}")

    monkeypatch.setattr(send_module, "getaddrinfo", _StuckDns(".never.test"))  # every name: 127.0.0.1
    settings = _sender_settings(bare_stack)  # no CALLBACK_ALLOW_PRIVATE
    async with new_client(settings) as client:
        await _one_round(CallbackSender(settings, redis, client, "test"), job_id)
    assert receiver.received(path) == []
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"failed" and record[b"attempts"] == b"1"
    assert b"refused: rebind.test resolves to a loopback address" in record[b"lastError"]
    assert await redis.zscore(keys.CALLBACKS_DUE, job_id) is None


@pytest.mark.stack
async def test_send_follows_no_redirect_and_reads_a_bounded_answer(
    bare_stack: Stack, redis: Redis, receiver: Receiver
) -> None:
    """A 3xx is a failed attempt (its Location is never requested); an answer whose body never
    ends is read up to the cap and the attempt counts as delivered, well within its time."""
    elsewhere = receiver.path()
    path = receiver.path([("redirect", receiver.url(elsewhere)), "endless"])
    job_id = await _killed_in_queue(redis, receiver.url(path))
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1", CALLBACK_BACKOFF_MS="1")
    async with new_client(settings) as client:
        sender = CallbackSender(settings, redis, client, "test")
        await _one_round(sender, job_id)
        record = await redis.hgetall(keys.callback_key(job_id))
        assert record[b"state"] == b"pending" and record[b"lastStatus"] == b"302"
        assert record[b"lastError"] == b"HTTP 302"
        await asyncio.sleep(0.01)
        began = time.monotonic()
        await _one_round(sender, job_id)
        assert time.monotonic() - began < 1.5
    record = await redis.hgetall(keys.callback_key(job_id))
    assert record[b"state"] == b"delivered" and record[b"attempts"] == b"2"
    assert len(receiver.received(path)) == 2 and receiver.received(elsewhere) == []
    deadline = time.monotonic() + 5
    while not receiver.hung_up and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert receiver.hung_up == 1  # the sender stopped reading and closed


@pytest.mark.stack
async def test_a_2xx_whose_body_stalls_is_delivered_once(bare_stack: Stack, redis: Redis, receiver: Receiver) -> None:
    """The status line is the receiver's answer: a body that stalls after it (whether the
    read gives up first or the attempt's own deadline falls) must not make a delivered
    callback a retry that posts it again."""
    for timeout_ms in ("2000", "500"):  # the body's read bound first, then the deadline
        path = receiver.path(["stalled"])
        job_id = await _killed_in_queue(redis, receiver.url(path))
        settings = _sender_settings(
            bare_stack, CALLBACK_ALLOW_PRIVATE="1", CALLBACK_BACKOFF_MS="1", CALLBACK_TIMEOUT_MS=timeout_ms,
            CALLBACK_CONNECT_TIMEOUT_MS="400",
        )
        async with new_client(settings) as client:
            sender = CallbackSender(settings, redis, client, "test")
            await _one_round(sender, job_id)
            await asyncio.sleep(0.05)
            await _one_round(sender, job_id)
        record = await redis.hgetall(keys.callback_key(job_id))
        assert (record[b"state"], record[b"lastStatus"], record[b"attempts"]) == (b"delivered", b"200", b"1"), record
        assert len(receiver.received(path)) == 1


@pytest.mark.stack
async def test_https_to_the_checked_address_keeps_the_server_name(
    bare_stack: Stack, redis: Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """https to a host name: the connection goes to the checked address, while TLS asks for
    the URL's host (SNI) and the certificate is checked against it; a certificate for another
    name fails the attempt."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = self_signed_certificate(tmp_path, "DNS:hooks.test")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    tls_receiver = Receiver(tls=server_tls)

    monkeypatch.setattr(send_module, "getaddrinfo", _StuckDns(".never.test"))  # every name: 127.0.0.1
    settings = _sender_settings(bare_stack, CALLBACK_ALLOW_PRIVATE="1", CALLBACK_ALLOW_HTTP="0")
    try:
        path = tls_receiver.path()
        async with new_client(settings, verify=trusting) as client:
            sender = CallbackSender(settings, redis, client, "test")
            good = await _killed_in_queue(redis, f"https://hooks.test:{tls_receiver.port}{path}")
            await _one_round(sender, good)
            wrong = await _killed_in_queue(redis, f"https://other.test:{tls_receiver.port}{path}")
            await _one_round(sender, wrong)
        (request,) = tls_receiver.received(path)
        assert request["headers"]["Host"] == f"hooks.test:{tls_receiver.port}"
        assert verified(bare_stack.callback_secret, request)["jobId"] == good
        assert tls_receiver.server_names[0] == "hooks.test"
        assert (await redis.hget(keys.callback_key(good), "state")) == b"delivered"
        record = await redis.hgetall(keys.callback_key(wrong))
        assert record[b"state"] == b"pending" and b"lastStatus" not in record
        assert b"CERTIFICATE_VERIFY_FAILED" in record[b"lastError"], record
    finally:
        tls_receiver.close()


# ---------------------------------------------------------------- end to end, with workers

CALLBACK_ENV = {
    "CALLBACK_ALLOW_HTTP": "1",
    "CALLBACK_ALLOW_PRIVATE": "1",
    "CALLBACK_BACKOFF_MS": "300",
    "CALLBACK_BACKOFF_MAX_MS": "1000",
    "CALLBACK_TIMEOUT_MS": "1500",
    "CALLBACK_CONNECT_TIMEOUT_MS": "1000",
    "WORKER_MAX_SANDBOXES": "2",
    # A job nobody starts expires soon (the tests that run jobs start them at once).
    "WORKER_WARMUP_MS": "3000",
}


@pytest.fixture(scope="module")
def cb_stack() -> Iterator[Stack]:
    with Stack(extra_env=CALLBACK_ENV) as stack:
        yield stack


@pytest.fixture
def cb_api(cb_stack: Stack) -> Iterator[Api]:
    with Api(cb_stack) as client:
        yield client


def _run(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    job = api.execute(body)
    assert api.start(job).status_code == 202
    return job


def _callback_history(api: Api, job: dict[str, Any], until: str, timeout_s: float = 30) -> list[dict[str, Any]]:
    """Every distinct `callback` the status showed, polled until its state is `until`."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        callback = api.status(job).get("callback")
        if callback is not None and (not seen or seen[-1] != callback):
            seen.append(callback)
        if callback is not None and callback["state"] == until:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"callback never {until}: {seen}")


@pytest.mark.stack
@pytest.mark.sandbox
def test_result_is_delivered_signed(cb_stack: Stack, cb_api: Api, receiver: Receiver) -> None:
    path = receiver.path()
    job = _run(cb_api, py_job("print(6 * 7)", callbackUrl=receiver.url(path)))
    (request,) = receiver.wait(path, 1)
    body = verified(cb_stack.callback_secret, request)
    status = cb_api.status(job)
    assert body == {**status["result"], "jobId": job["jobId"]}
    assert body["outcome"] == "completed" and body["exitCode"] == 0
    assert request["headers"]["X-Coderunner-Attempt"] == "1"
    assert request["headers"]["Host"] == f"127.0.0.1:{receiver.port}"
    history = _callback_history(cb_api, job, "delivered")
    last = history[-1]
    assert last["attempts"] == 1 and last["lastStatus"] == 200 and "lastError" not in last
    assert last["deliveredAtMs"] >= status["updatedAtMs"]
    time.sleep(0.5)
    assert len(receiver.received(path)) == 1


@pytest.mark.stack
@pytest.mark.sandbox
def test_a_result_is_called_back_as_soon_as_it_is_stored(cb_stack: Stack, cb_api: Api, receiver: Receiver) -> None:
    # The worker that stores a result with a callback wakes its own sender: the delivery
    # does not wait for the sender's next look at the due set (POLL_S, a second).
    delays_ms = []
    for _ in range(6):
        path = receiver.path()
        job = _run(cb_api, py_job("print(1)", callbackUrl=receiver.url(path)))
        (request,) = receiver.wait(path, 1)
        stored_at_ms = cb_api.status(job)["updatedAtMs"]
        delays_ms.append(request["at"] * 1000 - stored_at_ms)
    delays_ms.sort()
    assert delays_ms[len(delays_ms) // 2] < 100 and delays_ms[-1] < 400, delays_ms


@pytest.mark.stack
@pytest.mark.sandbox
def test_collected_output_is_delivered_as_the_run_result(cb_stack: Stack, cb_api: Api, receiver: Receiver) -> None:
    path = receiver.path()
    code = "import sys\nsys.stdout.buffer.write('h\\u00e9llo\\n'.encode())\nsys.stderr.buffer.write(b'\\xff\\x00raw')\n"
    job = _run(cb_api, py_job(code, collectOutput=True, callbackUrl=receiver.url(path)))
    (request,) = receiver.wait(path, 1)
    body = verified(cb_stack.callback_secret, request)
    pulled = cb_api.get(f"/v1/jobs/{job['jobId']}/output").json()
    assert body == {**pulled, "jobId": job["jobId"]}
    assert body["stdout"] == "héllo\n"
    assert body["stderrEncoding"] == "base64" and base64.b64decode(body["stderr"]) == b"\xff\x00raw"


@pytest.mark.stack
@pytest.mark.sandbox
def test_receiver_failing_twice_gets_the_third_try(cb_stack: Stack, cb_api: Api, receiver: Receiver) -> None:
    path = receiver.path([500, 500])
    job = _run(cb_api, py_job("print('graded')", callbackUrl=receiver.url(path)))
    history = _callback_history(cb_api, job, "delivered")
    requests = receiver.wait(path, 3)
    assert [r["headers"]["X-Coderunner-Attempt"] for r in requests] == ["1", "2", "3"]
    # The same body every time (a receiver de-duplicates by jobId), each signed afresh.
    assert len({r["body"] for r in requests}) == 1
    for r in requests:
        verified(cb_stack.callback_secret, r)
    # Backing off: at least CALLBACK_BACKOFF_MS, then twice that, between attempts.
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(requests)]
    assert gaps[0] >= 0.25 and gaps[1] >= 0.55, gaps
    # The status went pending (attempts failing with 500) -> delivered on the third.
    # (Between attempts it shows when the next is due; while one is under way, `attempts`
    # counts it and `lastStatus` is still the one before.)
    failed = [c for c in history if c["state"] == "pending" and c.get("lastStatus") == 500]
    assert failed and all(c["lastError"] == "HTTP 500" for c in failed)
    assert any("nextAttemptAtMs" in c for c in failed), history
    assert history[-1]["state"] == "delivered" and history[-1]["attempts"] == 3
    assert history[-1]["lastStatus"] == 200 and "lastError" not in history[-1]
    states = [c["state"] for c in history]
    assert states.index("delivered") == len(states) - 1


@pytest.mark.stack
@pytest.mark.sandbox
def test_receiver_slower_than_the_timeout_is_retried(cb_stack: Stack, cb_api: Api, receiver: Receiver) -> None:
    path = receiver.path([("sleep", 4.0, 200)])
    job = _run(cb_api, py_job("print(1)", callbackUrl=receiver.url(path)))
    history = _callback_history(cb_api, job, "delivered")
    requests = receiver.wait(path, 2)
    assert [r["headers"]["X-Coderunner-Attempt"] for r in requests] == ["1", "2"]
    assert any(c.get("lastError") == "no answer within 1500 ms" for c in history), history
    assert history[-1]["attempts"] == 2


@pytest.mark.stack
@pytest.mark.sandbox
def test_given_up_after_the_retry_window(make_stack: Any, receiver: Receiver) -> None:
    stack = make_stack(**{**CALLBACK_ENV, "CALLBACK_RETRY_FOR_S": "2"})
    api = Api(stack)
    try:
        path = receiver.path([503] * 50)
        job = _run(api, py_job("print(1)", callbackUrl=receiver.url(path)))
        history = _callback_history(api, job, "failed", timeout_s=30)
        last = history[-1]
        assert last["lastStatus"] == 503 and last["lastError"] == "HTTP 503" and "nextAttemptAtMs" not in last
        attempts = len(receiver.received(path))
        assert attempts == last["attempts"] >= 3
        time.sleep(1.5)
        assert len(receiver.received(path)) == attempts  # nothing after giving up
    finally:
        api.close()


@pytest.mark.stack
@pytest.mark.sandbox
def test_killed_while_queued_gets_its_callback(make_stack: Any, receiver: Receiver) -> None:
    """No worker yet: the kill ends the job in the API, which queues the delivery with the
    result; the sender of the first worker to start sends it."""
    stack = make_stack(with_worker=False, **CALLBACK_ENV)
    api = Api(stack)
    try:
        path = receiver.path()
        job = api.execute(py_job("print(1)", collectOutput=True, callbackUrl=receiver.url(path)))
        assert api.status(job)["callback"] == {"state": "pending", "attempts": 0}
        assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
        status = api.wait_state(job, {"killed"})
        assert status["callback"]["state"] == "pending" and "nextAttemptAtMs" in status["callback"]
        time.sleep(0.5)
        assert receiver.received(path) == []
        stack.start_worker()
        (request,) = receiver.wait(path, 1)
        body = verified(stack.callback_secret, request)
        assert body["jobId"] == job["jobId"] and body["outcome"] == "killed" and body["killedBy"] == "user"
        assert body["stdout"] == "" and body["stderr"] == ""  # collectOutput: a RunResult, empty
        # The same RunResult GET /output gives (no output was ever stored: the verdict alone).
        pulled = api.get(f"/v1/jobs/{job['jobId']}/output").json()
        assert {k: v for k, v in body.items() if k != "jobId"} == pulled
        assert _callback_history(api, job, "delivered")[-1]["attempts"] == 1
    finally:
        api.close()


@pytest.mark.stack
@pytest.mark.sandbox
def test_expired_job_gets_its_callback(cb_stack: Stack, cb_api: Api, receiver: Receiver) -> None:
    """Never started: the worker ends it `expired` after WORKER_WARMUP_MS, and sends that."""
    path = receiver.path()
    job = cb_api.execute(py_job("print(1)", callbackUrl=receiver.url(path)))
    (request,) = receiver.wait(path, 1, timeout_s=30)
    body = verified(cb_stack.callback_secret, request)
    assert body["jobId"] == job["jobId"] and body["outcome"] == "expired"
    assert cb_api.status(job)["state"] == "expired"


@pytest.mark.stack
def test_job_without_callback_shows_none(cb_api: Api) -> None:
    job = cb_api.execute(py_job("print(1)"))
    assert "callback" not in cb_api.status(job)
    cb_api.post(f"/v1/jobs/{job['jobId']}/kill")


def test_client_checks_no_real_network() -> None:
    """The callback client never takes a proxy from the environment."""
    settings = load_settings({"CALLBACK_SECRET": "x" * 16})
    client = new_client(settings)
    try:
        assert client.trust_env is False and client.follow_redirects is False
    finally:
        asyncio.run(client.aclose())
