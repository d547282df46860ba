"""How events sit in a job's durable log (a Redis stream), and how they read back as JSON.

Output chunks are most of a log, and JSON escaping can make text several times larger (a
control byte becomes six), so chunk events are stored as their raw UTF-8 text and turned
into JSON only when read. Every other event is stored as the JSON that was published.
Either way an entry has `seq` and `name`, and then `chunk` or `data`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from shared.messages import ChunkEvent
from shared.runresult import OutputGone

__all__ = ["CHUNK_EVENTS", "COMPACT_MAX_BYTES", "COMPACT_MAX_ENTRIES", "LOG_PAGE", "RESULT_LANDED_LUA", "LoggedStreams", "XRange", "entry_json"]

# A Redis client's `xrange` (key, min=, count=) -> [(stream id, fields)]: the caller's I/O.
XRange = Callable[..., Awaitable[Sequence[tuple[bytes, Mapping[bytes, bytes]]]]]

# Log entries a pass over a whole log reads at a time (at most 512 KiB of 8 KiB chunks).
LOG_PAGE = 64

CHUNK_EVENTS = frozenset({"stdout", "stderr", "compile_output"})

_encoder = msgspec.json.Encoder()

# A finished stream this short (and its DUMP this small) is compacted (see RESULT_LANDED_LUA).
COMPACT_MAX_ENTRIES = 32
COMPACT_MAX_BYTES = 64 * 1024

# Lua for every script that appends a job's `result`: it also adds the one entry of the job's
# "done" stream (keys.done_key), which is what a waiting `GET /output` blocks on, so the
# wait wakes when the result lands and not for every event before it.
#
# Then it compacts the done stream and the job's other streams (its log, its stdin), which
# take no more entries. Redis 7
# gives a stream's node 4 KiB up front (at most `stream-node-max-bytes`) and keeps it until
# the node is full, so a grader's log of four events took 4.7 KB, and the done stream's one
# entry as much: 85 % of what a finished job kept. DUMP and RESTORE (which allocates
# exactly, and keeps the stream's ids and TTL) bring them to about 0.7 KB each; waiting
# readers are served from the restored stream. Only short ones: a long log's slack is small
# beside it, and its DUMP would hold Redis up. Where DUMP or RESTORE is refused (an ACL, a
# managed Redis), the streams stay as they are.
# result_landed(done stream key, ttl s, the job's other streams: its log, its stdin).
RESULT_LANDED_LUA = f"""
local function compacted(key)
  if redis.call('XLEN', key) > {COMPACT_MAX_ENTRIES} then return end
  local dump = redis.pcall('DUMP', key)
  if type(dump) ~= 'string' or #dump > {COMPACT_MAX_BYTES} then return end
  local ttl_ms = redis.call('PTTL', key)
  redis.pcall('RESTORE', key, ttl_ms > 0 and ttl_ms or 0, dump, 'REPLACE')
end
local function result_landed(done, ttl, ...)
  redis.call('XADD', done, 'MAXLEN', '1', '*', 'result', '1')
  redis.call('EXPIRE', done, ttl)
  compacted(done)
  for _, stream in ipairs({{...}}) do compacted(stream) end
end
"""


def entry_json(seq: int, fields: Mapping[bytes, bytes]) -> bytes:
    """The event payload (JSON) of one stream entry, whichever way it was stored."""
    chunk = fields.get(b"chunk")
    if chunk is not None:
        return _encoder.encode(ChunkEvent(chunk=bytes(chunk).decode("utf-8", "replace"), seq=seq))
    return bytes(fields[b"data"])


class LoggedStreams:
    """A job's stdout and stderr as its log (`key`) holds them (what went out live, within its
    outputKb), read as a ReadSlice (shared.runresult) with the caller's `xrange`: each
    stream's chunks in order, LOG_PAGE entries at a time, never the whole log at once. For a
    job whose output no worker stored (lost with its worker), what it streamed is all there
    is. Reads go forward through a stream, as a RunResult's body reads it; a read from an
    earlier offset starts that stream's pass again.

    Such a job's log ends with its result: a pass that runs out before it has met the result
    found the log expired (or evicted) under it, and raises OutputGone, so that what was read
    is broken off rather than passed as the whole stream."""

    def __init__(self, xrange: XRange, key: str) -> None:
        self._xrange = xrange
        self._key = key
        self._passes: dict[str, _StreamPass] = {}

    async def __call__(self, stream: str, offset: int, size: int) -> bytes:
        read = self._passes.get(stream)
        if read is None or offset < read.start:
            read = self._passes[stream] = _StreamPass(stream.encode())
        while read.start + len(read.held) < offset + size and not read.ended:
            page = await self._xrange(self._key, min=b"(" + read.after if read.after else "-", count=LOG_PAGE)
            for _id, fields in page:
                name = bytes(fields.get(b"name", b""))
                if name == read.name and b"chunk" in fields:
                    read.held += fields[b"chunk"]
                elif name == b"result":
                    read.ended = True
            if len(page) < LOG_PAGE and not read.ended:
                raise OutputGone(f"the log {self._key} ended before its result (it expired while being read)")
            if page:
                read.after = bytes(page[-1][0])
        skip = offset - read.start
        piece = bytes(read.held[skip : skip + size])
        del read.held[: skip + len(piece)]  # (nothing before what was read is read again)
        read.start = offset + len(piece)
        return piece


@dataclass
class _StreamPass:
    name: bytes
    after: bytes = b""  # the last log entry read
    held: bytearray = field(default_factory=bytearray)  # the stream's bytes from `start` on, not yet handed
    start: int = 0
    ended: bool = False
