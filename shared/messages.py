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
    "OUTCOME_STATE",
    "TERMINAL_STATES",
    "ChunkEvent",
    "CompileInfo",
    "CtrlMessage",
    "ExecuteAccepted",
    "ExecuteRequest",
    "FileSpec",
    "JobSpec",
    "JobState",
    "JobStatus",
    "LanguageInfo",
    "Outcome",
    "RealtimeInfo",
    "ResultEvent",
    "RunResult",
    "StageEvent",
    "StdinMessage",
    "WorkerInfo",
]

# ---------------------------------------------------------------- requests


class FileSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    content: str
    encoding: Literal["utf8", "utf-8", "base64"] = "utf8"


class ExecuteRequest(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    language: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    files: list[FileSpec]
    version: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    stdin: str | None = None
    args: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=64)] = []
    limits: RequestedLimits | None = None
    collect_output: bool = False


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
    args: list[str] = []
    collect_output: bool = False
    spec_version: int = 1


class JobState(enum.StrEnum):
    QUEUED = "queued"
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


class CompileInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    exit_code: int | None
    signal: str | None
    timed_out: bool
    duration_ms: int
    output: str


class StageEvent(msgspec.Struct, frozen=True, kw_only=True):
    phase: Literal["queued", "compiling", "running"]
    seq: int


class ChunkEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Payload of `stdout`, `stderr` and `compile_output`."""

    chunk: str
    seq: int


KilledBy = Literal["wall", "cpu", "idle", "memory", "user"]


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


class ResultEvent(Verdict, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    seq: int


class RunResult(Verdict, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """The pullable result (`collectOutput`): the result fields plus the exact output."""

    stdout: str
    stderr: str
    stdout_encoding: Literal["utf8", "base64"] = "utf8"
    stderr_encoding: Literal["utf8", "base64"] = "utf8"
    artifacts: list[dict[str, object]] = []
    artifacts_truncated: bool = False


# ---------------------------------------------------------------- control plane (Redis pub/sub)


class CtrlMessage(msgspec.Struct, frozen=True, kw_only=True):
    """Published on `ctrl:<jobId>`."""

    type: Literal["start", "kill", "stdin_close"]


class StdinMessage(msgspec.Struct, frozen=True, kw_only=True):
    """Published on `stdin:<jobId>`; `data` is base64 of the exact bytes."""

    data: str


# ---------------------------------------------------------------- HTTP responses


class ExecuteAccepted(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    job_id: str
    channel: str
    status: JobState
    job_token: str


class JobStatus(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    job_id: str
    channel: str
    language: str
    version: str
    state: JobState
    updated_at_ms: int
    result: ResultEvent | None = None


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


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What a live worker advertises in Redis (runtimes it can run, its capacity)."""

    worker_id: str
    slots: int
    runtimes: list[LanguageInfo]
    started_at_ms: int
