"""HTTP handlers: decode, check, call the store, encode. Nothing else lives here."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from api.artifacts import download_artifact
from api.auth import Principal
from api.blobs import check_blobs, finalize_blobs, upload_blob
from api.body import ANONYMOUS, SMALL_BODY_BYTES, BodyBudget, holder_of
from api.callbacks import check_callback_url
from api.errors import ApiError
from api.events import job_events
from api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from api.metrics import FleetSnapshot
from api.metrics import render as render_metrics
from api.output import stream_run_result, whole_run_result
from api.state import AppState
from api.store import EnqueueAnswer, ReceiptCursor, StoredOutputFound, StoredStatus, now_ms
from api.streams import StreamSlot
from api.webhooks import realtime_webhooks
from shared import keys
from shared.codec import decode_request
from shared.errors import FieldError, ValidationError
from shared.grading import killed_batch_before_start
from shared.limits import DEFAULT_LIMITS, resolve_limits, with_overrides
from shared.manifest import Manifest
from shared.messages import (
    TERMINAL_STATES,
    ExecuteAccepted,
    ExecuteRequest,
    JobPage,
    JobSpec,
    JobState,
    RealtimeInfo,
    StdinRequest,
    output_without_run,
)
from shared.pusher import channel_auth, valid_socket_id
from shared.runresult import SLICE_BYTES, OutputGone, run_result_pieces
from shared.validation import (
    check_args,
    check_array_lengths,
    check_files,
    check_stdin,
    check_tests,
    file_refs,
    spec_files,
)

__all__ = ["routes"]

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


def _json(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


def _state(request: Request) -> AppState:
    return request.app.state.coderunner  # type: ignore[no-any-return]


IDEMPOTENCY_HEADER = "Idempotency-Key"
# At most 255 visible ASCII characters (0x21-0x7E): no spaces, no control characters.
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")


def _idempotency_key(request: Request) -> str | None:
    values = request.headers.getlist(IDEMPOTENCY_HEADER)
    if not values:
        return None
    if len(values) > 1:
        raise ValidationError([FieldError(IDEMPOTENCY_HEADER, "must be sent at most once")])
    if not _IDEMPOTENCY_KEY.fullmatch(values[0]):
        raise ValidationError(
            [FieldError(IDEMPOTENCY_HEADER, "must be 1 to 255 visible ASCII characters (0x21-0x7E, no spaces)")]
        )
    return values[0]


async def _replayed(state: AppState, earlier: EnqueueAnswer, key: str) -> Response:
    """The answer to an execute whose Idempotency-Key names a live job: 200 with that job
    (same body), or 409 (another body)."""
    if earlier.outcome == "conflict":
        why = f"was already used for another request body (job {earlier.job_id})"
        raise ApiError(
            409,
            f"{IDEMPOTENCY_HEADER} {key!r} {why}; send a new key for a new request",
            details=[FieldError(IDEMPOTENCY_HEADER, why)],
        )
    status = await state.store.status(earlier.job_id)
    log.info("job %s returned again for its %s", earlier.job_id, IDEMPOTENCY_HEADER)
    accepted = ExecuteAccepted(
        job_id=earlier.job_id,
        channel=keys.realtime_channel(earlier.job_id),
        status=status.state if status is not None else JobState.EXPIRED,
        job_token=state.auth.mint(earlier.job_id),
    )
    response = _json(accepted, 200)
    response.headers["Idempotent-Replayed"] = "true"
    return response


def _check_batch(req: ExecuteRequest, files_bytes: int, max_bytes: int, manifest: Manifest) -> None:
    """A test batch gives each case its own input and arguments: none at the top level."""
    assert req.tests is not None
    for field, given in (("stdin", req.stdin is not None), ("args", bool(req.args))):
        if given:
            raise ValidationError([FieldError(field, f"is given per case (tests[].{field}) in a test batch")])
    if req.close_stdin is not None:
        # (Each case's stdin is all given up front and closed after it: nothing to choose.)
        raise ValidationError([FieldError("closeStdin", "does not apply to a test batch: each case's stdin is closed after its input")])
    check_tests(req.tests, files_bytes, max_bytes)
    if "{args}" not in manifest.run:
        for index, case in enumerate(req.tests):
            if case.args:
                raise ValidationError([FieldError(f"tests[{index}].args", f"are not supported for {manifest.language}")])


async def _sha256(body: bytes) -> str:
    """The body's digest; a big one's off the event loop (hashlib lets go of the GIL while it
    hashes, and 16 MiB take about 10 ms that every other request would otherwise wait)."""
    if len(body) <= SMALL_BODY_BYTES:
        return hashlib.sha256(body).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(body).hexdigest())


async def execute(request: Request) -> Response:
    """Queue a program. 202 {jobId, channel, status, jobToken}; 400 names the bad field; 429 when full;
    503 for a `callbackUrl` on a deployment without CALLBACK_SECRET.

    With an `Idempotency-Key` header, the same key and the byte-identical body give the job
    the first such request made (200, a fresh job token), for as long as that job's record
    lives; the same key with another body is a 409.
    """
    state = _state(request)
    principal = state.auth.backend(request)
    owner = principal.owner or ""
    idempotency_key = _idempotency_key(request)
    budget: BodyBudget = request.app.state.request_bodies
    async with budget.body(request, state.settings.max_request_bytes) as body:
        return await _execute(request, state, owner, idempotency_key, body)


async def _execute(request: Request, state: AppState, owner: str, idempotency_key: str | None, body: bytes) -> Response:
    body_sha256 = await _sha256(body) if idempotency_key is not None else ""
    if idempotency_key is not None:
        # A retry of an accepted request is answered before validation: the job exists,
        # whatever the catalogue or the queue look like now.
        earlier = await state.store.idempotent_job(owner, idempotency_key, body_sha256)
        if earlier is not None:
            return await _replayed(state, earlier, idempotency_key)
    check_array_lengths(body)
    req = decode_request(ExecuteRequest, body)
    manifest, version = await state.catalog.resolve(req.language, req.version)
    digests = file_refs(req.files)
    file_specs = spec_files(req.files)
    check_args(req.args)
    check_stdin(req.stdin)
    if req.args and "{args}" not in manifest.run:
        raise ValidationError([FieldError("args", f"are not supported for {manifest.language}")])
    if req.tests is None:
        for field, given in (("compare", req.compare is not None), ("stopOnFirstFailure", req.stop_on_first_failure is not None)):
            if given:
                raise ValidationError([FieldError(field, "applies to a test batch only: give `tests` too")])
    defaults = with_overrides(DEFAULT_LIMITS, manifest.limits)
    limits = resolve_limits(req.limits, defaults, state.settings.limit_maxima)
    if req.tests is not None and (req.limits is None or req.limits.idle_ms is None):
        # A case's input is all given up front, so a case computing in silence waits on no
        # one: unless the request names an idle clock, its wall and CPU clocks judge it.
        limits = msgspec.structs.replace(limits, idle_ms=limits.wall_time_ms)
    if req.callback_url is not None:
        await check_callback_url(req.callback_url, state.settings)
    # A file named by `ref` stays a ref in the spec (one copy of a blob however many jobs
    # name it); its blob is kept at least as long as the job's record, and the worker fetches
    # and checks its bytes when it claims the job.
    if digests:
        # Everything that does not hang on the blobs' sizes first: a request refused for a
        # file's name or a test case must not renew the blobs it names.
        check_files(file_specs, state.settings.max_files_bytes, dict.fromkeys(digests, 0))
        if req.tests is not None:
            _check_batch(req, 0, state.settings.max_files_bytes, manifest)
    sizes = await state.blobs.hold(owner, digests, state.settings.job_record_ttl_s) if digests else {}
    files_bytes = check_files(file_specs, state.settings.max_files_bytes, sizes)
    if req.tests is not None:
        _check_batch(req, files_bytes, state.settings.max_files_bytes, manifest)

    job_id = uuid.uuid4().hex
    spec = JobSpec(
        job_id=job_id,
        language=manifest.language,
        version=version,
        files=file_specs,
        limits=limits,
        created_at_ms=now_ms(),
        owner=owner,
        stdin=req.stdin,
        close_stdin=req.close_stdin if req.close_stdin is not None else req.stdin is not None,
        args=req.args,
        collect_output=req.collect_output,
        callback_url=req.callback_url,
        tests=req.tests,
        compare=req.compare or "exact",
        stop_on_first_failure=bool(req.stop_on_first_failure),
    )
    settings = state.settings
    answer = await state.store.enqueue(
        spec,
        settings.max_queue_depth,
        settings.max_parked_per_principal,
        settings.run_result_ttl_s,
        idempotency_key,
        body_sha256,
        max_retained_bytes=settings.max_retained_output_mb * 1024 * 1024,
        max_unstarted_bytes=settings.max_unstarted_input_mb * 1024 * 1024,
    )
    if idempotency_key is not None and answer.outcome in ("existing", "conflict"):
        return await _replayed(state, answer, idempotency_key)
    if answer.outcome == "retained":
        retry = max(1000, answer.frees_in_ms)
        raise ApiError(
            429,
            f"Your finished jobs keep {answer.kept_bytes // (1024 * 1024)} MiB of output in storage, the most one "
            "client may (MAX_RETAINED_OUTPUT_MB); it frees up as their results expire",
            headers={"Retry-After": str(max(1, -(-retry // 1000)))},
            retryAfterMs=retry,
        )
    if answer.outcome != "queued":
        retry = settings.queue_retry_after_ms
        if answer.outcome == "full":
            why = f"The queue is full ({settings.max_queue_depth} jobs waiting); retry later"
        elif answer.outcome == "input":
            why = (
                f"Your jobs waiting for start hold {answer.kept_bytes / (1024 * 1024):.1f} MiB of input in storage, and "
                f"this one would take them past the most one client may ({settings.max_unstarted_input_mb} MiB, "
                "MAX_UNSTARTED_INPUT_MB); start or kill some, or retry later"
            )
        else:
            why = (
                f"You have {settings.max_parked_per_principal} jobs waiting for start (the most one client may "
                "have); start or kill some, or retry later"
            )
        raise ApiError(429, why, headers={"Retry-After": str(max(1, retry // 1000))}, retryAfterMs=retry)
    log.info("job %s queued language=%s version=%s", job_id, spec.language, spec.version)
    accepted = ExecuteAccepted(
        job_id=job_id,
        channel=keys.realtime_channel(job_id),
        status=JobState.QUEUED,
        job_token=state.auth.mint(job_id),
    )
    return _json(accepted, 202)


async def start_job(request: Request) -> Response:
    """Durable start signal. 202 {ok:true}; idempotent; 409 once the job ended without starting."""
    state = _state(request)
    job_id, owner = state.job_and_owner(request)
    answer = await state.store.start(job_id, owner)
    if answer.outcome == "unknown":
        raise ApiError(404, "Job not found")
    if answer.outcome == "ended" and not answer.started:
        assert answer.state is not None
        raise ApiError(409, f"Job has already ended ({answer.state.value}) and can no longer start")
    return _json({"ok": True}, 202)


async def get_job(request: Request) -> Response:
    """Current JobStatus (with the result once the job has ended). Also at `/status`."""
    state = _state(request)
    status = await state.visible_job(request)
    callback = await state.store.callback(status.job_id) if status.has_callback else None
    return _json(status.view(callback))


# A stdin body holds at most one capped frame: 64 KiB of bytes is 88 KiB of base64, and
# JSON escaping of text can take a few times more.
MAX_STDIN_BODY = 512 * 1024


def _stdin_bytes(body: bytes) -> tuple[bytes, str]:
    """The frame's bytes, and the field that carried them."""
    req = decode_request(StdinRequest, body or b"{}")
    if (req.chunk is None) == (req.data is None):
        raise ValidationError([FieldError("chunk", "or data (with encoding \"base64\") is required, not both")])
    if req.chunk is not None:
        if req.encoding is not None:
            raise ValidationError([FieldError("encoding", "applies to data, not chunk")])
        try:
            data = req.chunk.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError([FieldError("chunk", "must be valid UTF-8 text")]) from None
        field = "chunk"
    else:
        if req.encoding != "base64":
            raise ValidationError([FieldError("encoding", 'must be "base64" when data is given')])
        try:
            data = base64.b64decode(req.data or "", validate=True)
        except (binascii.Error, ValueError):
            raise ValidationError([FieldError("data", "is not valid base64")]) from None
        field = "data"
    return data, field


