"""Uploaded blobs (`files[].ref`): check, upload, finalize, execute, and everything refused.

The seed SDK's own flow is in tests/seed_clients/sdk.test.mjs; here are the parts it never
exercises: forged, expired and re-aimed links, bytes that do not match their name, the
per-principal storage bounds, expiry, and a job that keeps its bytes after its blob is gone.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import socket
import time
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import msgspec
import pytest

from api.blobs import _public_base
from launcher.stack import Stack
from shared import keys
from shared.blobs import parse_ref, sign_upload, verify_upload
from shared.codec import encode
from shared.errors import ConfigError, ValidationError
from shared.limits import DEFAULT_LIMITS
from shared.messages import FileInput, JobSpec
from shared.settings import load_settings
from shared.validation import check_files, decode_files, file_refs, spec_files
from tests.conftest import StackFactory
from tests.helpers import Api
from worker.job.blobs import SharedBlobs

SECRET = "pusher-secret"
OWNER = "ab" * 16
DIGEST = "cd" * 32

# Prints each file's size and sha256, so a job shows exactly which bytes it was given.
HASHER = (
    "import hashlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    raw = open(name, 'rb').read()\n"
    "    print(name, len(raw), hashlib.sha256(raw).hexdigest())\n"
)


# ---------------------------------------------------------------- the contract, no Redis


def test_refs_are_sha256_and_lowercase_hex() -> None:
    assert parse_ref(f"sha256:{DIGEST}") == DIGEST
    for bad in (DIGEST, f"sha256:{DIGEST.upper()}", f"sha256:{DIGEST[:-1]}", f"sha1:{DIGEST}", f"sha256:{DIGEST}\n", ""):
        assert parse_ref(bad) is None, bad


def test_upload_links_verify_only_as_signed_and_until_they_expire() -> None:
    link = sign_upload(SECRET, OWNER, DIGEST, 2000)
    query = {k: v[0] for k, v in parse_qs(urlsplit(link).query).items()}
    assert urlsplit(link).path == f"/v1/blobs/uploads/{DIGEST}"
    assert set(query) == {"expires", "sig"} and query["expires"] == "2000"  # the owner id is not shown
    assert verify_upload(SECRET, DIGEST, OWNER, "2000", query["sig"], 1999)
    assert verify_upload(SECRET, DIGEST, OWNER, "2000", query["sig"], 2000)
    assert not verify_upload(SECRET, DIGEST, OWNER, "2000", query["sig"], 2001), "expired"
    assert not verify_upload("other secret", DIGEST, OWNER, "2000", query["sig"], 1999)
    assert not verify_upload(SECRET, "ef" * 32, OWNER, "2000", query["sig"], 1999), "another digest"
    assert not verify_upload(SECRET, DIGEST, "ef" * 16, "2000", query["sig"], 1999), "another owner"
    assert not verify_upload(SECRET, DIGEST, OWNER, "2001", query["sig"], 1999), "a later expiry"
    assert not verify_upload(SECRET, DIGEST, OWNER, "2000", query["sig"][:-1] + "\udcff", 1999)
    assert not verify_upload(SECRET, DIGEST, OWNER, "02000", query["sig"], 1999), "another spelling"


def test_files_by_ref_stay_refs_in_the_spec_and_count_by_their_blobs_size() -> None:
    files = [
        FileInput(name="a.py", content="print(1)"),
        FileInput(name="b.bin", ref=f"sha256:{DIGEST}"),
        FileInput(name="c.bin", ref=f"sha256:{DIGEST}"),
    ]
    assert file_refs(files) == [DIGEST], "each digest once"
    specs = spec_files(files)
    assert [(s.name, s.content, s.ref) for s in specs] == [
        ("a.py", "print(1)", msgspec.UNSET),
        ("b.bin", "", f"sha256:{DIGEST}"),
        ("c.bin", "", f"sha256:{DIGEST}"),
    ]
    assert check_files(specs, 100, {DIGEST: 40}) == 88  # each file counts: 8 + 40 + 40
    with pytest.raises(ValidationError) as too_big:
        check_files(specs, 87, {DIGEST: 40})
    assert too_big.value.details[0].field == "files"
    assert decode_files(specs, 100, {DIGEST: b"\x00\xff"}) == [("a.py", b"print(1)"), ("b.bin", b"\x00\xff"), ("c.bin", b"\x00\xff")]
    for missing in (lambda: check_files(specs, 100, {}), lambda: decode_files(specs, 100)):
        with pytest.raises(ValidationError) as gone:
            missing()
        assert gone.value.details[0].field == "files[1].ref"
    for bad, field in (
        ([FileInput(name="a")], "files[0].content"),
        ([FileInput(name="a", content="x", ref=f"sha256:{DIGEST}")], "files[0]"),
        ([FileInput(name="a", content="x"), FileInput(name="b", ref="sha256:xyz")], "files[1].ref"),
    ):
        with pytest.raises(ValidationError) as refused:
            file_refs(bad)
        assert refused.value.details[0].field == field


class _OldFileSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """FileSpec as workers from before `ref` decode it."""

    name: str
    content: str
    encoding: str = "utf8"


class _OldSpec(msgspec.Struct, kw_only=True, rename="camel"):
    files: list[_OldFileSpec]


def test_a_spec_without_refs_reads_as_before_to_an_older_worker() -> None:
    # A rolling upgrade runs workers from before `ref` (_OldSpec) beside new APIs.
    files = spec_files([FileInput(name="main.py", content="print(1)"), FileInput(name="empty.txt", content="")])
    spec = JobSpec(job_id="j", language="python", version="3", files=files, limits=DEFAULT_LIMITS, created_at_ms=0)
    old = msgspec.json.decode(encode(spec), type=_OldSpec)
    assert [(f.name, f.content) for f in old.files] == [("main.py", "print(1)"), ("empty.txt", "")]
    with_ref = spec_files([FileInput(name="main.py", content="x"), FileInput(name="d.bin", ref=f"sha256:{DIGEST}")])
    with pytest.raises(msgspec.ValidationError, match="ref"):  # refused, never run without the file
        msgspec.json.decode(encode(msgspec.structs.replace(spec, files=with_ref)), type=_OldSpec)


def test_public_api_url_must_be_an_http_url_and_moves_the_links() -> None:
    assert load_settings({"PUBLIC_API_URL": "https://runner.example.com/"}).public_api_url == "https://runner.example.com"
    for bad in ("runner.example.com", "ftp://runner.example.com", "https://runner.example.com/?x=1", "https://u:p@host"):
        with pytest.raises(ConfigError, match="PUBLIC_API_URL"):
            load_settings({"PUBLIC_API_URL": bad})
    request = SimpleNamespace(url=urlsplit("http://127.0.0.1:8000/v1/blobs/check"))
    assert _public_base(request, load_settings({})) == "http://127.0.0.1:8000"  # type: ignore[arg-type]
    moved = load_settings({"PUBLIC_API_URL": "https://runner.example.com/api"})
    assert _public_base(request, moved) == "https://runner.example.com/api"  # type: ignore[arg-type]


# ---------------------------------------------------------------- against a stack


class _FakeQueue:
    """WorkerQueue.blobs over a dict, counting fetches; `gate` holds each fetch until set."""

    def __init__(self, stored: dict[tuple[str, str], bytes]) -> None:
        self.stored = stored
        self.fetches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def blobs(self, owner: str, digests: list[str]) -> dict[str, bytes]:
        self.fetches.append(list(digests))
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return {d: self.stored[(owner, d)] for d in digests if (owner, d) in self.stored}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_shared_blobs_fetch_once_for_jobs_together_and_let_go_with_the_last() -> None:
    one, two = b"one" * 1000, b"two" * 1000
    queue = _FakeQueue({("a", _digest(one)): one, ("a", _digest(two)): two, ("b", _digest(one)): one})
    blobs = SharedBlobs()
    queue.gate.clear()
    together = [asyncio.create_task(blobs.get(queue, "a", [_digest(one), _digest(two)])) for _ in range(5)]
    await asyncio.sleep(0.01)
    queue.gate.set()
    fetched = await asyncio.gather(*together)
    assert queue.fetches == [[_digest(one), _digest(two)]]  # one fetch for all five
    assert all(f.found[_digest(one)] is fetched[0].found[_digest(one)] for f in fetched)  # one copy
    assert fetched[0].found[_digest(one)].data == one and len(blobs) == 2
    # Per principal: "b" has its own entry, fetched for it.
    assert (await blobs.get(queue, "b", [_digest(one)])).found[_digest(one)].data == one
    assert len(queue.fetches) == 2
    # Held while any job holds it; gone with the last.
    del together, fetched
    gc.collect()
    assert len(blobs) == 0
    await blobs.get(queue, "a", [_digest(one)])
    assert queue.fetches[-1] == [_digest(one)]


async def test_shared_blobs_keep_nothing_missing_altered_or_failed() -> None:
    good, altered = b"good", b"altered"
    queue = _FakeQueue({("a", _digest(good)): good, ("a", _digest(b"claimed")): altered})
    blobs = SharedBlobs()
    fetch = await blobs.get(queue, "a", [_digest(good), _digest(b"claimed"), _digest(b"absent")])
    assert set(fetch.found) == {_digest(good)}
    assert fetch.mismatched == {_digest(b"claimed")} and fetch.missing == {_digest(b"absent")}
    again = await blobs.get(queue, "a", [_digest(b"claimed"), _digest(b"absent")])
    assert queue.fetches[-1] == [_digest(b"claimed"), _digest(b"absent")]  # asked Redis again
    assert again.mismatched == {_digest(b"claimed")} and again.missing == {_digest(b"absent")}
    # A failed fetch raises to its job; a job that waited on it fetches for itself.
    queue.gate.clear()
    queue.fail = ConnectionError("redis gone")
    first = asyncio.create_task(blobs.get(queue, "a", [_digest(b"x")]))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(blobs.get(queue, "a", [_digest(b"x")]))
    await asyncio.sleep(0.01)
    queue.gate.set()
    with pytest.raises(ConnectionError):
        await first
    queue.fail = None
    assert (await second).missing == {_digest(b"x")}
    assert queue.fetches[-2:] == [[_digest(b"x")], [_digest(b"x")]]


def _check(api: Api, *data: bytes) -> dict[str, Any]:
    response = api.post("/v1/blobs/check", json={"hashes": [_ref(d) for d in data]})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _ref(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _link(api: Api, data: bytes) -> str:
    """The upload link a check gives for `data` (which must not be kept yet)."""
    answer = _check(api, data)
    assert answer["present"] == [] and [m["hash"] for m in answer["missing"]] == [_ref(data)], answer
    return answer["missing"][0]["uploadUrl"]  # type: ignore[no-any-return]


def _upload(api: Api, data: bytes) -> httpx.Response:
    """Check `data`, then PUT it to the link given (no bearer), as the SDK does."""
    return httpx.put(_link(api, data), content=data, timeout=10)


def _error(response: httpx.Response, status: int, field: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] and isinstance(body["details"], list)
    if field is not None:
        assert body["details"][0]["field"] == field, body
    return body  # type: ignore[no-any-return]


def _hashed(api: Api, files: list[dict[str, Any]], names: list[str]) -> str:
    """Run HASHER over `names` with `files` beside it; its stdout."""
    job = api.execute(
        {"language": "python", "files": [{"name": "main.py", "content": HASHER}, *files], "args": names, "collectOutput": True}
    )
    assert api.start(job).status_code == 202
    output = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "20000"}, timeout=30)
    assert output.status_code == 200, output.text
    body = output.json()
    assert body["outcome"] == "completed" and body["exitCode"] == 0, body
    return body["stdout"]  # type: ignore[no-any-return]


def _line(name: str, data: bytes) -> str:
    return f"{name} {len(data)} {hashlib.sha256(data).hexdigest()}\n"


@pytest.mark.stack
@pytest.mark.sandbox
def test_upload_then_execute_by_ref_gives_the_exact_bytes(api: Api) -> None:
    data = bytes(range(256)) * 2048 + b"\x00tail"  # 512 KiB of every byte value
    put = _upload(api, data)
    assert put.status_code == 200, put.text
    assert put.json() == {"ok": True}
    assert _check(api, data) == {"missing": [], "present": [_ref(data)]}
    finalized = api.post("/v1/blobs/finalize", json={"hashes": [_ref(data)]})
    assert finalized.status_code == 200 and finalized.json() == {"finalized": [_ref(data)]}, finalized.text
    # One blob, two files: each gets its own copy; inline files work beside them.
    if not _check(api, b"")["present"]:
        assert _upload(api, b"").status_code == 200  # an empty file is a blob too
    stdout = _hashed(
        api,
        [
            {"name": "d/one.bin", "ref": _ref(data)},
            {"name": "two.bin", "ref": _ref(data)},
            {"name": "three.txt", "content": "3"},
            {"name": "empty", "ref": _ref(b"")},
        ],
        ["d/one.bin", "two.bin", "three.txt", "empty"],
    )
    assert stdout == _line("d/one.bin", data) + _line("two.bin", data) + _line("three.txt", b"3") + _line("empty", b"")


@pytest.mark.stack
def test_blob_requests_refused_name_the_field_and_store_nothing(api: Api, stack: Stack) -> None:
    data = b"some bytes " + str(time.time()).encode()
    ref = _ref(data)
    digest = ref.removeprefix("sha256:")
    # check / finalize bodies
    _error(api.post("/v1/blobs/check", json={"hashes": ["sha256:nothex"]}), 400, "hashes[0]")
    _error(api.post("/v1/blobs/check", json={"hashes": [ref, digest]}), 400, "hashes[1]")
    _error(api.post("/v1/blobs/check", json={"hashes": [ref] * 101}), 400, "hashes")
    _error(api.post("/v1/blobs/check", json={"hash": ref}), 400)
    _error(api.post("/v1/blobs/check", content=b"{"), 400)
    _error(api.post("/v1/blobs/finalize", json={"hashes": [ref]}), 400, "hashes[0]")
    # Named where it stands in the request, repeats of an uploaded one before it or not.
    uploaded = b"uploaded " + str(time.time()).encode()
    assert _upload(api, uploaded).status_code == 200
    _error(api.post("/v1/blobs/finalize", json={"hashes": [_ref(uploaded), _ref(uploaded), ref]}), 400, "hashes[2]")
    # An execute refused for another file's name (or a case) does not renew the blobs it names.
    owner = hashlib.sha256(b"owner:" + stack.api_token.encode()).hexdigest()[:32]
    with stack.redis() as redis:
        uploaded_key = keys.blob_key(owner, _ref(uploaded).removeprefix("sha256:"))
        redis.expire(uploaded_key, 600)
        files = [{"name": "main.py", "ref": _ref(uploaded)}, {"name": "../x.py", "content": ""}]
        _error(api.post("/v1/execute", json={"language": "python", "files": files}), 400, "files[1].name")
        assert redis.ttl(uploaded_key) <= 600
    # no token, or a job token: never
    _error(httpx.post(f"{stack.api_url}/v1/blobs/check", json={"hashes": [ref]}), 401)
    job = api.execute({"language": "python", "files": [{"name": "main.py", "content": "print(1)"}]})
    _error(api.post("/v1/blobs/check", token=job["jobToken"], json={"hashes": [ref]}), 403)
    api.post(f"/v1/jobs/{job['jobId']}/kill")

    link = _check(api, data)["missing"][0]["uploadUrl"]
    parts = urlsplit(link)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    base = f"{parts.scheme}://{parts.netloc}{parts.path}"
    # forged, re-aimed and expired links: 403, before the body is read (an oversized body
    # sent with a forged link is refused as forged, not as too big)
    for params in (
        {**query, "sig": "0" * 48},
        {**query, "expires": str(int(query["expires"]) + 1)},
        {k: v for k, v in query.items() if k != "sig"},
    ):
        _error(httpx.put(base, params=params, content=data), 403)
    _error(httpx.put(base, params={**query, "sig": "0" * 48}, content=b"x" * (8 * 1024 * 1024 + 1)), 403)
    other = _ref(b"other").removeprefix("sha256:")
    _error(httpx.put(base.replace(digest, other), params=query, content=b"other"), 403)
    owner = hashlib.sha256(b"owner:" + stack.api_token.encode()).hexdigest()[:32]
    expired = sign_upload(stack.pusher_secret, owner, digest, int(time.time()) - 1)
    _error(httpx.put(f"{stack.api_url}{expired}", content=data), 403)
    assert httpx.put(f"{stack.api_url}{sign_upload(stack.pusher_secret, owner, digest, int(time.time()) + 60)}", content=b"x").status_code == 400
    # bytes that are not what the link names
    _error(httpx.put(link, content=data + b"!"), 400, "body")
    _error(httpx.put(link, content=b"x" * (8 * 1024 * 1024 + 1)), 413, "body")  # (declared too big)
    streamed = (b"x" * 65536 for _ in range(8 * 16 + 1))  # (chunked: found too big as it comes)
    _error(httpx.put(link, content=streamed), 413, "body")
    # nothing was stored by any of them
    assert _check(api, data)["present"] == []
    # execute: a ref to nothing, both content and ref, neither, a malformed ref
    main = {"name": "main.py", "content": "print(1)"}
    for files, field in (
        ([main, {"name": "a.bin", "ref": ref}], "files[1].ref"),
        ([main, {"name": "a.bin", "ref": ref, "content": "x"}], "files[1]"),
        ([main, {"name": "a.bin"}], "files[1].content"),
        ([main, {"name": "a.bin", "ref": digest}], "files[1].ref"),
    ):
        _error(api.post("/v1/execute", json={"language": "python", "files": files}), 400, field)


@pytest.mark.stack
@pytest.mark.sandbox
def test_storage_bounds_and_expiry(make_stack: StackFactory) -> None:
    # No worker at first: the job below is claimed only after its blob's BLOB_TTL_S is over.
    stack = make_stack(with_worker=False, MAX_BLOBS_PER_PRINCIPAL=2, MAX_BLOB_STORAGE_MB=1, BLOB_TTL_S=4)
    with Api(stack) as api:
        first, second, third = b"a" * (600 * 1024), b"b" * 1000, b"e" * (900 * 1024)
        first_link = _link(api, first)
        assert httpx.put(first_link, content=first).status_code == 200
        # Past the bytes one principal may keep: 429, saying when room frees up.
        too_big = _upload(api, b"c" * (500 * 1024))
        body = _error(too_big, 429)
        assert "MAX_BLOB_STORAGE_MB" in body["error"] and 0 < body["retryAfterMs"] <= 4000, body
        assert too_big.headers["retry-after"] in ("1", "2", "3", "4")
        assert _upload(api, second).status_code == 200
        # Past the count: 429 as well. The same bytes again are no new blob (a replayed link).
        body = _error(_upload(api, b"d"), 429)
        assert "MAX_BLOBS_PER_PRINCIPAL" in body["error"], body
        assert httpx.put(first_link, content=first).status_code == 200
        first_touched = time.monotonic()  # `first` lives BLOB_TTL_S from here
        # A blob that could never fit (over MAX_BLOB_STORAGE_MB, under MAX_FILES_BYTES) is a
        # 413, not a 429 to retry forever.
        assert "MAX_BLOB_STORAGE_MB" in _error(_upload(api, b"f" * (1024 * 1024 + 1)), 413)["error"]

        # A job keeps the blobs it names alive as long as its record (JOB_RECORD_TTL).
        job = api.execute(
            {
                "language": "python",
                "files": [{"name": "main.py", "content": HASHER}, {"name": "s.bin", "ref": _ref(second)}],
                "args": ["s.bin"],
                "collectOutput": True,
            }
        )
        time.sleep(max(0.0, first_touched + 4.6 - time.monotonic()))
        both = _check(api, first, second)
        assert [m["hash"] for m in both["missing"]] == [_ref(first)] and both["present"] == [_ref(second)], both
        # That check renewed `second` without cutting the job's hold short.
        owner = hashlib.sha256(b"owner:" + stack.api_token.encode()).hexdigest()[:32]
        assert stack.redis().ttl(f"blob:{owner}:{_ref(second).removeprefix('sha256:')}") > 3600
        _error(
            api.post("/v1/execute", json={"language": "python", "files": [{"name": "f.bin", "ref": _ref(first)}]}),
            400,
            "files[0].ref",
        )
        # An expired blob no longer counts: 900 KiB fit beside `second`.
        assert _upload(api, third).status_code == 200
        # Files named by ref count toward MAX_FILES_BYTES (8 MiB) by their blobs' sizes, each file.
        ten = [{"name": f"f{i}", "ref": _ref(third)} for i in range(10)]
        _error(api.post("/v1/execute", json={"language": "python", "files": ten}), 400, "files")
        stack.start_worker()
        assert api.start(job).status_code == 202
        output = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "20000"}, timeout=30).json()
        assert output["stdout"] == _line("s.bin", second), output



@pytest.mark.stack
@pytest.mark.sandbox
def test_a_worker_runs_a_blob_only_if_its_bytes_match_its_name(make_stack: StackFactory) -> None:
    # Redis is no trust boundary: the worker hashes what it fetched before it writes a file.
    stack = make_stack(with_worker=False)
    with Api(stack) as api:
        data = b"the real bytes"
        assert _upload(api, data).status_code == 200
        body = {"language": "python", "files": [{"name": "main.py", "content": HASHER}, {"name": "d.bin", "ref": _ref(data)}],
                "args": ["d.bin"], "collectOutput": True}  # fmt: skip
        tampered = api.execute(body)
        owner = hashlib.sha256(b"owner:" + stack.api_token.encode()).hexdigest()[:32]
        redis = stack.redis()
        key = f"blob:{owner}:{_ref(data).removeprefix('sha256:')}"
        assert redis.get(key) == data
        redis.set(key, b"other bytes", keepttl=True)
        stack.start_worker()
        api.start(tampered)  # (202, or 409 if the worker already ended it when it claimed it)
        output = api.get(f"/v1/jobs/{tampered['jobId']}/output", params={"waitMs": "20000"}, timeout=30).json()
        message = output.get("message") or ""
        assert output["outcome"] != "completed" and "files[1].ref" in message and "do not match" in message, output
        assert output["stdout"] == ""
        redis.set(key, data, keepttl=True)
        intact = api.execute(body)
        assert api.start(intact).status_code == 202
        output = api.get(f"/v1/jobs/{intact['jobId']}/output", params={"waitMs": "20000"}, timeout=30).json()
        assert output["stdout"] == _line("d.bin", data), output


@pytest.mark.stack
def test_uploads_at_once_are_bounded(make_stack: StackFactory) -> None:
    # Each upload holds its body in memory: one that trickles in holds the only slot, and
    # another is refused until it is done.
    stack = make_stack(with_worker=False, MAX_BLOB_UPLOADS=1)
    with Api(stack) as api:
        slow, quick = b"g" * 1000, b"h"
        link = urlsplit(_link(api, slow))
        with socket.create_connection((link.hostname, link.port), timeout=10) as trickle:
            head = f"PUT {link.path}?{link.query} HTTP/1.1\r\nHost: {link.netloc}\r\nContent-Length: {len(slow)}\r\n\r\n"
            trickle.sendall(head.encode() + slow[:10])
            refused = _upload(api, quick)
            for _ in range(20):
                if refused.status_code == 429:
                    break
                time.sleep(0.1)  # (the trickling request may not have been read yet)
                refused = httpx.put(_link(api, quick), content=quick)
            body = _error(refused, 429)
            assert "blob uploads" in body["error"] and body["retryAfterMs"] > 0, body
            trickle.sendall(slow[10:])
            assert trickle.recv(100).startswith(b"HTTP/1.1 200")
        assert _upload(api, quick).status_code == 200


@pytest.mark.stack
@pytest.mark.sandbox
def test_parked_jobs_naming_one_blob_share_one_fetch_of_it(make_stack: StackFactory) -> None:
    """A worker fetches a blob once for all its jobs that name it (worker/job/blobs.py):
    otherwise 500 parked jobs naming one 8 MiB blob would hold 4 GB of the worker."""
    stack = make_stack()
    with Api(stack) as api:
        data = secrets_bytes(2 << 20)
        assert _upload(api, data).status_code == 200
        body = {"language": "python", "files": [{"name": "main.py", "content": HASHER}, {"name": "d.bin", "ref": _ref(data)}],
                "args": ["d.bin"], "collectOutput": True}  # fmt: skip
        redis = stack.redis()
        sent_before = int(redis.info("stats")["total_net_output_bytes"])
        jobs = [api.execute(body) for _ in range(6)]
        for job in jobs:
            api.wait_state(job, {"parked"})
        sent = int(redis.info("stats")["total_net_output_bytes"]) - sent_before
        assert len(data) <= sent < 2 * len(data), sent  # one fetch, not six
        for job in jobs:
            assert api.start(job).status_code == 202
        for job in jobs:
            output = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "20000"}, timeout=30).json()
            assert output["stdout"] == _line("d.bin", data), output
        # Once they have ended the worker holds no copy: the next job fetches it again. (A job
        # lets go as it ends, a moment after its result: a few tries.)
        for _ in range(10):
            sent_before = int(redis.info("stats")["total_net_output_bytes"])
            assert _hashed(api, [{"name": "d.bin", "ref": _ref(data)}], ["d.bin"]) == _line("d.bin", data)
            if int(redis.info("stats")["total_net_output_bytes"]) - sent_before >= len(data):
                break
        else:
            raise AssertionError("the worker kept its copy of the blob after every job naming it ended")


def secrets_bytes(size: int) -> bytes:
    return hashlib.shake_256(str(time.time()).encode()).digest(size)
