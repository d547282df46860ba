"""`GET /v1/jobs/:id/output` body: a RunResult streamed from what the worker stored.

The output bytes sit raw in Redis (`job:<id>:stdout`, `job:<id>:stderr`) next to the rest
of the result (a StoredOutput). The body is `{"stdout": …, "stderr": …, <the rest>}`,
written piece by piece: the API never holds a whole output, let alone its JSON form, which
for control bytes is six times larger. Output small enough to come with the result (up to
64 KiB a stream) is answered in one piece instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from api.store import JobStore
from shared.runresult import run_result_pieces

__all__ = ["stream_run_result", "whole_run_result"]


def stream_run_result(store: JobStore, job_id: str, meta: bytes) -> AsyncIterator[bytes]:
    async def read(stream: str, offset: int, size: int) -> bytes:
        return await store.output_slice(job_id, stream, offset, size)

    return run_result_pieces(read, meta)


async def whole_run_result(meta: bytes, stdout: bytes, stderr: bytes) -> bytes:
    """The same body at once, from output small enough to have been read with the result."""
    streams = {"stdout": stdout, "stderr": stderr}

    async def read(stream: str, offset: int, size: int) -> bytes:
        return streams[stream][offset : offset + size]

    return b"".join([piece async for piece in run_result_pieces(read, meta)])
