"""Uploaded blobs: `POST /v1/blobs/check`, `PUT /v1/blobs/uploads/:hex`, `POST /v1/blobs/finalize`.

The seed SDK's `executeFiles` uploads a binary over 256 KiB this way, then names it in
`files[].ref` (shared/blobs.py has the contract). A blob is kept in Redis for the principal
that uploaded it, for BLOB_TTL_S after its upload or its last check or use; one principal
keeps at most MAX_BLOB_STORAGE_MB and MAX_BLOBS_PER_PRINCIPAL blobs at once. Blobs are not
shared between principals: whether a digest is "present" tells a caller only about its own
uploads.

The upload link is the only credential of the PUT (the SDK sends no bearer with it). The
API hashes the bytes before storing them, so a blob is always what its name says. An
execute keeps the ref in the job's spec (Redis holds a blob once, however many jobs name it)
and renews the blob for as long as the job may wait, so it cannot expire before the worker
fetches and checks it.
"""

from __future__ import annotations

import hashlib
import time

import msgspec
from redis.asyncio import Redis
from starlette.requests import Request
from starlette.responses import Response

from api.auth import given_once
from api.body import BodyBudget, declared_length
from api.errors import ApiError
from api.streams import StreamSlots
from leanredis.scripts import OomRefusedScript
from shared import keys
from shared.blobs import HOLD_LUA, LENGTHEN_LUA, UPLOAD_LINK_TTL_S, parse_ref, sign_upload, verify_upload
from shared.codec import decode_request
from shared.errors import FieldError, ValidationError
from shared.messages import BlobCheckAnswer, BlobFinalized, BlobHashes, BlobUpload
from shared.settings import Settings

__all__ = ["BlobStore", "TooMuch", "check_blobs", "finalize_blobs", "upload_blob"]

_encoder = msgspec.json.Encoder()
# A check or finalize body: at most 100 references of 71 characters, with JSON around them.
_HASHES_BODY_BYTES = 64 * 1024

# KEYS: the blob, the owner's blob index. ARGV: digest, bytes, ttl s, most bytes the owner may
# keep, most blobs, the owner's blob key prefix. Returns {1} (stored, or already there: its
# TTL renewed), {0, blobs kept, ms until the soonest expires} (too many blobs) or {-1, bytes
# kept, ms until the soonest expires} (too many bytes). Index entries whose blob has
# expired are dropped on the way, so the sums count only live blobs.
_PUT = LENGTHEN_LUA + """
local size = string.len(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 1 then
  lengthen(KEYS[1], ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[1], size)
  lengthen(KEYS[2], ARGV[3])
  return {1}
end
local total, count, soonest = 0, 0, -1
local entries = redis.call('HGETALL', KEYS[2])
for i = 1, #entries, 2 do
  local left = redis.call('PTTL', ARGV[6] .. entries[i])
  if left == -2 then
    redis.call('HDEL', KEYS[2], entries[i])
  else
    total = total + tonumber(entries[i + 1])
    count = count + 1
    if left >= 0 and (soonest < 0 or left < soonest) then soonest = left end
  end
end
if count + 1 > tonumber(ARGV[5]) then return {0, count, soonest} end
if total + size > tonumber(ARGV[4]) then return {-1, total, soonest} end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], size)
lengthen(KEYS[2], ARGV[3])
return {1}
"""

# KEYS: the owner's blob index. ARGV: ttl s, the owner's blob key prefix, digests. Gives
# each blob that exists at least `ttl` more and returns 1 or 0 per digest.
_TOUCH = LENGTHEN_LUA + """
local out = {}
for i = 3, #ARGV do
  local key = ARGV[2] .. ARGV[i]
  if redis.call('EXISTS', key) == 1 then
    lengthen(key, ARGV[1])
    redis.call('HSET', KEYS[1], ARGV[i], redis.call('STRLEN', key))
    lengthen(KEYS[1], ARGV[1])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

class TooMuch(msgspec.Struct, frozen=True):
    """An upload the owner's storage has no room for."""

    what: str  # "blobs" or "bytes"
    kept: int
    frees_in_ms: int


