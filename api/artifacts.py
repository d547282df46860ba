"""`GET /v1/jobs/:id/artifacts/:n?expires=&sig=`: an artifact's exact bytes, no bearer needed.

The link's signature and expiry are the only credential (shared/artifacts.py), checked
before Redis is asked anything; a wrong, expired or unknown link is one uniform 404. The
answer is always an attachment with `nosniff` and a sandboxing CSP, so an HTML or SVG
file a program wrote can never run as a page of the API's origin; the file name goes into
Content-Disposition only percent-encoded (RFC 6266 `filename*`), with a plain-ASCII
fallback, whatever characters it holds.

The bytes are read from Redis in slices as the client takes them, and downloads at once
are bounded per process and per job (MAX_ARTIFACT_DOWNLOADS, MAX_ARTIFACT_DOWNLOADS_PER_JOB):
one link opened on many connections that never read cannot take the API's memory.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import AsyncIterator

import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api.auth import given_once
from api.streams import StreamSlots
from shared.artifacts import ArtifactMeta, verify_artifact
from shared.keys import is_job_id

__all__ = ["download_artifact"]

_INDEX = re.compile(r"0|[1-9][0-9]{0,5}")
# What one read from Redis takes of an artifact (and what a stalled client holds).
SLICE_BYTES = 256 * 1024
_FALLBACK = re.compile(r"[^A-Za-z0-9._-]")
# Control characters, and the marks that reorder text (a name ending U+202E "gnp.exe" shows as
# "exe.png"): left out of the name a browser offers to save the file under.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class _Missing(Exception):
    pass


def _disposition(name: str) -> str:
    name = _UNSHOWN.sub("", name) or "artifact"
    fallback = _FALLBACK.sub("_", name)[:100] or "artifact"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{urllib.parse.quote(name.encode('utf-8', 'replace'), safe='')}"


async def download_artifact(request: Request) -> Response:
    state = request.app.state.coderunner
    job_id = request.path_params["job_id"]
    raw_index = request.path_params["index"]
    expires = request.query_params.get("expires", "")
    sig = request.query_params.get("sig", "")
    missing = Response(
        b'{"error":"No such artifact (unknown, expired, or the link is not valid)","details":[]}', 404, media_type="application/json"
    )
    if not is_job_id(job_id) or not _INDEX.fullmatch(raw_index) or not given_once(request, "expires", "sig"):
        return missing
    index = int(raw_index)
    if not verify_artifact(state.settings.pusher_secret, job_id, index, expires, sig, int(time.time())):
        return missing
    slots: StreamSlots = request.app.state.artifact_downloads
    slot = slots.acquire(job_id, job_id)  # (the link is the only credential: per job is per caller)
    try:
        found = await state.store.artifact(job_id, index)
    except BaseException:
        slot.release()
        raise
    if found is None:
        slot.release()
        return missing
    try:
        meta = msgspec.json.decode(found[0], type=ArtifactMeta)
    except BaseException:
        slot.release()
        raise
    size = found[1]
    headers = {
        "Content-Length": str(size),
        "Content-Disposition": _disposition(meta.name),
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "sandbox; default-src 'none'",
        "Cache-Control": "private, max-age=60",
    }
    if request.method == "HEAD":
        slot.release()  # (its headers only: no slice of it is read)
        return Response(b"", media_type=meta.mime_type, headers=headers)

    async def body() -> AsyncIterator[bytes]:
        # Slice by slice, so a client that reads slowly (or not at all) holds one slice of
        # the API's memory, not the whole file (up to 64 MiB) for as long as it likes.
        try:
            offset = 0
            while offset < size:
                piece = await state.store.artifact_slice(job_id, index, offset, SLICE_BYTES)
                if not piece:
                    # Expired mid-download: end short of Content-Length, so the client sees
                    # a broken transfer, never a shorter file passed off as whole.
                    raise ConnectionAbortedError(f"artifact {job_id}/{index} went away mid-download")
                offset += len(piece)
                yield piece
        finally:
            slot.release()

    return StreamingResponse(
        body(),
        media_type=meta.mime_type,
        headers=headers,
        background=BackgroundTask(slot.release),  # (also when the body never began)
    )
