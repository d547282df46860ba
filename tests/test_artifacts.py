"""Artifacts: files a program leaves at the top of its workspace, announced and downloadable
through signed, expiring links; nothing that is not a regular file is ever read."""

from __future__ import annotations

import os
import socket
import stat
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.artifacts import _disposition
from shared.artifacts import guess_mime_type, sign_artifact, verify_artifact
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job
from worker.job.artifacts import collect_artifacts, top_level_names

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
JOB = "a" * 32

# ---------------------------------------------------------------- the collector, on the host


@pytest.mark.stack
async def test_bulk_bytes_go_to_and_come_from_redis_a_piece_at_a_time(stack: Any) -> None:
    """An artifact stored, and a blob fetched, in commands of at most a MiB each: the worker's
    one command connection answers in order, so one 64 MiB command would hold every job's
    events and the heartbeat behind it. A piece sent twice (a reply lost) changes nothing."""
    from leanredis import LeanRedis
    from shared import keys
    from worker.job.artifacts import PIECE_BYTES, RedisArtifactStore, put_in_pieces
    from worker.messaging.queue import BLOB_PIECE_BYTES, WorkerQueue

    redis = LeanRedis.from_url(stack.redis_url)
    sizes: list[int] = []
    real_set, real_setrange, real_getrange = redis.set, redis.setrange, redis.getrange

    async def set_(key: Any, value: Any, **kw: Any) -> Any:
        sizes.append(len(value))
        return await real_set(key, value, **kw)

    async def setrange(key: Any, offset: int, value: Any) -> Any:
        sizes.append(len(value))
        return await real_setrange(key, offset, value)

    async def getrange(key: Any, start: int, end: int) -> Any:
        got = await real_getrange(key, start, end)
        sizes.append(len(got))
        return got

    redis.set, redis.setrange, redis.getrange = set_, setrange, getrange  # type: ignore[method-assign]
    data = os.urandom(3 * PIECE_BYTES + 12345)
    job = os.urandom(16).hex()
    try:
        await RedisArtifactStore(redis).put(job, 1, 0, b"{}", data, 60)  # (fenced: no such job)
        key = keys.artifact_data_key(job, 0)
        assert await real_getrange(key, 0, -1) == data and 0 < await redis.ttl(key) <= 60
        assert len(sizes) == 4 and max(sizes) == PIECE_BYTES
        await put_in_pieces(redis, key, data, 60)  # again: the same bytes
        assert await real_getrange(key, 0, -1) == data
        sizes.clear()
        owner = "owner-" + job
        blob = os.urandom(2 * BLOB_PIECE_BYTES)
        await real_set(keys.blob_key(owner, "d1"), blob, ex=60)
        await real_set(keys.blob_key(owner, "d2"), b"", ex=60)
        found = await WorkerQueue(redis, "w-" + job[:6], 86400, 600).blobs(owner, ["d1", "d2", "d3"])
        assert found == {"d1": blob, "d2": b""}
        assert max(sizes) <= BLOB_PIECE_BYTES and len(sizes) == 2
        # Held as long as the job's record (renewed by its claim): a job handed back and
        # claimed again later still finds them.
        assert await redis.ttl(keys.blob_key(owner, "d1")) > 86400 and await redis.ttl(keys.blob_key(owner, "d2")) > 86400
    finally:
        await redis.aclose()


def test_the_collector_reads_only_new_regular_files(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("input")
    before = top_level_names(str(tmp_path))
    (tmp_path / "plot.png").write_bytes(PNG)
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "shadow").symlink_to("/etc/shadow")
    os.mkfifo(tmp_path / "pipe")
    os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, no pages: must not be read
    (tmp_path / "sub").mkdir()
    (tmp_path / "bad\x01name\x1b[31m.txt").write_bytes(b"odd")
    (tmp_path / "nl\nresult: completed").write_bytes(b"forged line")
    (tmp_path / "rlo\u202etxt.exe").write_bytes(b"false extension")
    (tmp_path / "tag\U000e0001").write_bytes(b"astral")
    (tmp_path / "caf\xe9".encode("latin-1").decode("utf-8", "surrogateescape")).write_bytes(b"latin")
    got = collect_artifacts(str(tmp_path), before, max_count=10, max_bytes=4 << 20, max_total_bytes=64 << 20)
    names = {name: data for name, data in got.files}
    assert names == {
        "plot.png": PNG,
        "data.csv": b"a,b\n1,2\n",
        # A program chose these names, and a page or a terminal shows them: what no submitted
        # name may hold (controls, invisible formatting) is written out, not acted on.
        "bad\\x01name\\x1b[31m.txt": b"odd",
        "nl\\x0aresult: completed": b"forged line",
        "rlo\\u202etxt.exe": b"false extension",
        "tag\\U000e0001": b"astral",  # (eight digits past U+FFFF: never read as \ue000 and a 1)
        "caf\ufffd": b"latin",
    }
    assert got.truncated  # the sparse file was over the cap


