"""Who is calling: the API token holder (a backend) or the holder of one job's token.

Tokens are compared in constant time. A job token never submits jobs, and for any other
job it behaves exactly like an unknown job (404), so ids cannot be probed with it.
"""

from __future__ import annotations

import functools
import hashlib
import time

import msgspec
from starlette.requests import Request

from api.errors import ApiError
from shared.errors import FieldError, ValidationError
from shared.settings import Settings
from shared.tokens import mint_job_token, tokens_equal, verify_job_token

__all__ = ["Authenticator", "Principal", "given_once"]


def given_once(request: Request, *names: str) -> bool:
    """Each of a signed link's query parts `names` given exactly once: with a second `sig`
    or `expires` it is another link, refused like any change to it."""
    return all(len(request.query_params.getlist(name)) == 1 for name in names)


class Principal(msgspec.Struct, frozen=True):
    # Set for the API token holder: an opaque id of that token, stored as the job's owner.
    owner: str | None = None
    # Set for a job-token holder: the one job it may touch.
    job_id: str | None = None

    @property
    def caller(self) -> str:
        """Who is asking, for per-caller bounds: the API token's holder, or one job token."""
        return f"job:{self.job_id}" if self.job_id is not None else f"owner:{self.owner}"

    def may_access(self, job_id: str, job_owner: str) -> bool:
        if self.job_id is not None:
            return self.job_id == job_id
        return self.owner is not None and tokens_equal(self.owner, job_owner)


def _bearer(request: Request) -> str | None:
    given = request.headers.getlist("authorization")
    if len(given) > 1:
        # Which one counts would be a guess (a proxy's, the client's): neither does.
        raise ValidationError([FieldError("Authorization", "must be sent at most once")])
    header = given[0] if given else ""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


@functools.lru_cache(maxsize=4)
def _job_token_key(api_token: str) -> str:
    """The job-token key made from the API token, when JOB_TOKEN_SECRET is not set.

    Every browser holds a job token, an HMAC under this key: a fast hash of the API token
    would let any of them test guesses at a human-chosen API token offline, a few hundred
    million a second on one GPU. scrypt makes each guess cost 16 MiB and tens of ms.
    """
    key = hashlib.scrypt(api_token.encode(), salt=b"coderunner:jobtoken:v2", n=2**14, r=8, p=1, dklen=32)
    return key.hex()


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self._api_token = settings.api_token
        self._metrics_token = settings.metrics_token
        self._owner = hashlib.sha256(b"owner:" + settings.api_token.encode()).hexdigest()[:32]
        self._secret = settings.job_token_secret or _job_token_key(settings.api_token)
        self._ttl_s = settings.job_token_ttl_s

    @property
    def owner(self) -> str:
        """The owner id of the API token: whose blobs an upload link stores."""
        return self._owner

    @staticmethod
    def has_bearer(request: Request) -> bool:
        """Whether the request carries a bearer token (valid or not) in its header."""
        return _bearer(request) is not None

    def principal(self, request: Request, fallback_token: str | None = None, url_token: str | None = None) -> Principal:
        """Authenticate a request by its bearer token (or a token passed in the body).

        `url_token` is a token from the query string (a browser `EventSource` cannot send
        headers): only a job token is accepted there, never the API token, which would
        end up in access logs and browser history.

        Raises:
            ApiError: 401 when no valid token is presented.
        """
        token = _bearer(request) or fallback_token
        if not token and url_token:
            if self._api_token and tokens_equal(url_token, self._api_token):
                raise ApiError(
                    401,
                    "The API token is never accepted in a URL; send it in the Authorization header",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            token = url_token
        if not token:
            raise ApiError(401, "Missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if self._api_token and tokens_equal(token, self._api_token):
            return Principal(owner=self._owner)
        job_id = verify_job_token(self._secret, token, int(time.time()))
        if job_id is not None:
            return Principal(job_id=job_id)
        raise ApiError(401, "Invalid or expired token", headers={"WWW-Authenticate": "Bearer"})

    def may_scrape(self, request: Request) -> None:
        """GET /metrics: open unless METRICS_TOKEN is set, then only with it as a bearer.

        Raises:
            ApiError: 401 without the metrics token, when one is set.
        """
        if not self._metrics_token:
            return
        token = _bearer(request)
        if token is None or not tokens_equal(token, self._metrics_token):
            raise ApiError(401, "GET /metrics needs the METRICS_TOKEN as a bearer token", headers={"WWW-Authenticate": "Bearer"})

    def backend(self, request: Request) -> Principal:
        """Only the API token holder."""
        principal = self.principal(request)
        if principal.owner is None:
            raise ApiError(403, "A job token cannot do this; use the API token")
        return principal

    def mint(self, job_id: str) -> str:
        return mint_job_token(self._secret, job_id, int(time.time()), self._ttl_s)
