"""Artifacts: files a program leaves in its workspace, announced and downloadable.

The contract only (no I/O): the `artifact` event, how a download link is signed and
checked, and how a MIME type is told. A link is `/v1/jobs/<id>/artifacts/<n>?expires=<unix
s>&sig=<hmac>`: relative to the API, valid until the job's result expires, usable without
any bearer token (like a presigned URL). Artifacts are numbered, so a file name, whatever
bytes it holds, never becomes part of a URL, a Redis key or a header unescaped.

Workers and the API both hold the Pusher secret; the link key is derived from it (HMAC
with a fixed label), so no extra secret needs distributing and the derived key signs
nothing else.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from shared.tokens import EXPIRY

__all__ = ["ArtifactEvent", "ArtifactMeta", "artifact_path", "guess_mime_type", "sign_artifact", "verify_artifact"]


class ArtifactMeta(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One artifact as the RunResult lists it and the API serves it."""

    name: str
    mime_type: str
    bytes: int
    url: str


class ArtifactEvent(ArtifactMeta, frozen=True, kw_only=True, rename="camel"):
    seq: int


def _key(pusher_secret: str) -> bytes:
    return hmac.new(pusher_secret.encode(), b"coderunner:artifact-links:v1", hashlib.sha256).digest()


def _signature(pusher_secret: str, job_id: str, index: int, expires_at_s: int) -> str:
    message = f"{job_id}:{index}:{expires_at_s}".encode()
    return hmac.new(_key(pusher_secret), message, hashlib.sha256).hexdigest()[:48]


def artifact_path(job_id: str, index: int) -> str:
    return f"/v1/jobs/{job_id}/artifacts/{index}"


def sign_artifact(pusher_secret: str, job_id: str, index: int, expires_at_s: int, base_url: str = "") -> str:
    """The download link of artifact `index` of `job_id`, valid until `expires_at_s`: a path on
    the API, or with `base_url` (PUBLIC_API_URL) a whole URL, as the seed's presigned links
    were (its clients hand them to a browser on another origin as they are)."""
    sig = _signature(pusher_secret, job_id, index, expires_at_s)
    return f"{base_url.rstrip('/')}{artifact_path(job_id, index)}?expires={expires_at_s}&sig={sig}"




def verify_artifact(pusher_secret: str, job_id: str, index: int, expires: str, sig: str, now_s: int) -> bool:
    if not EXPIRY.fullmatch(expires) or int(expires) < now_s:
        return False
    expected = _signature(pusher_secret, job_id, index, int(expires))
    return hmac.compare_digest(expected.encode(), sig.encode("utf-8", "surrogatepass"))


_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"%PDF-", "application/pdf"),
    (b"PK\x03\x04", "application/zip"),
)


# By extension (a fixed table: the host's /etc/mime.types is not read, and must not change
# what the API says a file is).
_BY_EXTENSION = {
    "csv": "text/csv", "tsv": "text/tab-separated-values", "txt": "text/plain", "log": "text/plain",
    "md": "text/markdown", "json": "application/json", "xml": "application/xml", "html": "text/html",
    "htm": "text/html", "svg": "image/svg+xml", "png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
    "gif": "image/gif", "webp": "image/webp", "pdf": "application/pdf", "zip": "application/zip",
    "gz": "application/gzip", "wav": "audio/wav", "mp3": "audio/mpeg", "npy": "application/octet-stream",
}  # fmt: skip


def guess_mime_type(name: str, head: bytes) -> str:
    """By content for the common binary formats, else by the name's extension."""
    for magic, mime in _MAGIC:
        if head.startswith(magic):
            return mime
    _, dot, extension = name.rpartition(".")
    return _BY_EXTENSION.get(extension.lower(), "application/octet-stream") if dot else "application/octet-stream"
