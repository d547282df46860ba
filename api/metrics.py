"""`GET /metrics`: the fleet's queue depth and slot use, in Prometheus' text format.

What the fleet shares is read from Redis at each scrape, so any API process gives the same
figures for it: the queue, every live worker's load as of its last heartbeat (every
WORKER_HEARTBEAT_MS), the callbacks waiting to be sent, how many jobs ever ended in each
terminal state, and Redis's memory. The two figures that belong to the answering process
alone (its open event streams and output waits) are labelled as such by their names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.messages import WorkerInfo

__all__ = ["FleetSnapshot", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class FleetSnapshot:
    queue_depth: int
    callbacks_due: int
    workers: list[tuple[WorkerInfo, int]]  # each live worker, with the length of its claimed list
    ended: dict[str, int] = field(default_factory=dict)  # terminal state -> jobs ever
    # Redis's INFO memory: the bytes it uses (jobs' specs, logs and output, blobs) and its
    # maxmemory (0: none set), so an operator sees input or output swelling it. None: Redis
    # refused INFO (an ACL without @dangerous), and the two gauges are left out.
    redis_memory: tuple[int, int] | None = None
    event_streams: int = 0  # this API process's
    output_waits: int = 0  # this API process's


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, about: str, samples: Iterable[tuple[dict[str, str], int]]) -> None:
        self.lines.append(f"# HELP {name} {about}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{inner}}} {value}" if inner else f"{name} {value}")


def render(snapshot: FleetSnapshot) -> str:
    out = _Text()
    workers = snapshot.workers
    loads = [(info, info.load, claimed) for info, claimed in workers]
    out.metric("coderunner_queue_depth", "gauge", "Jobs queued and not yet claimed by a worker.", [({}, snapshot.queue_depth)])
    out.metric("coderunner_workers", "gauge", "Live workers (holding their lease).", [({}, len(workers))])
    out.metric("coderunner_slots", "gauge", "Sandbox slots of all live workers.", [({}, sum(i.slots for i, _ in workers))])
    out.metric(
        "coderunner_slots_in_use",
        "gauge",
        "Slots whose sandbox runs a job or serves a parked job's compile or load, fleet-wide.",
        [({}, sum(load.sandboxes_in_use for _, load, _ in loads if load))],
    )
    out.metric(
        "coderunner_jobs_waiting_for_sandbox",
        "gauge",
        "Started jobs no sandbox was ready for yet, fleet-wide.",
        [({}, sum(load.jobs_waiting_for_sandbox for _, load, _ in loads if load))],
    )
    out.metric(
        "coderunner_steps_waiting_for_memory",
        "gauge",
        "Compiles, runs and test cases waiting until their memory limits fit the hosts' ceilings, fleet-wide.",
        [({}, sum(load.steps_waiting_for_memory for _, load, _ in loads if load))],
    )
    out.metric(
        "coderunner_jobs_claimed",
        "gauge",
        "Jobs claimed by live workers (parked, starting or running), fleet-wide.",
        [({}, sum(claimed for _, claimed in workers))],
    )
    out.metric(
        "coderunner_worker_slots", "gauge", "Sandbox slots of one worker.", [({"worker": i.worker_id}, i.slots) for i, _ in workers]
    )
    out.metric(
        "coderunner_worker_jobs_claimed",
        "gauge",
        "Jobs in one worker's claimed list.",
        [({"worker": i.worker_id}, claimed) for i, claimed in workers],
    )
    out.metric(
        "coderunner_worker_sandboxes",
        "gauge",
        "One worker's sandbox slots by state, as of its last heartbeat.",
        [
            ({"worker": info.worker_id, "state": state}, value)
            for info, load, _ in loads
            if load is not None
            for state, value in (
                ("ready", load.sandboxes_ready),
                ("building", load.sandboxes_building),
                ("in_use", load.sandboxes_in_use),
            )
        ],
    )
    out.metric(
        "coderunner_worker_jobs_waiting_for_sandbox",
        "gauge",
        "Started jobs on one worker that no sandbox was ready for yet.",
        [({"worker": info.worker_id}, load.jobs_waiting_for_sandbox) for info, load, _ in loads if load is not None],
    )
    out.metric(
        "coderunner_worker_sandbox_builds_failed_total",
        "counter",
        "Sandbox builds that failed on one worker since it started.",
        [({"worker": info.worker_id}, load.sandbox_builds_failed) for info, load, _ in loads if load is not None],
    )
    out.metric(
        "coderunner_jobs_ended_total",
        "counter",
        "Jobs that ended, by terminal state (done, killed, error, expired, lost).",
        [({"state": state}, count) for state, count in sorted(snapshot.ended.items())],
    )
    out.metric(
        "coderunner_callbacks_due", "gauge", "Result callbacks waiting to be sent or retried.", [({}, snapshot.callbacks_due)]
    )
    if snapshot.redis_memory is not None:
        used, limit = snapshot.redis_memory
        out.metric(
            "coderunner_redis_used_memory_bytes",
            "gauge",
            "Memory Redis uses (its INFO used_memory): job specs, logs, output and blobs among it.",
            [({}, used)],
        )
        out.metric(
            "coderunner_redis_maxmemory_bytes", "gauge", "Redis's maxmemory setting; 0 when it has none.", [({}, limit)]
        )
    out.metric(
        "coderunner_api_event_streams",
        "gauge",
        "Event-log streams (GET /events) open on this API process.",
        [({}, snapshot.event_streams)],
    )
    out.metric(
        "coderunner_api_output_waits",
        "gauge",
        "GET /output long-polls waiting on this API process.",
        [({}, snapshot.output_waits)],
    )
    return "\n".join(out.lines) + "\n"
