"""What every job run shares with its worker, built once at start-up."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from shared.settings import Settings
from worker.cgroups import CgroupLayout
from worker.control import ControlBus
from worker.publisher import Publisher
from worker.queue import WorkerQueue
from worker.runtimes import Runtime

__all__ = ["SandboxConfig", "WorkerContext"]


@dataclass(frozen=True)
class SandboxConfig:
    nsjail: str
    profiles_dir: Path
    work_root: Path
    workspace_bytes: int = 64 * 1024 * 1024
    workspace_inodes: int = 4096
    rlimit_fsize_mb: int = 64
    rlimit_nofile: int = 64
    ready_timeout_s: float = 10.0

    def profile(self, name: str) -> Path:
        return self.profiles_dir / f"{name}.cfg"


@dataclass
class WorkerContext:
    settings: Settings
    queue: WorkerQueue
    control: ControlBus
    publisher: Publisher
    cgroups: CgroupLayout
    runtimes: dict[str, Runtime]
    sandbox: SandboxConfig
    # Set on SIGTERM: parked jobs go back to the queue, nothing new is claimed.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
