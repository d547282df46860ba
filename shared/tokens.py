"""Job tokens: short-lived credentials scoped to one job, verifiable without Redis.

Format: `<jobId>.<expiresAtS>.<hmac>`. The API hands one out with every accepted job so a
backend can pass it to a browser instead of the API token.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from shared.keys import is_job_id

__all__ = ["EXPIRY", "mint_job_token", "tokens_equal", "verify_job_token"]


def _signature(secret: str, job_id: str, expires_at_s: int) -> str:
    message = f"jobtoken:v1:{job_id}:{expires_at_s}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()[:40]


def mint_job_token(secret: str, job_id: str, now_s: int, ttl_s: int) -> str:
    expires_at_s = now_s + ttl_s
    return f"{job_id}.{expires_at_s}.{_signature(secret, job_id, expires_at_s)}"


# An expiry in seconds as tokens and signed links carry it: one spelling (no leading zero),
# so a token or link changed in any way is refused.
EXPIRY = re.compile(r"[1-9][0-9]{0,11}")


def verify_job_token(secret: str, token: str, now_s: int) -> str | None:
    """The job id the token grants, or None if it is malformed, forged or expired."""
    parts = token.split(".")
    if len(parts) != 3 or not is_job_id(parts[0]) or not EXPIRY.fullmatch(parts[1]):
        return None
    job_id, expires_raw, signature = parts
    expires_at_s = int(expires_raw)
    if not tokens_equal(signature, _signature(secret, job_id, expires_at_s)):
        return None
    if expires_at_s < now_s:
        return None
    return job_id


def tokens_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two secrets (any string, even one with lone surrogates)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))
