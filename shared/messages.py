"""The wire contract: every message that crosses HTTP, Redis or soketi is a Struct here.

Evolution rule (msgspec): new fields get defaults, existing fields never change type, so a
job queued by an older API decodes in a newer worker and the other way round.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

from shared.limits import Limits, RequestedLimits

__all__ = [
    "MAX_BLOB_HASHES",
    "MAX_TESTS",
    "OUTCOME_STATE",
    "TERMINAL_STATES",
    "BlobCheckAnswer",
    "BlobFinalized",
    "BlobHashes",
    "BlobUpload",
    "CallbackState",
    "CallbackStatus",
    "CaseFacts",
    "CaseOutput",
    "ChunkEvent",
    "CompileInfo",
    "CtrlMessage",
    "ExecuteAccepted",
    "ExecuteRequest",
    "FileInput",
    "FileSpec",
    "JobPage",
    "JobReceipt",
    "JobSpec",
    "JobState",
    "JobStatus",
    "LanguageInfo",
    "Outcome",
    "RealtimeInfo",
    "ResultCallback",
    "ResultEvent",
    "RunResult",
    "RunResultCallback",
    "StageEvent",
    "StdinFrame",
    "StdinRequest",
    "StoredOutput",
    "TestCase",
    "TestResultEvent",
    "TestSummary",
    "WorkerInfo",
    "WorkerLoad",
    "case_facts",
    "case_without_output",
    "output_without_run",
    "result_template",
    "result_without_run",
]

# ---------------------------------------------------------------- requests


class FileSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A file as a job's spec holds it: its bytes inline, or `ref`, the `sha256:<hex>` of a
    blob of the job's owner, which the worker fetches and checks when it claims the job (a
    worker older than `ref` refuses a spec that has one rather than run without the file)."""

    name: str
    content: str = ""
    encoding: Literal["utf8", "utf-8", "base64"] = "utf8"
    # Unset, it is not written at all: a spec without refs reads as before to older workers.
    ref: str | msgspec.UnsetType = msgspec.UNSET


class FileInput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A file as `POST /v1/execute` takes it: `content` inline, or `ref`, the `sha256:<hex>`
    of a blob uploaded beforehand (shared/blobs.py). Exactly one of the two."""

    name: str
    content: str | msgspec.UnsetType = msgspec.UNSET
    encoding: Literal["utf8", "utf-8", "base64"] = "utf8"
    ref: str | msgspec.UnsetType = msgspec.UNSET


MAX_TESTS = 100
# Arguments a job, or a test case, may give its program.
MAX_ARGS = 64
# Hashes one blob check or finalize may name (as many as a job may have files).
MAX_BLOB_HASHES = 100


class TestCase(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    """One case of a test batch: its input, arguments and, to be judged, the expected stdout."""

    stdin: str | None = None
    args: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=MAX_ARGS)] = []
    expected_output: str | None = None
    name: Annotated[str, msgspec.Meta(max_length=128)] | None = None


class ExecuteRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    language: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    files: list[FileInput]
    version: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    stdin: str | None = None
    # EOF after the up-front stdin. Unset: yes when `stdin` is given (a grader's input),
    # no otherwise (an IDE keeps stdin open for POST /stdin until POST /stdin/close).
    close_stdin: bool | None = None
    args: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=MAX_ARGS)] = []
    limits: RequestedLimits | None = None
    collect_output: bool = False
    # Where the result is POSTed, signed, once the job ends (see shared/callbacks.py).
    callback_url: str | None = None
    # A test batch: compiled once, each case run in a fresh jail and judged (shared/grading.py).
    tests: list[TestCase] | None = None
    # Unset means "exact" and false; either given without `tests` is refused (it would judge nothing).
    compare: Literal["exact", "lines", "tokens"] | None = None
    stop_on_first_failure: bool | None = None


class StdinRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/jobs/:id/stdin`: `{chunk}` (UTF-8 text) or `{data, encoding: "base64"}` (bytes)."""

    chunk: str | None = None
    data: str | None = None
    encoding: Literal["base64"] | None = None


