"""The Starlette application factory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from starlette.applications import Starlette

from api.auth import Authenticator
from api.catalog import Catalog, load_manifests
from api.errors import exception_handlers
from api.playground import playground_routes
from api.routes import routes
from api.state import AppState
from api.store import JobStore
from shared.errors import ConfigError
from shared.paths import profiles_dir
from shared.settings import Settings

__all__ = ["create_app"]


def create_app(settings: Settings) -> Starlette:
    if not settings.api_token:
        raise ConfigError("EXECUTOR_API_TOKEN must be set")
    if not settings.pusher_secret:
        raise ConfigError("PUSHER_SECRET must be set")
    manifests = load_manifests(profiles_dir(settings))
    if not manifests:
        raise ConfigError(f"no language manifests found in {profiles_dir(settings) / 'languages'}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = Redis.from_url(settings.redis_url, health_check_interval=30)
        store = JobStore(redis, settings.job_record_ttl_s)
        app.state.coderunner = AppState(
            settings=settings,
            redis=redis,
            store=store,
            catalog=Catalog(manifests, store),
            auth=Authenticator(settings),
        )
        try:
            yield
        finally:
            await redis.aclose()

    return Starlette(
        routes=[*routes, *playground_routes()],
        exception_handlers=exception_handlers,
        lifespan=lifespan,
    )
