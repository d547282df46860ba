"""A RunResult as JSON, assembled piece by piece from what the worker stored.

The output bytes sit raw in Redis (`job:<id>:stdout`, `job:<id>:stderr`) next to the rest
of the result (a StoredOutput). `GET /output` and a `collectOutput` callback both send
`{"stdout": …, "stderr": …, <the rest>}` without ever holding a whole output or its JSON
form (for control bytes six times larger). This module does no I/O: the caller passes the
function that reads a slice of a stored stream.
"""

from __future__ import annotations

import base64
import codecs
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

__all__ = ["SLICE_BYTES", "OutputGone", "ReadSlice", "run_result_pieces"]

# Read this much of a stored stream at a time (a multiple of 3, so base64 pieces join up).
SLICE_BYTES = 3 * 87382  # ~256 KiB

# (stream, offset, size) -> at most `size` bytes of that stream from `offset`.
ReadSlice = Callable[[str, int, int], Awaitable[bytes]]

_encoder = msgspec.json.Encoder()


class OutputGone(Exception):
    """A stored stream ended before the length its result records (it expired, or was
    evicted, while being read): the body must break off, not pass a short output as whole."""


async def _json_string(read: ReadSlice, stream: str, encoding: str, length: int | None) -> AsyncIterator[bytes]:
    yield b'"'
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offset = 0
    while True:
        piece = await read(stream, offset, SLICE_BYTES)
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
    if length is not None and offset < length:
        raise OutputGone(f"{stream} ended at byte {offset} of {length}")
    yield b'"'


async def run_result_pieces(read: ReadSlice, meta: bytes, head: bytes = b"{") -> AsyncIterator[bytes]:
    """The JSON object `head` + stdout + stderr + the fields of `meta` (a StoredOutput);
    `head` is `{` or `{` followed by fields of the caller's and a comma."""
    fields = msgspec.json.decode(meta)
    yield head + b'"stdout":'
    async for part in _json_string(read, "stdout", fields.get("stdoutEncoding", "utf8"), fields.get("stdoutBytes")):
        yield part
    yield b',"stderr":'
    async for part in _json_string(read, "stderr", fields.get("stderrEncoding", "utf8"), fields.get("stderrBytes")):
        yield part
    rest = meta.strip()[1:]
    yield b"}" if rest.strip() == b"}" else b"," + rest
