"""Uploaded blobs' bytes (`files[].ref`), one copy per blob for every job of this worker.

A parked job holds its files' bytes until it starts or expires. Were each job to fetch its
own copy, 500 parked jobs naming one 8 MiB blob would hold 4 GB in the worker, and each claim
would pull 8 MiB over the command connection the heartbeats share. So a blob fetched and
checked once is kept for as long as some job holds it: the jobs hold `Blob`s, this cache only
weak references to them, and an entry goes when its last job does. Entries are per principal,
as blobs are in Redis: a job may only name what its own owner uploaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from collections.abc import Iterable

from worker.isolation.offload import off_loop
from worker.messaging.queue import WorkerQueue

__all__ = ["Blob", "BlobFetch", "SharedBlobs"]


class Blob:
    """The checked bytes of one blob; alive while a job holds it."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data


class BlobFetch:
    """What one fetch found: the blobs whose bytes match their digest, and those that were
    missing or did not match (for the caller to name)."""

    __slots__ = ("found", "mismatched", "missing")

    def __init__(self) -> None:
        self.found: dict[str, Blob] = {}
        self.missing: set[str] = set()
        self.mismatched: set[str] = set()


class SharedBlobs:
    def __init__(self) -> None:
        self._held: weakref.WeakValueDictionary[tuple[str, str], Blob] = weakref.WeakValueDictionary()
        # Fetches under way, so jobs claimed together naming one blob fetch it once.
        self._fetching: dict[tuple[str, str], asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    async def get(self, queue: WorkerQueue, owner: str, digests: Iterable[str]) -> BlobFetch:
        """The blobs of `owner` named by `digests`, from this worker's copies where it holds
        them, else from Redis (checked against their digest off the loop).

        Raises:
            RedisError: the blobs could not be read (nothing is kept of that fetch).
        """
        wanted = list(dict.fromkeys(digests))
        result = BlobFetch()
        while True:
            rest = []
            for digest in wanted:
                blob = self._held.get((owner, digest))
                if blob is not None:
                    result.found[digest] = blob
                elif digest not in result.missing and digest not in result.mismatched:
                    rest.append(digest)
            pending = {self._fetching[(owner, d)] for d in rest if (owner, d) in self._fetching}
            if not pending:
                break
            # Another job is fetching some of them: wait for it (however it ends), then look
            # again; what it did not keep (gone, altered, an error) is fetched here.
            await asyncio.wait(pending)
            wanted = rest
        if rest:
            await self._fetch(queue, owner, rest, result)
        return result

    async def _fetch(self, queue: WorkerQueue, owner: str, digests: list[str], result: BlobFetch) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for digest in digests:
            self._fetching[(owner, digest)] = done
        try:
            stored = await queue.blobs(owner, digests)
            matching = await off_loop(_matching, stored)  # (hashing megabytes would hold the loop)
        finally:
            for digest in digests:
                if self._fetching.get((owner, digest)) is done:
                    del self._fetching[(owner, digest)]
            done.set_result(None)
        for digest in digests:
            if digest in matching:
                blob = self._held.get((owner, digest))  # (kept meanwhile by another fetch?)
                if blob is None:
                    blob = self._held[(owner, digest)] = Blob(matching[digest])
                result.found[digest] = blob
            elif digest in stored:
                result.mismatched.add(digest)
            else:
                result.missing.add(digest)


def _matching(blobs: dict[str, bytes]) -> dict[str, bytes]:
    return {digest: data for digest, data in blobs.items() if hashlib.sha256(data).hexdigest() == digest}