# ---------------------------------------------------------------- stored job


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What the API stores for a worker: validated, resolved, self-contained."""

    job_id: str
    language: str
    version: str
    files: list[FileSpec]
    limits: Limits
    created_at_ms: int
    owner: str = ""
    stdin: str | None = None
    close_stdin: bool = True
    args: list[str] = []
    collect_output: bool = False
    callback_url: str | None = None
    tests: list[TestCase] | None = None
    compare: Literal["exact", "lines", "tokens"] = "exact"
    stop_on_first_failure: bool = False
    spec_version: int = 1


class JobState(enum.StrEnum):
    QUEUED = "queued"
    # Claimed by a worker, waiting for start (no worker holds a queued job).
    PARKED = "parked"
    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    KILLED = "killed"
    ERROR = "error"
    EXPIRED = "expired"
    LOST = "lost"


TERMINAL_STATES = frozenset({JobState.DONE, JobState.KILLED, JobState.ERROR, JobState.EXPIRED, JobState.LOST})


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    COMPILE_ERROR = "compile_error"
    TIMED_OUT = "timed_out"
    IDLE_TIMED_OUT = "idle_timed_out"
    MEMORY_EXCEEDED = "memory_exceeded"
    KILLED = "killed"
    EXPIRED = "expired"
    LOST = "lost"
    INTERNAL_ERROR = "internal_error"


OUTCOME_STATE: dict[Outcome, JobState] = {
    Outcome.COMPLETED: JobState.DONE,
    Outcome.COMPILE_ERROR: JobState.DONE,
    Outcome.TIMED_OUT: JobState.DONE,
    Outcome.IDLE_TIMED_OUT: JobState.DONE,
    Outcome.MEMORY_EXCEEDED: JobState.DONE,
    Outcome.KILLED: JobState.KILLED,
    Outcome.EXPIRED: JobState.EXPIRED,
    Outcome.LOST: JobState.LOST,
    Outcome.INTERNAL_ERROR: JobState.ERROR,
}


# ---------------------------------------------------------------- events (soketi + durable log)


class CompileInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    exit_code: int | None
    signal: str | None
    timed_out: bool
    duration_ms: int
    # The compiler's stdout and stderr interleaved as they came (what `compile_output` streamed).
    output: str
    # Each stream on its own, as the seed product's CompileResult has them (in the pullable
    # RunResult only: the published result event keeps to `output`).
    stdout: str | None = None
    stderr: str | None = None


class StageEvent(msgspec.Struct, frozen=True, kw_only=True):
    phase: Literal["queued", "compiling", "running"]
    seq: int


class ChunkEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Payload of `stdout`, `stderr` and `compile_output`."""

    chunk: str
    seq: int


KilledBy = Literal["wall", "cpu", "idle", "memory", "user"]


