"""Uploaded blobs: big input files sent once, then named by hash in `files[].ref`.

The seed SDK's `executeFiles` sends a binary file over 256 KiB this way instead of inline:
`POST /v1/blobs/check` with the file's `sha256:<hex>` says whether it is missing and gives
an upload link; the SDK PUTs the raw bytes to that link, calls `POST /v1/blobs/finalize`,
then executes with `{name, ref}`. This module holds the contract only (no I/O): how a
reference is spelled and how an upload link is signed and checked.

An upload link is `/v1/blobs/uploads/<hex>?expires=<unix s>&sig=<hmac>`. Like a presigned
URL it carries no bearer token: the signature is the credential, and it covers the one
digest and the one principal (the API token's owner id, which the link does not show) the
bytes may be stored for. The API checks that the
bytes hash to that digest before storing them, so a blob's name always says what it holds.
The link key is derived from the Pusher secret with a label of its own (as artifact links
are, with another label), so API replicas need no extra secret and it signs nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from shared.tokens import EXPIRY

__all__ = ["HOLD_LUA", "LENGTHEN_LUA", "UPLOAD_LINK_TTL_S", "parse_ref", "sign_upload", "upload_path", "verify_upload"]

# A blob a job holds may live longer than BLOB_TTL_S: every script only ever lengthens a life,
# and the owner's index lives as long as its longest-lived blob.
LENGTHEN_LUA = """
local function lengthen(key, ttl)
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
"""

# KEYS: the owner's blob index. ARGV: ttl s, the owner's blob key prefix, digests. Each blob
# that exists lives at least `ttl` from now (a longer life it has is kept) and is put back on
# the index if it fell off; returns each one's size, -1 where missing. Run by the API when a
# job naming them is submitted, and by the worker that claims it (its record's life starts
# again then, and the blobs must last as long: the job may be handed back and claimed again).
HOLD_LUA = LENGTHEN_LUA + """
local out = {}
for i = 3, #ARGV do
  local key = ARGV[2] .. ARGV[i]
  local size = redis.call('STRLEN', key)
  if size > 0 or redis.call('EXISTS', key) == 1 then
    lengthen(key, ARGV[1])
    redis.call('HSET', KEYS[1], ARGV[i], size)
    lengthen(KEYS[1], ARGV[1])
    out[#out + 1] = size
  else
    out[#out + 1] = -1
  end
end
return out
"""

# How long an upload link from /v1/blobs/check stays valid (the SDK PUTs at once).
UPLOAD_LINK_TTL_S = 3600

_REF = re.compile(r"sha256:([0-9a-f]{64})")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_OWNER = re.compile(r"[0-9a-f]{1,64}")


def parse_ref(ref: str) -> str | None:
    """The hex digest a `sha256:<64 lowercase hex>` reference names, or None."""
    match = _REF.fullmatch(ref)
    return match.group(1) if match else None


def _key(pusher_secret: str) -> bytes:
    return hmac.new(pusher_secret.encode(), b"coderunner:blob-uploads:v1", hashlib.sha256).digest()


def _signature(pusher_secret: str, owner: str, digest: str, expires_at_s: int) -> str:
    message = f"{owner}:{digest}:{expires_at_s}".encode()
    return hmac.new(_key(pusher_secret), message, hashlib.sha256).hexdigest()[:48]


def upload_path(digest: str) -> str:
    return f"/v1/blobs/uploads/{digest}"


def sign_upload(pusher_secret: str, owner: str, digest: str, expires_at_s: int) -> str:
    """The upload link (path and query) for `digest`, stored for `owner`, valid until `expires_at_s`."""
    sig = _signature(pusher_secret, owner, digest, expires_at_s)
    return f"{upload_path(digest)}?expires={expires_at_s}&sig={sig}"


def verify_upload(pusher_secret: str, digest: str, owner: str, expires: str, sig: str, now_s: int) -> bool:
    """Whether an upload link's parts are well formed, signed by us for `owner`, and not expired."""
    if not (_DIGEST.fullmatch(digest) and _OWNER.fullmatch(owner) and EXPIRY.fullmatch(expires)):
        return False
    if int(expires) < now_s:
        return False
    expected = _signature(pusher_secret, owner, digest, int(expires))
    return hmac.compare_digest(expected.encode(), sig.encode("utf-8", "surrogatepass"))
