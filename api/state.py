"""What every handler needs, built once by the app's lifespan (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from api.auth import Authenticator
from api.catalog import Catalog
from api.store import JobStore
from shared.settings import Settings

__all__ = ["AppState"]


@dataclass(frozen=True)
class AppState:
    settings: Settings
    redis: Redis
    store: JobStore
    catalog: Catalog
    auth: Authenticator
