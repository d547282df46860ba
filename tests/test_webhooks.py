"""soketi's `channel_occupied` webhook marks a job's audience (api/webhooks.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from api.body import ANONYMOUS, SMALL_BODY_BYTES, WEBHOOKS, BodyBudget
from api.errors import ApiError
from api.webhooks import MAX_WEBHOOK_BODY
from shared import keys
from shared.pusher import webhook_signature
from tests.conftest import StackFactory
from tests.helpers import Api, py_job

pytestmark = [pytest.mark.stack]


def test_the_webhook_route_marks_known_jobs_and_only_for_soketi(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False)
    api = Api(stack)
    store = redis.Redis.from_url(stack.redis_url)
    url = f"{stack.api_url}/v1/realtime/webhooks"

    def post(body: bytes, key: str = stack.pusher_key, secret: str = stack.pusher_secret) -> httpx.Response:
        headers = {"X-Pusher-Key": key, "X-Pusher-Signature": webhook_signature(secret, body), "Content-Type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=10)

    def occupied(*channels: str, name: str = "channel_occupied") -> bytes:
        return json.dumps({"time_ms": int(time.time() * 1000), "events": [{"name": name, "channel": c} for c in channels]}).encode()

    try:
        job = api.execute(py_job("print(1)"))
        marked = keys.audience_key(job["jobId"])
        body = occupied(job["channel"])
        # Anyone but soketi: no key, the wrong key, a signature made with another secret.
        for response in (
            httpx.post(url, content=body, timeout=10),
            post(body, key="someone-else"),
            post(body, secret="not-the-secret"),
        ):
            assert response.status_code == 401, response.text
            assert "X-Pusher-Signature" in response.json()["error"]
        assert not store.exists(marked)
        # Signed, but not a webhook: a 400 naming the field.
        bad = post(b'{"events": "none"}')
        assert bad.status_code == 400 and bad.json()["details"][0]["field"] == "events", bad.text
        deep = post(b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b', "events": []}')  # (an unknown field, skipped by recursion)
        assert deep.status_code == 400 and deep.json()["details"][0]["field"] == "events", deep.text
        too_big = post(b" " * (MAX_WEBHOOK_BODY + 1))
        assert too_big.status_code == 413, too_big.text
        # Other events, other channels and unknown jobs mark nothing.
        stranger = "0" * 32
        assert post(occupied(job["channel"], name="channel_vacated")).status_code == 200
        assert post(occupied(f"private-run-{stranger}", "presence-lobby", "private-run-nope")).status_code == 200
        assert not store.exists(marked) and not store.exists(keys.audience_key(stranger))
        # Signed, but sent long ago (a captured body replayed): refused, nothing marked.
        stale = json.dumps({"time_ms": int(time.time() * 1000) - 600_000, "events": [{"name": "channel_occupied", "channel": job["channel"]}]})
        refused = post(stale.encode())
        assert refused.status_code == 401 and "fresh" in refused.json()["error"], refused.text
        assert not store.exists(marked)
        # The real thing: marked, for as long as the job's record lives.
        answer = post(body)
        assert answer.status_code == 200 and answer.json() == {"ok": True}
        assert store.exists(marked) and 0 < store.ttl(marked) <= store.ttl(keys.status_key(job["jobId"])) + 1
    finally:
        api.close()
        store.close()


def test_bodies_sent_as_webhooks_leave_a_channel_auths_share_alone() -> None:
    """A webhook is read before its signature can be checked, and the app key it names is
    public: anyone may send bodies there. Held at once, they fill the webhooks' share of the
    pool, not the one a browser's channel auth (its job token in the body) is counted in."""
    budget = BodyBudget(64 * 2**20, 64 * 2**20)
    piece = SMALL_BODY_BYTES
    held = 0
    with pytest.raises(ApiError) as refused:
        for _ in range(64):
            budget._take(False, piece, WEBHOOKS, piece)
            held += piece
    assert refused.value.status == 503 and held == 4 * 2**20
    budget._take(False, 8192, ANONYMOUS, 8192)  # a channel auth still gets in
    budget._give(False, held, WEBHOOKS)
    budget._give(False, 8192, ANONYMOUS)
    assert budget.small_held == 0 and not budget._shares