def test_the_collector_keeps_to_its_count(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"f{i}").write_text(str(i))
    got = collect_artifacts(str(tmp_path), set(), max_count=3, max_bytes=100, max_total_bytes=1000)
    assert [name for name, _ in got.files] == ["f0", "f1", "f2"] and got.truncated
    assert collect_artifacts(str(tmp_path), set(), max_count=0, max_bytes=100, max_total_bytes=1000).files == []


def test_the_collector_reads_no_more_than_the_workspace_could_hold(tmp_path: Path) -> None:
    # Sparse files (a size with no blocks) and hard links to one file (a second name costs
    # no space) pass a per-file size check each: together they once had the worker read,
    # and Redis keep, many times the workspace. The total is bounded; a file is read once.
    for i in range(10):
        with open(tmp_path / f"sparse{i}", "wb") as f:
            f.truncate(3 << 20)  # 3 MiB each, no pages
    (tmp_path / "big").write_bytes(b"x" * (2 << 20))
    for i in range(5):
        os.link(tmp_path / "big", tmp_path / f"link{i}")
    got = collect_artifacts(str(tmp_path), set(), max_count=100, max_bytes=4 << 20, max_total_bytes=8 << 20)
    assert got.truncated
    assert sum(len(data) for _, data in got.files) <= 8 << 20
    names = [name for name, _ in got.files]
    assert names == ["big", "sparse0", "sparse1"], names  # (in name order; links skipped)


def test_links_are_signed_per_job_and_artifact_and_expire() -> None:
    url = sign_artifact("secret", JOB, 2, 2_000_000_000)
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
    assert url.startswith(f"/v1/jobs/{JOB}/artifacts/2?")
    assert verify_artifact("secret", JOB, 2, query["expires"], query["sig"], 1_000)
    assert not verify_artifact("secret", JOB, 3, query["expires"], query["sig"], 1_000)
    assert not verify_artifact("secret", "b" * 32, 2, query["expires"], query["sig"], 1_000)
    assert not verify_artifact("other", JOB, 2, query["expires"], query["sig"], 1_000)
    assert not verify_artifact("secret", JOB, 2, query["expires"], query["sig"], 2_000_000_001)
    assert not verify_artifact("secret", JOB, 2, "2000000001", query["sig"], 1_000)


def test_mime_types_and_safe_file_names() -> None:
    assert guess_mime_type("x.bin", PNG) == "image/png"
    assert guess_mime_type("data.CSV", b"a,b") == "text/csv"
    assert guess_mime_type("noext", b"??") == "application/octet-stream"
    header = _disposition('a"b\r\nX-Evil: 1\x01.txt')
    assert "\r" not in header and "\n" not in header and '"b' not in header.split(";")[1]
    # Security review: a right-to-left override made "é\u202egnp.exe" show as "éexe.png".
    assert _disposition("\u00e9\u202egnp.exe").endswith("filename*=UTF-8''%C3%A9gnp.exe")
    assert "%0D" not in _disposition("a\r\nSet-Cookie: x") and "%E2%81%A6" not in _disposition("\u2066x")


# ---------------------------------------------------------------- end to end

WRITER = r"""
import os
open("plot.png", "wb").write(bytes.fromhex(PNG_HEX))
open("data.csv", "w").write("x,y\n1,2\n")
os.symlink("/etc/passwd", "passwd")
os.mkfifo("pipe")
with open("sparse", "wb") as f:
    f.truncate(12 * 1024 * 1024)
open("bad\x01name.txt", "w").write("odd")
print("done")
"""


