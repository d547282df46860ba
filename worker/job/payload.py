"""Published payloads fit soketi's limit by construction.

soketi refuses an event whose data is larger than its limit (100 KiB by default), and a
refused request drops every event batched with it. Chunk events are at most 8 KiB of text,
which JSON escaping can grow at most sixfold, so they always fit a limit of 64 KiB or more
(the settings refuse less). The one payload that can grow past it is the `result`, whose
`compile.output` may hold a long compile log (up to a manifest's cap, 4 MiB): when it does
not fit, the result keeps the head of the log that fits and says where the rest is. The
`compile_output` events and the pullable result carry the log whole. A batch's result lists
its cases (up to 100, each with a name of up to 128 characters, 4 bytes each at worst): one
that still does not fit (a limit near 64 KiB) goes out without the cases' names, which its
`test_result` events and the pullable result keep.
"""

from __future__ import annotations

import msgspec

from shared.messages import ResultEvent

__all__ = ["CUT_MARKER", "fit_result"]

CUT_MARKER = (
    "\n[compiler output cut here to fit one live event; the compile_output events and "
    "GET /v1/jobs/:id/output have all of it]\n"
)
# soketi measures the event's data in KiB with some rounding; stay clear of the edge.
_MARGIN_BYTES = 512

_encoder = msgspec.json.Encoder()


def fit_result(event: ResultEvent, limit_bytes: int) -> tuple[ResultEvent, bytes]:
    """The result to publish and store, and its JSON, no larger than `limit_bytes`."""
    raw = _encoder.encode(event)
    budget = limit_bytes - _MARGIN_BYTES
    if len(raw) > budget and event.tests and any(case.name for case in event.tests):
        event = msgspec.structs.replace(event, tests=[msgspec.structs.replace(c, name=None) for c in event.tests])
        raw = _encoder.encode(event)
    if len(raw) <= budget or event.compile is None:
        return event, raw
    output = event.compile.output

    def with_head(chars: int) -> bytes:
        compile_info = msgspec.structs.replace(event.compile, output=output[:chars] + CUT_MARKER)
        return _encoder.encode(msgspec.structs.replace(event, compile=compile_info))

    low, high = 0, len(output)
    while low < high:  # the longest head that fits
        middle = (low + high + 1) // 2
        if len(with_head(middle)) <= budget:
            low = middle
        else:
            high = middle - 1
    fitted = msgspec.structs.replace(
        event, compile=msgspec.structs.replace(event.compile, output=output[:low] + CUT_MARKER)
    )
    return fitted, _encoder.encode(fitted)
