"""Idempotent submit (`Idempotency-Key`) and receipts (`GET /v1/jobs`) against real stacks.

Most tests use a stack of this module's own without a worker, so jobs stay where the API
put them and Redis can be counted exactly; one runs a real job on the shared stack.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from launcher.stack import Stack
from shared import keys
from tests.conftest import StackFactory
from tests.helpers import Api, py_job

pytestmark = [pytest.mark.stack]

KEY = "Idempotency-Key"


@pytest.fixture(scope="module")
def quiet() -> Iterator[Stack]:
    with Stack(with_worker=False) as stack:
        yield stack


@pytest.fixture
def qapi(quiet: Stack) -> Iterator[Api]:
    with Api(quiet) as client:
        yield client


def _error(response: httpx.Response, status: int, field: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["details"][0]["field"] == field, body
    assert body["error"].startswith(field), body
    return body  # type: ignore[no-any-return]


def _statuses_with_key(stack: Stack, key: str) -> list[str]:
    """Ids of every job record in Redis made with this Idempotency-Key (a test may SCAN)."""
    with stack.redis() as redis:
        found = []
        for name in redis.scan_iter(match="job:*:status", count=1000):
            if redis.hget(name, "idempotencyKey") == key.encode():
                found.append(name.decode().split(":")[1])
        return found


def _owner(stack: Stack, job_id: str) -> str:
    with stack.redis() as redis:
        return redis.hget(keys.status_key(job_id), "owner").decode()  # type: ignore[no-any-return]


def _list(api: Api, token: str | None = None, **params: Any) -> dict[str, Any]:
    response = api.client.get("/v1/jobs", params=params, headers=api.headers(token))
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _all_pages(api: Api, **params: Any) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = _list(api, **params, **({"cursor": cursor} if cursor else {}))
        jobs.extend(page["jobs"])
        cursor = page["nextCursor"]
        if cursor is None:
            return jobs


# ---------------------------------------------------------------- Idempotency-Key


def test_same_key_and_body_return_the_first_job(qapi: Api, quiet: Stack) -> None:
    body = py_job("print('once')")
    first = qapi.post("/v1/execute", json=body, headers={KEY: "checkout-1"})
    assert first.status_code == 202, first.text
    job = first.json()
    again = qapi.post("/v1/execute", json=body, headers={KEY: "checkout-1"})
    assert again.status_code == 200, again.text
    replay = again.json()
    assert {k: replay[k] for k in ("jobId", "channel", "status")} == {
        "jobId": job["jobId"], "channel": job["channel"], "status": "queued"}  # fmt: skip
    assert again.headers["idempotent-replayed"] == "true"
    # The token handed out again is valid for that job (and only it).
    assert qapi.get(f"/v1/jobs/{job['jobId']}", token=replay["jobToken"]).status_code == 200
    auth = qapi.client.post("/v1/channel-auth", data={"socket_id": "1.2", "channel_name": job["channel"]},
                            headers=qapi.headers(replay["jobToken"]))  # fmt: skip
    assert auth.status_code == 200, auth.text
    assert _statuses_with_key(quiet, "checkout-1") == [job["jobId"]]
    # Without a key, the same body is a new job.
    assert qapi.execute(body)["jobId"] != job["jobId"]


async def test_fifty_concurrent_retries_make_one_job(quiet: Stack) -> None:
    body = py_job("print('storm')")
    with quiet.redis() as redis:
        queued_before = redis.llen(keys.QUEUE)
    headers = {"Authorization": f"Bearer {quiet.api_token}", KEY: "storm-42"}
    async with httpx.AsyncClient(base_url=quiet.api_url, timeout=30) as client:
        answers = await asyncio.gather(*(client.post("/v1/execute", json=body, headers=headers) for _ in range(50)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 49 + [202], [r.text for r in answers if r.status_code not in (200, 202)]
    ids = {r.json()["jobId"] for r in answers}
    assert len(ids) == 1
    (job_id,) = ids
    # Exactly one job exists: one record, one queue entry, one index entry, one key record.
    assert _statuses_with_key(quiet, "storm-42") == [job_id]
    with quiet.redis() as redis:
        queue = redis.lrange(keys.QUEUE, 0, -1)
        assert queue.count(job_id.encode()) == 1 and redis.llen(keys.QUEUE) == queued_before + 1
        assert len(list(redis.scan_iter(match=f"job:{job_id}:spec"))) == 1
        owner = _owner(quiet, job_id)
        assert redis.zscore(keys.owner_jobs_key(owner), job_id) is not None
        assert redis.hget(keys.idempotency_key(owner, "storm-42"), "jobId") == job_id.encode()


def test_same_key_other_body_is_409(qapi: Api, quiet: Stack) -> None:
    job = qapi.post("/v1/execute", json=py_job("print(1)"), headers={KEY: "k-409"}).json()
    with quiet.redis() as redis:
        depth = redis.llen(keys.QUEUE)
    err = _error(qapi.post("/v1/execute", json=py_job("print(2)"), headers={KEY: "k-409"}), 409, KEY)
    assert "'k-409'" in err["error"] and job["jobId"] in err["error"]
    # The same JSON spelt differently is another body too (bytes as received are hashed).
    spaced = b'{"language": "python",  "files": [{"name": "main.py", "content": "print(1)"}]}'
    _error(qapi.post("/v1/execute", content=spaced, headers={KEY: "k-409", "content-type": "application/json"}),
           409, KEY)  # fmt: skip
    with quiet.redis() as redis:
        assert redis.llen(keys.QUEUE) == depth
    assert _statuses_with_key(quiet, "k-409") == [job["jobId"]]


def test_a_big_body_is_hashed_as_exactly_as_a_small_one(qapi: Api, quiet: Stack) -> None:
    # Past 256 KiB the body is hashed off the event loop: the same answers.
    filler = "#" * (400 * 1024)
    body = py_job(f"print('big')\n{filler}")
    first = qapi.post("/v1/execute", json=body, headers={KEY: "k-big"})
    assert first.status_code == 202, first.text
    again = qapi.post("/v1/execute", json=body, headers={KEY: "k-big"})
    assert again.status_code == 200 and again.json()["jobId"] == first.json()["jobId"]
    other = py_job(f"print('big')\n{filler}#")
    _error(qapi.post("/v1/execute", json=other, headers={KEY: "k-big"}), 409, KEY)
    assert _statuses_with_key(quiet, "k-big") == [first.json()["jobId"]]


@pytest.mark.parametrize(
    "value",
    [b"", b"x" * 256, b"two words", b"tab\there", "caf\u00e9".encode()],
    ids=["empty", "256-chars", "space", "tab", "non-ascii"],
)
def test_bad_keys_are_400(qapi: Api, value: bytes) -> None:
    response = qapi.client.post("/v1/execute", json=py_job("print(1)"),
                                headers=[*qapi.headers().items(), (KEY, value)])  # fmt: skip
    _error(response, 400, KEY)


def test_key_sent_twice_is_400_and_longest_key_is_fine(qapi: Api) -> None:
    response = qapi.client.post("/v1/execute", json=py_job("print(1)"),
                                headers=[*qapi.headers().items(), (KEY, "a"), (KEY, "b")])  # fmt: skip
    _error(response, 400, KEY)
    longest = "".join(chr(c) for c in range(0x21, 0x7F)) * 3  # every visible ASCII character
    response = qapi.post("/v1/execute", json=py_job("print(1)"), headers={KEY: longest[:255]})
    assert response.status_code == 202, response.text
    assert qapi.post("/v1/execute", json=py_job("print(1)"), headers={KEY: longest[:255]}).status_code == 200


def test_retry_beats_a_full_queue_and_an_expired_job_frees_its_key(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False, MAX_QUEUE_DEPTH="1", RUN_RESULT_TTL="1")
    api = Api(stack)
    try:
        body = py_job("print('grader')")
        first = api.post("/v1/execute", json=body, headers={KEY: "grade-7"})
        assert first.status_code == 202, first.text
        job = first.json()
        # The queue is full now; a retry of the accepted request still gets its job.
        assert api.post("/v1/execute", json=py_job("print(3)")).status_code == 429
        again = api.post("/v1/execute", json=body, headers={KEY: "grade-7"})
        assert again.status_code == 200 and again.json()["jobId"] == job["jobId"], again.text
        # The job ends (killed in the queue) and its record expires after RUN_RESULT_TTL.
        assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
        owner = _owner(stack, job["jobId"])
        with stack.redis() as redis:
            assert redis.ttl(keys.status_key(job["jobId"])) <= 1
            assert redis.ttl(keys.idempotency_key(owner, "grade-7")) > 3600  # JOB_RECORD_TTL
            deadline = time.monotonic() + 10
            while redis.exists(keys.status_key(job["jobId"])):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        # The key no longer returns the expired job: the same request makes a new one.
        fresh = api.post("/v1/execute", json=body, headers={KEY: "grade-7"})
        assert fresh.status_code == 202, fresh.text
        assert fresh.json()["jobId"] != job["jobId"]
        # The receipts no longer list it, and the index forgot it on the way.
        assert [j["jobId"] for j in _list(api)["jobs"]] == [fresh.json()["jobId"]]
        with stack.redis() as redis:
            assert redis.zscore(keys.owner_jobs_key(owner), job["jobId"]) is None
    finally:
        api.close()


# ---------------------------------------------------------------- GET /v1/jobs


def test_receipts_newest_first_in_pages_with_ties(qapi: Api, quiet: Stack) -> None:
    made = [qapi.execute(py_job(f"print({i})"))["jobId"] for i in range(7)]
    with quiet.redis() as redis:
        # Five of them created in the same millisecond: the cursor must still split them right.
        owner = _owner(quiet, made[0])
        redis.zadd(keys.owner_jobs_key(owner), {job_id: 4_000_000_000_000 for job_id in made[:5]})
    everything = _list(qapi, limit="200")
    assert everything["nextCursor"] is None
    whole = [j["jobId"] for j in everything["jobs"]]
    assert set(made) <= set(whole) and len(whole) == len(set(whole))
    # The tied five come first (the highest score), then newest first.
    assert set(whole[:5]) == set(made[:5])
    created = [j["createdAtMs"] for j in everything["jobs"][5:]]
    assert created == sorted(created, reverse=True)
    for size in (1, 2, 3):
        paged = [j["jobId"] for j in _all_pages(qapi, limit=str(size))]
        assert paged == whole, size
    first = _list(qapi)
    assert len(first["jobs"]) == min(50, len(whole))


def test_receipt_fields_through_the_states(qapi: Api, quiet: Stack) -> None:
    before = int(time.time() * 1000)
    waiting = qapi.post("/v1/execute", json=py_job("print('a')"), headers={KEY: "receipt-a"}).json()
    killed = qapi.execute(py_job("print('b')"))
    lost = qapi.execute(py_job("print('c')"))
    assert qapi.post(f"/v1/jobs/{killed['jobId']}/kill").status_code == 202
    with quiet.redis() as redis:
        # What the reaper writes when a worker vanishes after the program started.
        redis.lrem(keys.QUEUE, 1, lost["jobId"])
        redis.hset(keys.status_key(lost["jobId"]), mapping={
            "state": "lost", "updatedAtMs": before + 5, "result":
            b'{"exitCode":null,"signal":null,"timedOut":false,"idleTimedOut":false,"truncated":false,'
            b'"durationMs":0,"cpuMs":0,"memoryKb":0,"outcome":"lost","compile":null,"seq":3,'
            b'"message":"the worker vanished; \\"outcome\\":\\"completed\\" is not it"}'})  # fmt: skip
    by_id = {j["jobId"]: j for j in _list(qapi, limit="200")["jobs"]}

    queued = by_id[waiting["jobId"]]
    assert queued["state"] == "queued" and queued["language"] == "python"
    assert queued["outcome"] is None and "outcome" in queued
    assert "endedAtMs" not in queued and queued.get("outcomeConfirmed") is None
    assert queued["idempotencyKey"] == "receipt-a"
    assert before <= queued["createdAtMs"] <= queued["updatedAtMs"]

    ended = by_id[killed["jobId"]]
    assert (ended["state"], ended["outcome"], ended["outcomeConfirmed"]) == ("killed", "killed", True)
    assert ended["endedAtMs"] == ended["updatedAtMs"] >= ended["createdAtMs"]
    assert "idempotencyKey" not in ended

    vanished = by_id[lost["jobId"]]
    assert (vanished["state"], vanished["outcome"], vanished["outcomeConfirmed"]) == ("lost", "lost", False)
    assert vanished["endedAtMs"] == before + 5


def test_state_filter_and_bad_parameters(qapi: Api) -> None:
    queued = qapi.execute(py_job("print('q')"))
    killed = qapi.execute(py_job("print('k')"))
    assert qapi.post(f"/v1/jobs/{killed['jobId']}/kill").status_code == 202
    only_killed = _all_pages(qapi, state="killed")
    assert killed["jobId"] in {j["jobId"] for j in only_killed}
    assert {j["state"] for j in only_killed} == {"killed"}
    both = {j["jobId"] for j in _all_pages(qapi, state="queued,killed")}
    assert {queued["jobId"], killed["jobId"]} <= both
    repeated = qapi.client.get("/v1/jobs", params=[("state", "queued"), ("state", "killed")], headers=qapi.headers())
    assert {queued["jobId"], killed["jobId"]} <= {j["jobId"] for j in repeated.json()["jobs"]}
    assert _list(qapi, state="running")["jobs"] == []

    _error(qapi.get("/v1/jobs?state=finished"), 400, "state")
    _error(qapi.get("/v1/jobs?state="), 400, "state")
    _error(qapi.get("/v1/jobs?state=done,"), 400, "state")
    for bad in ("0", "201", "abc", "-1", "1e3", "99999999"):
        _error(qapi.get(f"/v1/jobs?limit={bad}"), 400, "limit")
    for bad in ("nope", "x" * 500, "bm90LWEtY3Vyc29y", "%00"):
        _error(qapi.get("/v1/jobs", params={"cursor": bad}), 400, "cursor")
    assert len(_list(qapi, limit="200")["jobs"]) <= 200


def test_job_token_sees_its_own_job_only(qapi: Api) -> None:
    mine = qapi.execute(py_job("print('mine')"))
    qapi.execute(py_job("print('other')"))
    page = _list(qapi, token=mine["jobToken"])
    assert [j["jobId"] for j in page["jobs"]] == [mine["jobId"]] and page["nextCursor"] is None
    assert _list(qapi, token=mine["jobToken"], state="done")["jobs"] == []
    assert _list(qapi, token=mine["jobToken"], state="queued")["jobs"][0]["jobId"] == mine["jobId"]
    _error(qapi.get("/v1/jobs?limit=0", token=mine["jobToken"]), 400, "limit")
    assert qapi.client.get("/v1/jobs").status_code == 401


def test_expired_jobs_leave_the_index_as_it_is_paged(qapi: Api, quiet: Stack) -> None:
    gone = qapi.execute(py_job("print('gone')"))
    kept = qapi.execute(py_job("print('kept')"))
    owner = _owner(quiet, gone["jobId"])
    with quiet.redis() as redis:
        redis.lrem(keys.QUEUE, 1, gone["jobId"])
        redis.delete(keys.status_key(gone["jobId"]))  # as its TTL would
    ids = [j["jobId"] for j in _all_pages(qapi, limit="2")]
    assert kept["jobId"] in ids and gone["jobId"] not in ids
    with quiet.redis() as redis:
        assert redis.zscore(keys.owner_jobs_key(owner), gone["jobId"]) is None
        assert redis.zscore(keys.owner_jobs_key(owner), kept["jobId"]) is not None


# ---------------------------------------------------------------- a real run


def test_a_finished_job_keeps_its_key_and_receipt(api: Api, stack: Stack) -> None:
    body = py_job("print('graded')")
    job = api.post("/v1/execute", json=body, headers={KEY: "real-run-1"}).json()
    api.start(job)
    api.wait_state(job, {"done"})
    page = _list(api, token=job["jobToken"])["jobs"]
    assert len(page) == 1
    receipt = page[0]
    assert (receipt["state"], receipt["outcome"], receipt["outcomeConfirmed"]) == ("done", "completed", True)
    assert receipt["createdAtMs"] <= receipt["endedAtMs"] == receipt["updatedAtMs"]
    assert receipt["idempotencyKey"] == "real-run-1"
    again = api.post("/v1/execute", json=body, headers={KEY: "real-run-1"})
    assert again.status_code == 200 and again.json()["jobId"] == job["jobId"]
    assert again.json()["status"] == "done"
    owner = _owner(stack, job["jobId"])
    with stack.redis() as redis:
        # The record lives RUN_RESULT_TTL now; the key record keeps its JOB_RECORD_TTL and
        # stops answering once the record is gone (see the expiry test above).
        assert 0 < redis.ttl(keys.status_key(job["jobId"])) <= 600
        assert redis.ttl(keys.idempotency_key(owner, "real-run-1")) > 3600
    assert job["jobId"] in {j["jobId"] for j in _all_pages(api, state="done", limit="200")}
