"""How events sit in a job's durable log (a Redis stream), and how they read back as JSON.

Output chunks are most of a log, and JSON escaping can make text several times larger (a
control byte becomes six), so chunk events are stored as their raw UTF-8 text and turned
into JSON only when read. Every other event is stored as the JSON that was published.
Either way an entry has `seq` and `name`, and then `chunk` or `data`.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from shared.messages import ChunkEvent

__all__ = ["CHUNK_EVENTS", "RESULT_LANDED_LUA", "entry_json"]

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