def _run(api: Api, rt: Realtime, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    job = api.execute({**body, "collectOutput": True})
    followed = rt.follow(job)
    api.start(job)
    result = followed.wait_result(timeout_s=30)
    announced = sorted((p for n, p in followed.events if n == "artifact"), key=lambda p: p["seq"])
    out = api.get(f"/v1/jobs/{job['jobId']}/output").json()
    return result, announced, out


@pytest.mark.slow
def test_a_program_leaves_a_png_and_a_csv(api: Api, realtime: Realtime) -> None:
    code = WRITER.replace("PNG_HEX", repr(PNG.hex()))
    result, announced, out = _run(api, realtime, py_job(code))
    assert result["outcome"] == "completed", out
    assert [a["name"] for a in announced] == ["bad\\x01name.txt", "data.csv", "plot.png"]  # (its control written out)
    assert all(a["seq"] < result["seq"] for a in announced)
    assert [a["name"] for a in out["artifacts"]] == [a["name"] for a in announced]
    assert out["artifactsTruncated"] is True  # the sparse file was over maxArtifactBytes
    expected = {
        "plot.png": (PNG, "image/png"),
        "data.csv": (b"x,y\n1,2\n", "text/csv"),
        "bad\\x01name.txt": (b"odd", "text/plain"),
    }
    anonymous = api.client.__class__(base_url=str(api.client.base_url))  # no bearer at all
    try:
        for artifact in announced:
            data, mime = expected[artifact["name"]]
            assert (artifact["bytes"], artifact["mimeType"]) == (len(data), mime)
            response = anonymous.get(artifact["url"])
            assert response.status_code == 200, response.text
            assert response.content == data
            assert response.headers["content-type"].startswith(mime)
            assert response.headers["x-content-type-options"] == "nosniff"
            assert response.headers["content-disposition"].startswith("attachment;")
            # HEAD: the same headers, no body (and no slice of it read from Redis).
            head = anonymous.head(artifact["url"])
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == str(len(data))
            assert head.headers["content-type"] == response.headers["content-type"]
        # A link changed in any way is a 404, as is one of another artifact.
        url = announced[0]["url"]
        assert anonymous.get(url[:-1] + ("0" if url[-1] != "0" else "1")).status_code == 404
        assert anonymous.get(url.replace("/artifacts/0?", "/artifacts/1?")).status_code == 404
        assert anonymous.get(url.split("?")[0]).status_code == 404
        assert set(anonymous.get(url.split("?")[0]).json()) == {"error", "details"}  # the one envelope
        # Other spellings of the same link too (security review: each of these was a 200).
        path, query = url.split("?")
        expires, sig = (dict(urllib.parse.parse_qsl(query))[k] for k in ("expires", "sig"))
        for other in (
            url.replace("/artifacts/0?", "/artifacts/000?"),
            f"{path}?expires=0{expires}&sig={sig}",
            f"{path}?sig=junk&expires={expires}&sig={sig}",
            f"{path}?expires={expires}&expires={expires}&sig={sig}",
        ):
            assert anonymous.get(other).status_code == 404, other
    finally:
        anonymous.close()


@pytest.mark.slow
def test_inputs_and_the_compiled_program_are_not_artifacts(api: Api, realtime: Realtime) -> None:
    body = {
        "language": "c",
        "files": [
            {
                "name": "main.c",
                "content": '#include <stdio.h>\nint main(){FILE*f=fopen("out.txt","w");fputs("hi",f);fclose(f);}',
            },
            {"name": "notes.txt", "content": "an input"},
        ],
    }
    result, announced, out = _run(api, realtime, body)
    assert result["outcome"] == "completed", out
    assert [a["name"] for a in announced] == ["out.txt"]
    assert out["artifactsTruncated"] is False


@pytest.mark.slow
def test_max_artifact_bytes_bounds_all_the_files_together(api: Api, realtime: Realtime) -> None:
    # The seed product's meaning: the total across the artifacts. Three 2 MiB files under the
    # default 4 MiB: two are kept, the third is left out and says so.
    code = "for name in 'abc':\n    open(name + '.bin', 'wb').write(bytes(2 * 1024 * 1024))\n"
    result, announced, out = _run(api, realtime, py_job(code))
    assert result["outcome"] == "completed", out
    assert [a["name"] for a in announced] == ["a.bin", "b.bin"]
    assert out["artifactsTruncated"] is True
    # A smaller file after one that did not fit still goes in what is left.
    code = "open('a.bin', 'wb').write(bytes(3 << 20))\nopen('b.bin', 'wb').write(bytes(2 << 20))\nopen('c.txt', 'w').write('small')\n"
    result, announced, out = _run(api, realtime, py_job(code))
    assert [a["name"] for a in announced] == ["a.bin", "c.txt"] and out["artifactsTruncated"] is True


@pytest.mark.slow
def test_max_artifacts_zero_collects_nothing(api: Api, realtime: Realtime) -> None:
    result, announced, out = _run(api, realtime, py_job("open('x.txt','w').write('x')", limits={"maxArtifacts": 0}))
    assert result["outcome"] == "completed" and announced == [] and out["artifacts"] == []
    # maxArtifactBytes 0 turns them off too: an empty file was kept, and a full one said truncated.
    code = "open('empty.txt','w'); open('x.txt','w').write('x')"
    result, announced, out = _run(api, realtime, py_job(code, limits={"maxArtifactBytes": 0}))
    assert result["outcome"] == "completed" and announced == [] and out["artifacts"] == []
    assert not out.get("artifactsTruncated")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_one_link_opened_many_times_cannot_take_the_apis_memory(make_stack: StackFactory) -> None:
    # Ten connections ask for a 4 MiB artifact and then read nothing. The API streams it in
    # slices (a stalled client holds one, not the file) and serves at most 8 downloads of
    # one job at once: the last two are told to retry. Each download is still exact.
    stack = make_stack()
    api, rt = Api(stack), Realtime(stack)
    data = bytes(range(256)) * (16 * 1024)  # 4 MiB
    code = f"open('big.bin', 'wb').write(bytes(range(256)) * {16 * 1024})\n"
    sockets: list[socket.socket] = []
    try:
        _result, (artifact,), _out = _run(api, rt, py_job(code))
        anonymous = httpx.Client(base_url=stack.api_url)  # no bearer: the link is the credential
        try:
            assert anonymous.get(artifact["url"]).content == data
            url = urllib.parse.urlsplit(artifact["url"])
            host, port = urllib.parse.urlsplit(stack.api_url).hostname, urllib.parse.urlsplit(stack.api_url).port
            request = f"GET {url.path}?{url.query} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
            api_pid = stack.procs["api"].pid
            before = _rss_kib(api_pid)
            statuses = []
            for _ in range(10):
                conn = socket.socket()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
                conn.connect((host, port))
                conn.sendall(request)
                sockets.append(conn)
                statuses.append(conn.recv(12).split()[1])
            time.sleep(1.0)
            grown_mib = (_rss_kib(api_pid) - before) / 1024
            assert statuses == [b"200"] * 8 + [b"429"] * 2, statuses
            assert grown_mib < 16, f"the API grew by {grown_mib:.1f} MiB for 8 stalled downloads of 4 MiB"
            assert api.get("/health").status_code == 200
            for conn in sockets:
                conn.close()
            sockets.clear()
            deadline = time.monotonic() + 10
            while (answer := anonymous.get(artifact["url"])).status_code == 429:  # the slots come back
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert answer.content == data
        finally:
            anonymous.close()
    finally:
        for conn in sockets:
            conn.close()
        api.close()
        rt.close()


def test_with_public_api_url_links_are_whole_urls_a_browser_elsewhere_can_open(make_stack: StackFactory) -> None:
    # The seed's artifact links were presigned URLs its clients hand to a browser on another
    # origin as they are; a path on the API resolved against that page's own origin (or was
    # an invalid URL for Node's fetch). With PUBLIC_API_URL set, each link is a whole URL.
    stack = make_stack(with_worker=False)
    stack.start_worker(extra_env={"PUBLIC_API_URL": stack.api_url + "/"})
    api, rt = Api(stack), Realtime(stack)
    try:
        result, (artifact,), out = _run(api, rt, py_job("open('a.txt', 'w').write('hi')\n"))
        assert result["outcome"] == "completed", out
        assert artifact["url"].startswith(f"{stack.api_url}/v1/jobs/"), artifact
        assert out["artifacts"][0]["url"] == artifact["url"]
        response = httpx.get(artifact["url"])  # no base URL, no bearer: the link alone
        assert response.status_code == 200 and response.content == b"hi", response.text
    finally:
        rt.close()
        api.close()