class BlobStore:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._ttl_s = settings.blob_ttl_s
        self._max_bytes = settings.max_blob_storage_mb * 1024 * 1024
        self._max_blobs = settings.max_blobs_per_principal
        # Refused at Redis's maxmemory even when it first forgets expired entries (a plain
        # script would then grow Redis past its limit by a whole blob).
        self._put = OomRefusedScript(redis, _PUT)
        self._touch = redis.register_script(_TOUCH)
        self._hold = redis.register_script(HOLD_LUA)

    async def put(self, owner: str, digest: str, data: bytes) -> TooMuch | None:
        """Keep `data` (whose sha256 is `digest`) for `owner`; what stood in the way, if anything."""
        keys_ = [keys.blob_key(owner, digest), keys.blob_index_key(owner)]
        args = [digest, data, self._ttl_s, self._max_bytes, self._max_blobs, keys.blob_prefix(owner)]
        reply = await self._put(keys=keys_, args=args)
        if int(reply[0]) == 1:
            return None
        return TooMuch("blobs" if int(reply[0]) == 0 else "bytes", int(reply[1]), int(reply[2]))

    async def touch(self, owner: str, digests: list[str]) -> set[str]:
        """Which of `digests` the owner keeps (those get a fresh TTL)."""
        if not digests:
            return set()
        reply = await self._touch(keys=[keys.blob_index_key(owner)], args=[self._ttl_s, keys.blob_prefix(owner), *digests])
        return {digest for digest, found in zip(digests, reply, strict=True) if int(found) == 1}

    async def exists(self, owner: str, digest: str) -> bool:
        """Whether the owner keeps this blob (renewed if so): an upload of it is then done."""
        return digest in await self.touch(owner, [digest])

    async def hold(self, owner: str, digests: list[str], hold_s: int) -> dict[str, int]:
        """The size of each of `digests` the owner keeps, each kept at least `hold_s` more
        (a job naming them can then fetch them for as long as it can run)."""
        if not digests:
            return {}
        # (A minute more than asked: the job's record is written just after this.)
        ttl_s = max(hold_s + 60, self._ttl_s)
        reply = await self._hold(keys=[keys.blob_index_key(owner)], args=[ttl_s, keys.blob_prefix(owner), *digests])
        return {digest: int(size) for digest, size in zip(digests, reply, strict=True) if int(size) >= 0}


