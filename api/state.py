"""What every handler needs, built once by the app's lifespan (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from starlette.requests import Request

from api.auth import Authenticator, Principal
from api.blobs import BlobStore
from api.catalog import Catalog
from api.errors import ApiError
from api.realtime import RealtimePublisher
from api.store import JobStore, StoredStatus
from shared import keys
from shared.settings import Settings

__all__ = ["AppState"]


@dataclass(frozen=True)
class AppState:
    settings: Settings
    redis: Redis
    store: JobStore
    catalog: Catalog
    auth: Authenticator
    realtime: RealtimePublisher
    blobs: BlobStore

    def job_and_owner(self, request: Request) -> tuple[str, str]:
        """The job named in the path and the owner it must have for this caller ('' when the
        caller's job token names it), for a script to check; a 404 when it cannot be theirs."""
        job_id = request.path_params["job_id"]
        principal = self.auth.principal(request)
        if keys.is_job_id(job_id):
            if principal.job_id is not None:
                if principal.job_id == job_id:
                    return job_id, ""
            elif principal.owner is not None:
                # An owner is an opaque hash of a token, not a secret: a script may compare it.
                return job_id, principal.owner
        raise ApiError(404, "Job not found")

    async def visible_job(self, request: Request, url_token: bool = False) -> StoredStatus:
        """The job named in the path, if the caller may see it; one uniform 404 otherwise.

        With `url_token`, a job token may also come as `?token=` (see Authenticator).
        """
        return (await self.caller_and_job(request, url_token))[1]

    async def caller_and_job(self, request: Request, url_token: bool = False) -> tuple[Principal, StoredStatus]:
        """visible_job, with who asked."""
        job_id = request.path_params["job_id"]
        principal = self.auth.principal(request, url_token=request.query_params.get("token") if url_token else None)
        status = await self.store.status(job_id) if keys.is_job_id(job_id) else None
        if status is None or not principal.may_access(job_id, status.owner):
            raise ApiError(404, "Job not found")
        return principal, status
