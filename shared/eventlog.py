"""How events sit in a job's durable log (a Redis stream), and how they read back as JSON.

Output chunks are most of a log, and JSON escaping can make text several times larger (a
control byte becomes six), so chunk events are stored as their raw UTF-8 text and turned
into JSON only when read. Every other event is stored as the JSON that was published.
Either way an entry has `seq` and `name`, and then `chunk` or `data`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

import msgspec

from shared.messages import ChunkEvent

__all__ = ["CHUNK_EVENTS", "LOG_PAGE", "RESULT_LANDED_LUA", "XRange", "entry_json", "logged_streams"]

# A Redis client's `xrange` (key, min=, count=) -> [(stream id, fields)]: the caller's I/O.
XRange = Callable[..., Awaitable[Sequence[tuple[bytes, Mapping[bytes, bytes]]]]]

# Entries a read of a whole log takes at a time.
LOG_PAGE = 512

CHUNK_EVENTS = frozenset({"stdout", "stderr", "compile_output"})

_encoder = msgspec.json.Encoder()

# Lua for every script that appends a job's `result`: it also adds the one entry of the job's
# "done" stream (keys.done_key), which is what a waiting `GET /output` blocks on, so the
# wait wakes when the result lands and not for every event before it.
# result_landed(done stream key, ttl s).
RESULT_LANDED_LUA = """
local function result_landed(done, ttl)
  redis.call('XADD', done, 'MAXLEN', '1', '*', 'result', '1')
  redis.call('EXPIRE', done, ttl)
end
"""


def entry_json(seq: int, fields: Mapping[bytes, bytes]) -> bytes:
    """The event payload (JSON) of one stream entry, whichever way it was stored."""
    chunk = fields.get(b"chunk")
    if chunk is not None:
        return _encoder.encode(ChunkEvent(chunk=bytes(chunk).decode("utf-8", "replace"), seq=seq))
    return bytes(fields[b"data"])


async def logged_streams(xrange: XRange, key: str) -> tuple[bytes, bytes]:
    """The stdout and stderr a job's log (`key`) holds: what went out live, within its
    outputKb. For a job whose output no worker stored (lost with its worker), what it
    streamed is all there is. Read LOG_PAGE entries at a time with the caller's `xrange`."""
    streams: dict[bytes, list[bytes]] = {b"stdout": [], b"stderr": []}
    after = b""
    while True:
        page = await xrange(key, min=b"(" + after if after else "-", count=LOG_PAGE)
        for _id, fields in page:
            chunks = streams.get(bytes(fields.get(b"name", b"")))
            if chunks is not None and b"chunk" in fields:
                chunks.append(bytes(fields[b"chunk"]))
        if len(page) < LOG_PAGE:
            return b"".join(streams[b"stdout"]), b"".join(streams[b"stderr"])
        after = bytes(page[-1][0])