def _json(body: object, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


async def _hashes(request: Request) -> dict[str, int]:
    """The digests a check or finalize body names, in order, each once, with where each
    first stands in the request; 400 names a bad one."""
    bodies: BodyBudget = request.app.state.request_bodies
    body = await bodies.read(request, _HASHES_BODY_BYTES)
    req = decode_request(BlobHashes, body)
    digests: dict[str, int] = {}
    for index, ref in enumerate(req.hashes):
        digest = parse_ref(ref)
        if digest is None:
            raise ValidationError([FieldError(f"hashes[{index}]", "must be sha256:<64 lowercase hex digits>")])
        digests.setdefault(digest, index)
    return digests


async def _hashed_body(request: Request, limit: int, digest: str) -> bytes:
    """The body, hashed as it arrives (no pause of the loop to hash megabytes at the end).

    Raises:
        ApiError: 413 past `limit` bytes (declared or streamed).
        ValidationError: naming `body` when it does not hash to `digest`.
    """
    too_big = ApiError(
        413,
        f"A blob must be at most {limit} bytes (MAX_FILES_BYTES, and no more than MAX_BLOB_STORAGE_MB)",
        details=[FieldError("body", f"must be at most {limit} bytes")],
    )
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise too_big
    sha = hashlib.sha256()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        sha.update(chunk)
        chunks.append(chunk)
    if sha.hexdigest() != digest:
        raise ValidationError([FieldError("body", f"does not hash to the link's sha256:{digest}")])
    return b"".join(chunks)


def _public_base(request: Request, settings: Settings) -> str:
    """Where clients reach this API: PUBLIC_API_URL, else the scheme and host they used."""
    if settings.public_api_url:
        return settings.public_api_url.rstrip("/")
    return f"{request.url.scheme}://{request.url.netloc}"


async def check_blobs(request: Request) -> Response:
    """`POST /v1/blobs/check {hashes}`: 200 {missing: [{hash, uploadUrl}], present: [hash]}."""
    state = request.app.state.coderunner
    owner = state.auth.backend(request).owner
    digests = list(await _hashes(request))
    present = await state.blobs.touch(owner, digests)
    settings: Settings = state.settings
    expires_at_s = int(time.time()) + UPLOAD_LINK_TTL_S
    base = _public_base(request, settings)
    missing = [
        BlobUpload(hash=f"sha256:{digest}", upload_url=base + sign_upload(settings.pusher_secret, owner, digest, expires_at_s))
        for digest in digests
        if digest not in present
    ]
    return _json(BlobCheckAnswer(missing=missing, present=[f"sha256:{digest}" for digest in digests if digest in present]))


async def finalize_blobs(request: Request) -> Response:
    """`POST /v1/blobs/finalize {hashes}`: 200 {finalized}; a 400 names a hash never uploaded."""
    state = request.app.state.coderunner
    owner = state.auth.backend(request).owner
    positions = await _hashes(request)
    digests = list(positions)
    present = await state.blobs.touch(owner, digests)
    for digest, index in positions.items():
        if digest not in present:  # (named by where it stands in the request)
            why = "has no uploaded bytes: PUT them to the uploadUrl from POST /v1/blobs/check first (or it has expired)"
            raise ValidationError([FieldError(f"hashes[{index}]", why)])
    return _json(BlobFinalized(finalized=[f"sha256:{digest}" for digest in digests]))


async def upload_blob(request: Request) -> Response:
    """`PUT /v1/blobs/uploads/:hex?expires=&sig=` with the raw bytes: 200 {ok: true}.

    No bearer: the link is the credential (403 when it is not valid or has expired), checked
    before a byte of the body is read. Uploads at once are bounded per API process
    (MAX_BLOB_UPLOADS; two for one digest), since each holds its body in memory. Bytes the
    owner keeps already are not sent to Redis again. A body that does not hash to the link's
    digest is a 400; past MAX_FILES_BYTES or the whole MAX_BLOB_STORAGE_MB a 413; past what
    the principal may keep now a 429 that says when room frees up.
    """
    state = request.app.state.coderunner
    settings: Settings = state.settings
    digest = request.path_params["digest"]
    query = request.query_params
    owner = state.auth.owner
    if not given_once(request, "expires", "sig") or not verify_upload(settings.pusher_secret, digest, owner, query.get("expires", ""), query.get("sig", ""), int(time.time())):
        raise ApiError(403, "This upload link is not valid or has expired; POST /v1/blobs/check gives a fresh one")
    if await state.blobs.exists(owner, digest):
        return _json({"ok": True})  # (a replayed link: the bytes are kept already, unread)
    slots: StreamSlots = request.app.state.blob_uploads
    slot = slots.acquire(digest, owner)
    try:
        limit = min(settings.max_files_bytes, settings.max_blob_storage_mb * 1024 * 1024)
        data = await _hashed_body(request, limit, digest)
        refused = await state.blobs.put(owner, digest, data)
    finally:
        slot.release()
    if refused is not None:
        retry_ms = max(1000, refused.frees_in_ms)
        if refused.what == "blobs":
            why = f"You keep {refused.kept} uploaded blobs, the most one client may (MAX_BLOBS_PER_PRINCIPAL)"
        else:
            why = (
                f"Your uploaded blobs hold {refused.kept} bytes; this one does not fit in the "
                f"{settings.max_blob_storage_mb} MiB one client may keep (MAX_BLOB_STORAGE_MB)"
            )
        raise ApiError(
            429,
            f"{why}; room frees up as they expire (BLOB_TTL_S after their last use)",
            headers={"Retry-After": str(max(1, -(-retry_ms // 1000)))},
            retryAfterMs=retry_ms,
        )
    return _json({"ok": True})
