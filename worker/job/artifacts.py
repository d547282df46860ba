"""Artifacts: the files a program leaves at the top of its workspace, collected and stored.

Collecting runs after every process of the job is dead, over a tree the program wrote, so
it trusts nothing in it. The workspace's top level is listed on the event loop: a tmpfs
folder whose inode cap bounds it to a few thousand names, usually a handful, and one listing
costs less than a trip to a thread. New files, if any, are read on an isolation thread:
each entry is opened relative to the workspace's own descriptor with O_NOFOLLOW (a symbolic
link to a host file fails to open) and O_NONBLOCK (a FIFO opens without waiting for a
writer), and only a regular file is read, and only if fstat says it fits what is left of
the job's total (a sparse 1 GiB file is skipped, not read). The total is `maxArtifactBytes`
(all files together, as in the seed product) and never more than the workspace's size:
without that bound, sparse files (their size is not their blocks) or many hard links to
one big file would let a job have the worker read, and Redis keep, far more than its
workspace could hold. A file is read once, under its first name in
order; another name of the same file is skipped. Names are kept as text (bytes that are
not UTF-8 become U+FFFD, and characters a submitted name may not hold, controls and
invisible formatting, visible escapes: a name is shown, and a program chose it); the files
themselves are addressed by number everywhere.

Storage sits behind `ArtifactStore` so another backend (S3-compatible storage, say) can
replace Redis without touching the job's lifecycle.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from shared import keys
from shared.validation import visible_name

__all__ = ["ArtifactStore", "Collected", "RedisArtifactStore", "collect_artifacts", "top_level_names"]


@dataclass(frozen=True)
class Collected:
    files: list[tuple[str, bytes]]
    # A cap (count or size) left something out.
    truncated: bool


def top_level_names(path: str) -> set[bytes]:
    """The names at the top of the workspace: before the run (inputs, compiled program: not
    artifacts), and after it (anything new is one)."""
    return set(os.listdir(os.fsencode(path)))


def collect_artifacts(path: str, before: set[bytes], max_count: int, max_bytes: int, max_total_bytes: int) -> Collected:
    """New regular files at the top of the workspace, at most `max_count`, each at most
    `max_bytes`, together at most `max_total_bytes` (isolation threads only). Either maximum
    at 0 turns artifacts off: not even empty files are kept."""
    if max_count <= 0 or max_total_bytes <= 0:
        return Collected([], False)
    files: list[tuple[str, bytes]] = []
    truncated = False
    left = max_total_bytes
    seen: set[tuple[int, int]] = set()
    root = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in sorted({os.fsencode(entry) for entry in os.listdir(root)} - before):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root)
            except OSError:
                continue  # a symbolic link, or gone
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    continue  # FIFO, socket, device, directory: never read
                if (info.st_dev, info.st_ino) in seen:
                    truncated = True  # another name of a file read already
                    continue
                if info.st_size > min(max_bytes, left) or len(files) >= max_count:
                    truncated = True
                    continue
                seen.add((info.st_dev, info.st_ino))
                data = _read_at_most(fd, info.st_size)
                left -= len(data)
            finally:
                os.close(fd)
            files.append((visible_name(name.decode("utf-8", "replace")), data))
    finally:
        os.close(root)
    return Collected(files, truncated)


def _read_at_most(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# The most bytes one command carries to Redis or asks back. The worker's command connection
# is pipelined and shared with every job's events and results and with the heartbeat, and
# answers come in order: one 64 MiB SET would hold all of them behind it, and past the
# connection's 5 s deadline on a slow link fail them all and the lease with them.
PIECE_BYTES = 1 << 20


async def put_in_pieces(redis: Redis, key: str, data: bytes, ttl_s: int) -> None:
    """SET `key` to `data` (with its TTL) a piece at a time. Each piece is written at its
    offset (SETRANGE), so one sent again (its reply lost) writes the same bytes."""
    view = memoryview(data)
    await redis.set(key, view[:PIECE_BYTES], ex=ttl_s)
    for offset in range(PIECE_BYTES, len(data), PIECE_BYTES):
        await redis.setrange(key, offset, view[offset : offset + PIECE_BYTES])  # type: ignore[arg-type]


class ArtifactStore(Protocol):
    async def put(self, job_id: str, attempt: int, index: int, meta_json: bytes, data: bytes, ttl_s: int) -> bool:
        """Keep artifact `index` of `job_id` (its metadata and bytes) for `ttl_s` seconds,
        unless the job is no longer this claim's (`attempt`): then False, nothing kept."""


# KEYS: status, the artifacts' hash. ARGV: attempt, index, metadata, ttl s. Fenced like every
# other write of a running job: a worker that lost the job (a stall past its lease) must not
# attach files to a result another worker wrote.
_PUT = """
local terminal = {done=true, killed=true, error=true, expired=true, lost=true}
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] or (not state) or terminal[state] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""


class RedisArtifactStore:
    """Artifacts in Redis beside the job's result: metadata in one hash, bytes in a key each."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._put = redis.register_script(_PUT)

    async def put(self, job_id: str, attempt: int, index: int, meta_json: bytes, data: bytes, ttl_s: int) -> bool:
        # The bytes (megabytes, maybe) go in with plain commands, not through the script's
        # arguments, which Redis would copy into Lua and again into the key. Unlisted (the
        # claim was fenced) they are never read, and expire.
        await put_in_pieces(self._redis, keys.artifact_data_key(job_id, index), data, ttl_s)
        kept = await self._put(
            keys=[keys.status_key(job_id), keys.artifacts_key(job_id)],
            args=[attempt, index, meta_json, ttl_s],
        )
        return bool(kept)
