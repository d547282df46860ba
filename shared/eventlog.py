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

__all__ = ["CHUNK_EVENTS", "entry_json"]

CHUNK_EVENTS = frozenset({"stdout", "stderr", "compile_output"})

_encoder = msgspec.json.Encoder()


def entry_json(seq: int, fields: Mapping[bytes, bytes]) -> bytes:
    """The event payload (JSON) of one stream entry, whichever way it was stored."""
    chunk = fields.get(b"chunk")
    if chunk is not None:
        return _encoder.encode(ChunkEvent(chunk=bytes(chunk).decode("utf-8", "replace"), seq=seq))
    return bytes(fields[b"data"])