def _stdin_request_id(request: Request, data: bytes, close: bool) -> str | None:
    """With an Idempotency-Key, the id the stdin script remembers this request by (for
    STDIN_REQUESTS_KEPT_S): a retry whose answer was lost, sent with the same key and the same
    bytes, stores nothing twice. The bytes are part of it: another frame under a reused key
    is another frame."""
    key = _idempotency_key(request)
    if key is None:
        return None
    digest = hashlib.sha256(b"%s\0%s\0" % (key.encode(), b"close" if close else b"data"))
    digest.update(data)
    return "key:" + digest.hexdigest()[:40]


async def _write_stdin(
    state: AppState, status: StoredStatus, data: bytes, close: bool, request_id: str | None = None
) -> Response:
    settings = state.settings
    answer = await state.store.stdin(
        status.job_id, data, close, settings.stdin_max_frames_per_s, settings.stdin_max_pending_bytes, request_id
    )
    if answer.frame is not None:
        return _json({"ok": True})
    if answer.refused == "rate":
        raise ApiError(
            429,
            f"Too many stdin frames: at most {settings.stdin_max_frames_per_s} per second per job",
            headers={"Retry-After": str(max(1, -(-answer.retry_after_ms // 1000)))},
            retryAfterMs=answer.retry_after_ms,
        )
    if answer.refused == "cap":
        cap = settings.stdin_max_pending_bytes
        raise ApiError(
            429,
            f"Too much stdin waiting: {answer.pending_bytes} bytes are not yet written to the program and "
            f"at most {cap} may wait (send smaller frames, or wait for the program to read)",
            capBytes=cap,
        )
    if answer.refused == "closed":
        raise ApiError(409, "stdin of this job is closed")
    if not answer.state:
        raise ApiError(404, "Job not found")  # its record went away since it was looked up
    raise ApiError(409, f"Job has already ended ({answer.state}); it takes no more input")


async def send_stdin(request: Request) -> Response:
    """Bytes for the program's stdin, kept durably. 200 {ok:true}; 429 past the caps; 409 once ended."""
    state = _state(request)
    principal, status = await state.caller_and_job(request)
    # A job token (a browser's) sends these: a big one counts against the bodies' budget like
    # any other, or connections sending them slowly hold memory without a bound.
    budget: BodyBudget = request.app.state.request_bodies
    cap = state.settings.stdin_max_pending_bytes
    # Both answers to a frame bigger than may ever wait are the seed product's (a 429 with
    # `capBytes`, the size its clients split input by), though no retry of it could succeed;
    # `details` names what to split.
    too_big = ApiError(
        429,
        f"A stdin frame may carry at most {cap} bytes (this body has more than {MAX_STDIN_BODY}): send it in smaller frames",
        details=[FieldError("body", f"must carry at most {cap} bytes of input")],
        capBytes=cap,
    )
    async with budget.body(request, MAX_STDIN_BODY, too_big, holder_of(principal)) as body:
        data, field = _stdin_bytes(body)
        if len(data) > cap:
            raise ApiError(
                429,
                f"A stdin frame may carry at most {cap} bytes (this one has {len(data)}): send it in smaller frames",
                details=[FieldError(field, f"must be at most {cap} bytes")],
                capBytes=cap,
            )
        return await _write_stdin(state, status, data, False, _stdin_request_id(request, data, close=False))


def _bytes_sent_along(body: bytes) -> str | None:
    """The field of a close's body that carries input (`chunk` or `data`, not empty), which
    the close would drop; None for any other body (empty, `{}`, a placeholder), ignored as
    it always was.

    Raises:
        ValidationError: a body that is not JSON, or an array: what it holds cannot be told,
            and may be input the close would drop with a 200 (found by fuzzing).
    """
    try:
        sent = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):  # (not JSON, or nested past the parser's depth)
        raise ValidationError([FieldError("body", "is not valid JSON: send no body, or an object")]) from None
    if isinstance(sent, list):
        raise ValidationError([FieldError("body", "must be an object (or no body at all)")])
    if isinstance(sent, dict):
        for field in ("chunk", "data"):
            if isinstance(sent.get(field), str) and sent[field]:
                return field
    return None


async def close_stdin(request: Request) -> Response:
    """EOF after every byte accepted so far. 200 {ok:true}; 409 once ended or already closed;
    400 for bytes sent along (they would be dropped: they go to /stdin first)."""
    state = _state(request)
    principal, status = await state.caller_and_job(request)
    budget: BodyBudget = request.app.state.request_bodies
    async with budget.body(request, MAX_STDIN_BODY, holder=holder_of(principal)) as body:
        sent = _bytes_sent_along(body)
        if sent is not None:
            raise ValidationError([FieldError(sent, "is not taken here: POST the bytes to /stdin, then close")])
    return await _write_stdin(state, status, b"", True, _stdin_request_id(request, b"", close=True))


async def kill_job(request: Request) -> Response:
    """Ask for the job to be killed. 202 {ok:true} is acceptance; the `result` is the proof."""
    state = _state(request)
    status = await state.visible_job(request)
    result = None
    if status.test_cases:
        # Should it end here, in the queue, a grader still finds every case and the summary.
        # Whatever state was read: a worker may hand the job back to the queue (a parked or
        # starting batch, at its stop) before the kill lands. (An ended one's spec is gone.)
        spec = await state.store.spec(status.job_id)
        if spec is not None and spec.tests:
            result = killed_batch_before_start(spec.tests)
    answer = await state.store.kill(status.job_id, state.settings.run_result_ttl_s, result=result)
    if answer.ended_state == "":
        raise ApiError(404, "Job not found")  # its record went away since it was looked up
    if answer.ended_state is not None:
        raise ApiError(409, f"Job has already ended ({answer.ended_state})")
    if answer.result is not None:
        log.info("job %s killed before any worker held it", status.job_id)
    if answer.result is not None and answer.heard:
        # No worker holds the job, so nobody else will tell a subscriber it ended (nor
        # publish what a claim that handed it back before start had logged).
        # (Owed until it went: should this process die first, a sweep publishes it, api/sweeper.py.)
        state.realtime.publish_soon(
            keys.realtime_channel(status.job_id),
            state.store.owed_kill(status.job_id, [*answer.unpublished, ("result", answer.result)]),
        )
    return _json({"ok": True}, 202)


MAX_PAGE = 200
_LIMIT = re.compile(r"[0-9]{1,4}")
_CURSOR = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CURSOR_TEXT = re.compile(r"([0-9]{1,15})\.([0-9a-f]{32})")
_STATE_NAMES = tuple(s.value for s in JobState)


def _page_limit(raw: str | None) -> int:
    if raw is None:
        return 50
    if not _LIMIT.fullmatch(raw) or not 1 <= int(raw) <= MAX_PAGE:
        raise ValidationError([FieldError("limit", f"must be a whole number from 1 to {MAX_PAGE}")])
    return int(raw)


def _page_states(values: list[str]) -> frozenset[str] | None:
    wanted = [piece.strip() for value in values for piece in value.split(",")]
    for name in wanted:
        if name not in _STATE_NAMES:
            raise ValidationError(
                [FieldError("state", f"{name[:40]!r} is not a job state (one or more of: {', '.join(_STATE_NAMES)})")]
            )
    return frozenset(wanted) or None


def _encode_cursor(cursor: ReceiptCursor) -> str:
    return base64.urlsafe_b64encode(f"{cursor.created_at_ms}.{cursor.job_id}".encode()).rstrip(b"=").decode()


def _decode_cursor(raw: str | None) -> ReceiptCursor | None:
    if raw is None:
        return None
    match = None
    if _CURSOR.fullmatch(raw):
        try:
            text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("ascii")
        except (binascii.Error, ValueError):
            text = ""
        match = _CURSOR_TEXT.fullmatch(text)
    if match is None:
        raise ValidationError([FieldError("cursor", "is not a cursor this API gave out (pass nextCursor as it is)")])
    return ReceiptCursor(int(match.group(1)), match.group(2))


async def list_jobs(request: Request) -> Response:
    """The caller's receipts, newest first: `?limit=` (50, at most 200), `?cursor=` (the last
    page's nextCursor), `?state=` (one or more, repeated or comma-separated). A job token
    sees its own job only."""
    state = _state(request)
    principal = state.auth.principal(request)
    params = request.query_params
    limit = _page_limit(params.get("limit"))
    states = _page_states(params.getlist("state"))
    cursor = _decode_cursor(params.get("cursor"))
    if principal.job_id is not None:
        receipt = await state.store.receipt(principal.job_id) if cursor is None else None
        shown = receipt is not None and (states is None or receipt.state.value in states)
        return _json(JobPage(jobs=[receipt] if shown and receipt is not None else [], next_cursor=None))
    jobs, following = await state.store.receipts(principal.owner or "", cursor, limit, states)
    return _json(JobPage(jobs=jobs, next_cursor=_encode_cursor(following) if following else None))


MAX_WAIT_MS = 60000


NO_OUTPUT = "No output for this job (unknown, not collected, not finished, or expired)"


async def job_output(request: Request) -> Response:
    """The pullable RunResult of a `collectOutput` job; `?waitMs=` long-polls for it.

    One uniform 404 covers an unknown job, a job that did not collect output, and an
    expired one, so job ids cannot be probed.
    """
    state = _state(request)
    try:
        status = await state.visible_job(request)
    except ApiError as exc:
        if exc.status == 404:
            raise ApiError(404, NO_OUTPUT) from None
        raise
    raw_wait = request.query_params.get("waitMs", "0")
    if not re.fullmatch(r"[0-9]+", raw_wait):
        raise ValidationError([FieldError("waitMs", "must be a non-negative integer")])
    # Any longer wait is the longest one (read without int(): thousands of digits are slow,
    # and past 4300 of them, leading zeros included, int() refuses the text).
    digits = raw_wait.lstrip("0") or "0"
    wait_ms = MAX_WAIT_MS if len(digits) > 9 else min(int(digits), MAX_WAIT_MS)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_ms / 1000
    store = state.store
    missing = NO_OUTPUT
    caller = state.auth.principal(request).caller
    if not wait_ms or status.state in TERMINAL_STATES:
        found = await store.output(status.job_id)
        if found is None:
            return await _without_output(state, request, status, missing, caller)
        return await _output_response(state, request, status.job_id, caller, found)
    # Waiting is event-driven: the script that stores the output also logs the result and
    # marks the job's done stream, and a blocking read of that stream wakes the moment it is
    # marked (or at once, if it already was). Output and other events never wake it. A job
    # that had not ended when its status was read has nothing to fetch yet: wait first.
    # Each wait holds a connection of the waits' pool: admitted like an event stream (a 429
    # past the per-caller bound, 503 when all are in use; see api/streams.py).
    if status.collects_output is False:
        raise ApiError(404, missing)  # nothing will ever be stored to wait for
    slot = request.app.state.output_waits.acquire(status.job_id, caller)

    async def wait() -> StoredOutputFound | None:
        await store.wait_for_result(status.job_id, min(wait_ms, OUTPUT_WAIT_SLICE_MS))
        while True:
            look = await store.output_snapshot(status.job_id)
            if look.output is not None or look.ended:
                return look.output
            left_ms = int((deadline - loop.time()) * 1000)
            if left_ms <= 0:
                raise ApiError(404, missing)
            await store.wait_for_result(status.job_id, min(left_ms, OUTPUT_WAIT_SLICE_MS))

    waiting = asyncio.ensure_future(wait())
    gone = asyncio.ensure_future(_client_gone(request))
    draining = asyncio.ensure_future(request.app.state.draining.wait())
    try:
        try:
            await asyncio.wait({waiting, gone, draining}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A client that hung up (its own timeout shorter than waitMs, say) gets its slot
            # and the wait's Redis connection back now, not at waitMs.
            for task in (waiting, gone, draining):
                task.cancel()
            await asyncio.gather(waiting, gone, draining, return_exceptions=True)
        if not waiting.done() or waiting.cancelled():
            if gone.done() and not gone.cancelled():
                return Response(status_code=499)  # nobody is there to read it
            # This process is stopping (api/__main__.py): ask again, here once restarted or elsewhere.
            raise ApiError(503, "The API is restarting: ask again", headers={"Retry-After": "1"}, retryAfterMs=1000)
        found = waiting.result()
        if found is None:
            return await _without_output(state, request, await store.status(status.job_id) or status, missing, caller, slot)
        # (A body streamed keeps the wait's slot until it is sent: see _output_response.)
        return await _output_response(state, request, status.job_id, caller, found, slot)
    finally:
        slot.release()


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection (a GET has no body to read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _without_output(
    state: AppState, request: Request, status: StoredStatus, missing: str, caller: str, slot: StreamSlot | None = None
) -> Response:
    """A job with no stored output: a collecting job that ended before any could be stored
    (killed in the queue, lost with its worker) answers its verdict, with what its log holds
    of its streams (a lost job's program ran: what it streamed went out live, and the pull
    says the same; streamed from the log in slices, holding an output slot, as a stored
    output is); else 404. A job that ran to its end and has no output any more has expired:
    empty streams would read as a wrong answer to a grader."""
    never_stored = not status.started or status.state is JobState.LOST
    if not (status.collects_output and status.state in TERMINAL_STATES and status.result is not None and never_stored):
        raise ApiError(404, missing)
    meta = _encoder.encode(output_without_run(status.result))
    if not status.started:
        return Response(await whole_run_result(meta, b"", b""), media_type="application/json")
    pieces = run_result_pieces(state.store.logged_output(status.job_id), meta)
    return _streamed_output(request, status.job_id, caller, slot, pieces)


# One blocking read of the done stream lasts at most this long before the job is looked at again.
OUTPUT_WAIT_SLICE_MS = 5000


async def _output_response(
    state: AppState, request: Request, job_id: str, caller: str, found: StoredOutputFound, slot: StreamSlot | None = None
) -> Response:
    """The output's body: at once when small, else streamed in slices, holding one of the
    output slots (the wait's, if it waited) until it is sent. Unbounded, 500 connections
    that never read a 16 MiB job's output held 620 MB of the API (each its slice and the
    slice's encoded copies, until the send timeout), and the loop stalled for seconds."""
    if not found.apart:
        return _built_output(request, job_id, caller, slot, found.meta)
    if found.streams is not None:
        # Small: assembled from what came with the result, no further reads.
        try:
            body = await whole_run_result(found.meta, *found.streams)
        except OutputGone:
            raise ApiError(404, NO_OUTPUT) from None
        return _built_output(request, job_id, caller, slot, body)
    return _streamed_output(request, job_id, caller, slot, stream_run_result(state.store, job_id, found.meta))


# A body built whole is sent as it is up to this size; past it, it holds an output slot.
BUILT_BODY_MAX_BYTES = 256 * 1024


def _built_output(request: Request, job_id: str, caller: str, slot: StreamSlot | None, body: bytes) -> Response:
    """An output body already built: a big one holds one of the output slots until it is
    sent, as a streamed one does. Streams under 64 KiB can still make a body of 786 KB
    (JSON writes a control byte as six), and a batch's result holds its cases' output
    itself (up to outputKb, 16 MiB): sent without a slot, connections that never read such
    a body each held it until the send timeout (review)."""
    if len(body) <= BUILT_BODY_MAX_BYTES:
        return Response(body, media_type="application/json")
    return _streamed_output(request, job_id, caller, slot, _slices_of(body))


async def _slices_of(body: bytes) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for at in range(0, len(body), SLICE_BYTES):
        yield bytes(view[at : at + SLICE_BYTES])


def _streamed_output(
    request: Request, job_id: str, caller: str, slot: StreamSlot | None, pieces: AsyncIterator[bytes]
) -> Response:
    """An output body streamed holding one of the output slots (the wait's, if it waited)
    until it is sent."""
    handed = slot.hand_over() if slot is not None else request.app.state.output_waits.acquire(job_id, caller)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for piece in pieces:
                yield piece
        finally:
            handed.release()

    return StreamingResponse(body(), media_type="application/json", background=BackgroundTask(handed.release))


async def languages(request: Request) -> Response:
    """Runtimes live workers can run right now, with their probed versions."""
    state = _state(request)
    state.auth.backend(request)
    return _json(await state.catalog.live())


# A channel-auth body is a small flat form or JSON object.
MAX_CHANNEL_AUTH_BODY = 16 * 1024
MAX_CHANNEL_AUTH_DEPTH = 8


async def channel_auth_route(request: Request) -> Response:
    """Sign a `private-run-<jobId>` subscription for the job's owner or its job-token holder.

    The bearer token is checked before the body is read. Some clients send a job token in
    the body (`jobToken`) instead: only then is the body parsed first, size- and
    depth-bounded, and a body that cannot be parsed is a 403 (no token), not a 400.

    A missing or unknown token is a 403 like any other refusal here (SPEC: "403 otherwise"),
    not the 401 of the rest of the API.
    """
    state = _state(request)
    budget: BodyBudget = request.app.state.request_bodies
    if state.auth.has_bearer(request):
        principal = _channel_principal(state, request)
        fields = _form_or_json(request, await budget.read(request, MAX_CHANNEL_AUTH_BODY, holder=holder_of(principal)))
    else:
        try:
            fields = _form_or_json(request, await budget.read(request, MAX_CHANNEL_AUTH_BODY, holder=ANONYMOUS))
        except (ValidationError, ApiError) as exc:
            if isinstance(exc, ApiError) and exc.status >= 500:
                raise  # (too many bodies at once: a retry may pass, unlike a missing token)
            fields = {}
        principal = _channel_principal(state, request, fields.get("jobToken") or fields.get("job_token"))
    socket_id = fields.get("socket_id", "")
    channel = fields.get("channel_name", "")
    if not socket_id or not valid_socket_id(socket_id):
        raise ValidationError([FieldError("socket_id", "is missing or malformed")])
    if not channel:
        raise ValidationError([FieldError("channel_name", "is required")])
    job_id = keys.job_id_from_channel(channel)
    if job_id is None:
        raise ApiError(403, "Only private-run-<jobId> channels can be authorised")
    status = await state.store.status(job_id)
    if status is None or not principal.may_access(job_id, status.owner):
        raise ApiError(403, "Not allowed to subscribe to this channel")
    # Before the signature goes out: the worker publishes live events only to jobs whose
    # channel somebody was allowed into, and a client subscribes before it starts the job.
    # (A job that has ended publishes nothing more: soketi's webhook for this subscription
    # then brings the subscriber how it ended, api/webhooks.py, which a mark here would skip.)
    if status.state in TERMINAL_STATES:
        await state.store.forget_mark(job_id)
    else:
        await state.store.mark_audience(job_id)
    settings = state.settings
    return _json({"auth": channel_auth(settings.pusher_key, settings.pusher_secret, socket_id, channel)})


def _channel_principal(state: AppState, request: Request, body_token: str | None = None) -> Principal:
    try:
        return state.auth.principal(request, fallback_token=body_token)
    except ApiError as exc:
        if exc.status != 401:
            raise
        raise ApiError(403, f"Not allowed to subscribe: {exc.message[0].lower()}{exc.message[1:]}") from None


# JSON strings (escapes included; an unterminated one runs to the end) and brackets: enough
# to measure nesting in one linear pass (possessive, so no input makes it backtrack).
_JSON_NESTING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?|[\[\]{}]', re.S)


def _json_depth_exceeds(body: bytes, limit: int) -> bool:
    depth = 0
    for match in _JSON_NESTING.finditer(body):
        token = match.group()
        if token in (b"{", b"["):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"}", b"]"):
            depth -= 1
    return False


_CHANNEL_AUTH_FIELDS = ("socket_id", "channel_name", "jobToken", "job_token")


def _form_or_json(request: Request, body: bytes) -> dict[str, str]:
    content_type = request.headers.get("content-type", "")
    # (fetch() sends a JSON string as text/plain unless told: an object is JSON all the same.)
    if "json" in content_type or body.lstrip()[:1] == b"{":
        # Nesting is checked before any parser recurses (5,000 levels would be a RecursionError).
        if _json_depth_exceeds(body, MAX_CHANNEL_AUTH_DEPTH):
            raise ValidationError([FieldError("body", f"is nested more than {MAX_CHANNEL_AUTH_DEPTH} levels deep")])
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            raise ValidationError([FieldError("body", "is not valid JSON")]) from None
        if not isinstance(data, dict):
            raise ValidationError([FieldError("body", "must be a JSON object")])
        wrong = [FieldError(k, "must be a string") for k in _CHANNEL_AUTH_FIELDS if k in data and not isinstance(data[k], str)]
        if wrong:
            raise ValidationError(wrong)
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
    try:
        parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=16)
    except (UnicodeDecodeError, ValueError):
        raise ValidationError([FieldError("body", "is not a valid form")]) from None
    return {k: v[0] for k, v in parsed.items()}


async def realtime(request: Request) -> Response:
    """What a pusher-js client needs to connect (public; holds no secret)."""
    settings = _state(request).settings
    info = RealtimeInfo(
        key=settings.pusher_key,
        ws_host=settings.realtime_host,
        ws_port=settings.realtime_port,
        force_tls=settings.realtime_tls,
    )
    return _json(info)


async def health(request: Request) -> Response:
    """Liveness: the process answers. (Redis away is every instance's trouble at once, and a
    503 that says so is the client's best answer: not a reason to take them all out.)"""
    return _json({"status": "ok"})


READY_TIMEOUT_S = 1.0


async def ready(request: Request) -> Response:
    """Readiness: this instance reaches Redis (a rotated password or a partition of this
    instance alone otherwise leaves it in the balancer, answering 503 after its retries)."""
    if await _state(request).store.reachable(READY_TIMEOUT_S):
        return _json({"status": "ready"})
    raise ApiError(503, "This API instance cannot reach Redis", retryAfterMs=1000)


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.auth.may_scrape(request)
    depth, due, workers, ended, redis_memory = await state.store.fleet()
    snapshot = FleetSnapshot(
        queue_depth=depth,
        callbacks_due=due,
        workers=workers,
        ended=ended,
        redis_memory=redis_memory,
        event_streams=request.app.state.event_streams.total,
        output_waits=request.app.state.output_waits.total,
    )
    return Response(render_metrics(snapshot), media_type=METRICS_CONTENT_TYPE)


routes = [
    Route("/v1/execute", execute, methods=["POST"]),
    Route("/v1/jobs", list_jobs, methods=["GET"]),
    Route("/v1/jobs/{job_id}/start", start_job, methods=["POST"]),
    Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
    Route("/v1/jobs/{job_id}/status", get_job, methods=["GET"]),
    Route("/v1/jobs/{job_id}/stdin", send_stdin, methods=["POST"]),
    Route("/v1/jobs/{job_id}/stdin/close", close_stdin, methods=["POST"]),
    Route("/v1/jobs/{job_id}/kill", kill_job, methods=["POST"]),
    Route("/v1/jobs/{job_id}/events", job_events, methods=["GET"]),
    Route("/v1/jobs/{job_id}/output", job_output, methods=["GET"]),
    Route("/v1/jobs/{job_id}/artifacts/{index}", download_artifact, methods=["GET"]),
    Route("/v1/blobs/check", check_blobs, methods=["POST"]),
    Route("/v1/blobs/finalize", finalize_blobs, methods=["POST"]),
    Route("/v1/blobs/uploads/{digest}", upload_blob, methods=["PUT"]),
    Route("/v1/languages", languages, methods=["GET"]),
    Route("/v1/channel-auth", channel_auth_route, methods=["POST"]),
    Route("/v1/realtime", realtime, methods=["GET"]),
    Route("/v1/realtime/webhooks", realtime_webhooks, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