class CaseFacts(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """How one test case went: the `test_result` event (with `seq`) and an entry of the
    result's `tests` (with its output in the pullable result)."""

    index: int
    name: str | None
    # null for a case that never ran because an earlier one failed under stopOnFirstFailure
    # (the job went on to complete; this case did not).
    outcome: Outcome | None
    verdict: str
    exit_code: int | None
    signal: str | None
    duration_ms: int
    cpu_ms: int
    memory_kb: int
    killed_by: KilledBy | None = None
    truncated: bool = False
    # Why, when the outcome alone would mislead: a case the memory ceiling ended under its
    # own memoryMb (the same text as a plain job's result `message`).
    message: str | None = None


class TestResultEvent(CaseFacts, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    seq: int


class CaseOutput(CaseFacts, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """A case in the pullable result: its facts and its exact output."""

    stdout: str
    stderr: str
    stdout_encoding: Literal["utf8", "base64"] = "utf8"
    stderr_encoding: Literal["utf8", "base64"] = "utf8"
    # The output kept here is the first part only: a batch keeps at most the job's outputKb
    # of its cases' output, split evenly among them.
    output_cut: bool = False


def case_facts(case: CaseFacts) -> CaseFacts:
    """A case's facts alone (a CaseOutput without its output), as events carry them."""
    return CaseFacts(**{f: getattr(case, f) for f in CaseFacts.__struct_fields__})


def case_without_output(facts: CaseFacts) -> CaseOutput:
    """A case as the pullable result lists it when none of its output is kept."""
    return CaseOutput(**{f: getattr(facts, f) for f in CaseFacts.__struct_fields__}, stdout="", stderr="")


class TestSummary(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    passed: int
    failed: int
    skipped: int
    verdict: str


class Verdict(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """The fields the result event and the pullable result share."""

    exit_code: int | None
    signal: str | None
    timed_out: bool
    idle_timed_out: bool
    truncated: bool
    duration_ms: int
    cpu_ms: int
    memory_kb: int
    outcome: Outcome
    compile: CompileInfo | None
    # Which limit ended the run, when one did: "wall", "cpu", "idle", "memory", or "user" (a
    # kill request). timedOut alone does not say whether the wall or the CPU clock fired.
    killed_by: KilledBy | None = None
    # Only set for outcomes where the platform, not the program, decided (e.g. internal_error).
    message: str | None = None
    # Test batches: the summary of every case (their facts are in `tests`).
    summary: TestSummary | None = None


class ResultEvent(Verdict, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    seq: int
    tests: list[CaseFacts] | None = None


class RunResult(Verdict, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """The pullable result (`collectOutput`): the result fields plus the exact output."""

    stdout: str
    stderr: str
    stdout_encoding: Literal["utf8", "base64"] = "utf8"
    stderr_encoding: Literal["utf8", "base64"] = "utf8"
    artifacts: list[dict[str, object]] = []
    artifacts_truncated: bool = False
    tests: list[CaseOutput] | None = None
    # The `result` event's seq (SPEC: the result's fields; None from a store before it was kept).
    seq: int | None = None


class ResultCallback(ResultEvent, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """The body POSTed to `callbackUrl` of a job without `collectOutput`: its `result` event
    and its id. (With `collectOutput` the body is the RunResult, as GET /output gives it,
    with `jobId` first: see RunResultCallback.)"""

    job_id: str


class RunResultCallback(RunResult, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """The body POSTed to `callbackUrl` of a `collectOutput` job: the RunResult and its id."""

    job_id: str


class StoredOutput(Verdict, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """A RunResult as stored: everything but the output bytes, which sit raw in their own
    keys (so their stored size is their size, whatever JSON escaping would make of them).
    The API streams `{"stdout": …, "stderr": …, <these fields>}` from the three."""

    stdout_encoding: Literal["utf8", "base64"]
    stderr_encoding: Literal["utf8", "base64"]
    artifacts: list[dict[str, object]]
    artifacts_truncated: bool
    tests: list[CaseOutput] | None = None
    # How many bytes each stored stream holds (None: stored before this was recorded), so a
    # reader can tell a stream that expired mid-read from a short one.
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    # The `result` event's seq (None: stored before it was kept).
    seq: int | None = None


# ---------------------------------------------------------------- control plane (Redis pub/sub)


class CtrlMessage(msgspec.Struct, frozen=True, kw_only=True):
    """Published on `ctrl:<jobId>`."""

    type: Literal["start", "kill", "stdin_close"]


class StdinFrame(msgspec.Struct, frozen=True, kw_only=True):
    """One accepted stdin frame, as published on `stdin:<jobId>` after it is stored.

    The durable copy is entry `id` of the job's stdin stream; `n` numbers the job's frames
    from 0, so a worker that sees a gap reads the stream from where it is. `data` is base64
    of the exact bytes; a `close` frame (EOF) has none.
    """

    n: int
    id: str
    kind: Literal["data", "close"]
    data: str = ""


# ---------------------------------------------------------------- HTTP responses


class BlobHashes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/blobs/check` and `/v1/blobs/finalize`: blobs by `sha256:<hex>`."""

    hashes: Annotated[list[str], msgspec.Meta(max_length=MAX_BLOB_HASHES)]


class BlobUpload(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    hash: str
    upload_url: str


class BlobCheckAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """Which blobs still need their bytes (with where to PUT them) and which are kept."""

    missing: list[BlobUpload]
    present: list[str]


class BlobFinalized(msgspec.Struct, frozen=True, kw_only=True):
    finalized: list[str]


class ExecuteAccepted(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    job_id: str
    channel: str
    status: JobState
    job_token: str


class CallbackState(enum.StrEnum):
    # Not delivered yet: the job has not ended, or an attempt is due or under way.
    PENDING = "pending"
    # A receiver answered 2xx.
    DELIVERED = "delivered"
    # Given up: every attempt within CALLBACK_RETRY_FOR_S failed, or the URL was refused.
    FAILED = "failed"


class CallbackStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """Where a job's callback stands (in `GET /v1/jobs/:id`)."""

    state: CallbackState
    attempts: int
    # The HTTP status of the last attempt's answer (none when it got no answer).
    last_status: int | None = None
    last_error: str | None = None
    last_attempt_at_ms: int | None = None
    next_attempt_at_ms: int | None = None
    delivered_at_ms: int | None = None


class JobStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    job_id: str
    channel: str
    language: str
    version: str
    state: JobState
    updated_at_ms: int
    result: ResultEvent | None = None
    # A kill was accepted and the job has not ended yet (the `result` confirms it).
    kill_requested: bool = False
    # Jobs submitted with a callbackUrl: its delivery state.
    callback: CallbackStatus | None = None


class JobReceipt(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """One entry of `GET /v1/jobs`: what became of a job the caller submitted."""

    job_id: str
    language: str
    version: str
    state: JobState
    # The result's outcome once the job ended; null before (always present).
    outcome: str | None
    created_at_ms: int
    updated_at_ms: int
    ended_at_ms: int | None = None
    idempotency_key: str | None = None
    # Once ended: true when the program's end was observed (any outcome but `lost`); false for
    # `lost` (the worker vanished after the program started: it may or may not have finished).
    outcome_confirmed: bool | None = None


class JobPage(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """`GET /v1/jobs`: newest first; `nextCursor` is null on the last page."""

    jobs: list[JobReceipt]
    next_cursor: str | None


class LanguageInfo(msgspec.Struct, frozen=True, kw_only=True):
    language: str
    version: str
    aliases: list[str]
    interactive: bool
    compiled: bool


class RealtimeInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    key: str
    ws_host: str
    ws_port: int
    force_tls: bool = msgspec.field(name="forceTLS")
    cluster: str = "mt1"


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """How busy a worker is, as of its last heartbeat (GET /metrics shows it)."""

    jobs_claimed: int  # parked, starting or running here
    jobs_waiting_for_sandbox: int  # started, and no sandbox ready for them yet
    sandboxes_ready: int
    sandboxes_building: int
    sandboxes_in_use: int  # running a job, or lent to a parked job's compile or load
    sandbox_builds_failed: int  # since the worker started
    # Compiles, runs and test cases held at the gate until their memory limits fit the
    # ceiling all jobs share (0 from workers older than the field).
    steps_waiting_for_memory: int = 0


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What a live worker advertises in Redis (runtimes it can run, its capacity, its load)."""

    worker_id: str
    slots: int
    runtimes: list[LanguageInfo]
    started_at_ms: int
    load: WorkerLoad | None = None
    # Its WORKER_LEASE_TTL_MS and WORKER_HEARTBEAT_MS: which Redis stalls can lapse its lease,
    # which another worker must be able to tell before judging it dead (None: an older worker).
    lease_ttl_ms: int | None = None
    heartbeat_ms: int | None = None


def result_without_run(outcome: Outcome, message: str | None, compile: CompileInfo | None = None) -> ResultEvent:
    """The result of a job whose program did not run to an end of its own (seq filled in later).

    A kill request always reads the same, whenever it landed: `signal: "SIGKILL"`,
    `killedBy: "user"`.
    """
    killed = outcome == Outcome.KILLED
    return ResultEvent(
        exit_code=None,
        signal="SIGKILL" if killed else None,
        timed_out=False,
        idle_timed_out=False,
        truncated=False,
        duration_ms=0,
        cpu_ms=0,
        memory_kb=0,
        outcome=outcome,
        compile=compile,
        seq=0,
        killed_by="user" if killed else None,
        message=message,
    )


def output_without_run(result: ResultEvent) -> StoredOutput:
    """What a collectOutput job that ended before any output was stored (killed in the
    queue, lost with its worker) has to pull: its verdict, empty streams, no artifacts.
    Served like any stored output, so the RunResult has the same shape."""
    verdict = {name: getattr(result, name) for name in Verdict.__struct_fields__}
    cases = [case_without_output(c) for c in result.tests] if result.tests is not None else None
    return StoredOutput(
        **verdict, stdout_encoding="utf8", stderr_encoding="utf8", artifacts=[], artifacts_truncated=False, tests=cases,
        seq=result.seq,
    )  # fmt: skip


def result_template(result: ResultEvent) -> tuple[bytes, bytes]:
    """A result's JSON split around its seq, for Redis scripts that pick the seq themselves."""
    raw = msgspec.json.encode(msgspec.structs.replace(result, seq=0))
    prefix, found, suffix = raw.partition(b'"seq":0')
    if not found:  # pragma: no cover - seq is a required field
        raise ValueError("result has no seq")
    return prefix + b'"seq":', suffix
