"""`GET /v1/jobs/:id/output` body: a RunResult streamed from what the worker stored.

The output bytes sit raw in Redis (`job:<id>:stdout`, `job:<id>:stderr`) next to the rest
of the result (a StoredOutput). The body is `{"stdout": …, "stderr": …, <the rest>}`,
written piece by piece: the API never holds a whole output, let alone its JSON form, which
for control bytes is six times larger.
"""

from __future__ import annotations

import base64
import codecs
from collections.abc import AsyncIterator

import msgspec

from api.store import JobStore

__all__ = ["stream_run_result"]

# Read this much of a stored stream at a time (a multiple of 3, so base64 pieces join up).
SLICE_BYTES = 3 * 87382  # ~256 KiB

_encoder = msgspec.json.Encoder()


async def _json_string(store: JobStore, job_id: str, stream: str, encoding: str) -> AsyncIterator[bytes]:
    yield b'"'
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offset = 0
    while True:
        piece = await store.output_slice(job_id, stream, offset, SLICE_BYTES)
        offset += len(piece)
        last = len(piece) < SLICE_BYTES
        if encoding == "base64":
            if piece:
                yield base64.b64encode(piece)
        else:
            text = decoder.decode(piece, final=last)
            if text:
                yield _encoder.encode(text)[1:-1]
        if last:
            break
    yield b'"'


async def stream_run_result(store: JobStore, job_id: str, meta: bytes) -> AsyncIterator[bytes]:
    fields = msgspec.json.decode(meta)
    yield b'{"stdout":'
    async for part in _json_string(store, job_id, "stdout", fields.get("stdoutEncoding", "utf8")):
        yield part
    yield b',"stderr":'
    async for part in _json_string(store, job_id, "stderr", fields.get("stderrEncoding", "utf8")):
        yield part
    rest = meta.strip()[1:]
    yield b"}" if rest.strip() == b"}" else b"," + rest
