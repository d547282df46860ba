"""Settings: one frozen Struct, read once from an environment mapping at an entry point.

Names follow the seed product where it has one (``REDIS_URL``, ``EXECUTOR_API_TOKEN``,
``WORKER_MAX_SANDBOXES``, ``WORKER_WARMUP_MS``, ``MAX_QUEUE_DEPTH``, ``RUN_RESULT_TTL``,
``PUSHER_*``). Every parse error names the variable.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import msgspec

from shared.errors import ConfigError
from shared.limits import DEFAULT_MAXIMA, Limits

__all__ = ["ENV_NAMES", "JOB_CANCEL_WAIT_S", "Settings", "load_settings", "parse_port", "worker_stop_s"]


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    redis_url: str = "redis://127.0.0.1:6379/0"
    api_token: str = ""
    # When set, GET /metrics wants it as a bearer token (else /metrics is open, like /health).
    metrics_token: str = ""
    job_token_secret: str = ""
    job_token_ttl_s: int = 3600

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # Web origins whose pages may call the API from a browser (CORS), or ("*",) for any:
    # an IDE served from its own origin, holding a job token. Empty: same-origin pages only.
    cors_allow_origins: tuple[str, ...] = ()
    max_queue_depth: int = 256
    # Jobs one API principal may have submitted but not started (queued or parked), so one
    # client cannot take every claim of the fleet.
    max_parked_per_principal: int = 500
    # What those jobs' stored specs (their inline files and stdin) may hold in Redis together;
    # a job alone is always let in.
    max_unstarted_input_mb: int = 256
    # Output (logs and pullable copies) one principal's finished jobs may keep in Redis
    # before its next job is refused (a 429 until some expire).
    max_retained_output_mb: int = 1024
    max_request_bytes: int = 16 * 1024 * 1024
    # What the big execute bodies (over 256 KiB) one API process is receiving or handling
    # may hold at once; past it the next is a 503 with retryAfterMs.
    max_bodies_in_flight_mb: int = 256
    # What the smaller bodies (up to 256 KiB) being received at once may hold together, so
    # thousands of connections each trickling one in cannot take the process's memory.
    max_small_bodies_in_flight_mb: int = 64
    max_files_bytes: int = 8 * 1024 * 1024
    # Uploaded blobs (`files[].ref`, the seed SDK's executeFiles for big binaries): how long
    # one lives in Redis after its upload or last use, and how many bytes and blobs one
    # principal may keep there at once.
    blob_ttl_s: int = 24 * 3600
    # The API's address as clients reach it (https://runner.example.com), for the upload
    # links it hands out; unset, the scheme and host of the request asking for one.
    public_api_url: str = ""
    max_blob_storage_mb: int = 256
    # Blob uploads under way at once per API process (each holds its body in memory).
    max_blob_uploads: int = 4
    max_blobs_per_principal: int = 1000
    # Server maxima for every request limit (env MAX_WALL_TIME_MS, MAX_MEMORY_MB, ...).
    limit_maxima: Limits = DEFAULT_MAXIMA
    queue_retry_after_ms: int = 1000
    # Open GET /v1/jobs/:id/events streams per API process (each holds a Redis connection).
    max_event_streams: int = 256
    # Of those, at most this many for one job, and for one caller (the API token holder, or
    # one job token), counted per API process, so no caller can hold the whole pool.
    max_event_streams_per_job: int = 4
    max_event_streams_per_principal: int = 32
    # Events the streams of one owner's jobs (its token and every job token) send together a
    # second, after a burst of as many, per API process (one API token: all of them): a
    # replay costs the API ~10 us an event, whatever the client does with it.
    max_event_rate: int = 20000
    # Artifact downloads under way at once per API process, and for one job.
    max_artifact_downloads: int = 64
    max_artifact_downloads_per_job: int = 8
    # Waiting GET /v1/jobs/:id/output?waitMs requests per API process (each blocks on a
    # connection of its own pool, apart from the event streams'), and per caller.
    max_output_waits: int = 256
    max_output_waits_per_principal: int = 64
    # Slow clients: a request's headers must arrive within the first timeout (from its
    # first byte, or from the connection's opening), its body within the second (from the
    # end of its headers).
    api_header_timeout_ms: int = 10000
    api_body_timeout_ms: int = 30000
    # A client that takes none of a response the server cannot buffer for this long is dropped.
    api_send_timeout_ms: int = 30000
    # On SIGTERM/SIGINT: result waits and event streams end at once (a 503 to retry, an
    # EventSource reconnects); other requests under way get this long before they are cut.
    api_shutdown_grace_ms: int = 10000
    # Open connections per API process (event streams, output waits and idle keep-alive
    # connections included); one past it gets a 503 and is closed unread.
    api_max_connections: int = 2048
    # Interactive stdin caps per job (the seed product's): frames per second, and bytes
    # accepted but not yet written to the program.
    stdin_max_frames_per_s: int = 30
    stdin_max_pending_bytes: int = 64 * 1024

    pusher_host: str = "127.0.0.1"
    pusher_port: int = 6001
    pusher_scheme: str = "http"
    pusher_app_id: str = "1"
    pusher_key: str = "coderunner-key"
    pusher_secret: str = ""
    # What browsers connect to; defaults to the server-side address.
    pusher_ws_host: str = ""
    pusher_ws_port: int = 0
    # "http" or "https" for browsers (forceTLS); "" is PUSHER_SCHEME. TLS often ends at an
    # edge in front of soketi, while the API and workers reach soketi in plain HTTP.
    pusher_ws_scheme: str = ""
    pusher_timeout_ms: int = 2000
    # How often each API process publishes results other processes owed and did not send,
    # and marks followed job channels soketi's webhook never told it of (api/sweeper.py); 0: never.
    realtime_sweep_ms: int = 2000
    # soketi's largest event payload (its SOKETI_DEFAULT_APP_MAX_EVENT_PAYLOAD_IN_KB); every
    # published event is kept under it.
    pusher_max_payload_kb: int = 100
    # How workers hand live events to soketi: "http", the Pusher HTTP API (any Pusher-protocol
    # server), or "redis", a PUBLISH on the channel of soketi's Redis adapter in this Redis
    # (for a soketi started with SOKETI_ADAPTER_DRIVER=redis on it: one hop less per event).
    pusher_publish: str = "http"
    # soketi's SOKETI_ADAPTER_REDIS_PREFIX, if it has one.
    pusher_redis_prefix: str = ""

    worker_id: str = ""
    worker_max_sandboxes: int = 8
    # Parked (claimed, not started) jobs one worker holds at most; they hold no sandbox.
    worker_max_parked: int = 1000
    # Warm jails hold a language's runtime already started (manifests' `prestart`): the
    # language of the slot's last job, or this one before any job ("" = none before the
    # first job, "off" = never).
    worker_prestart: str = "python"
    worker_warmup_ms: int = 30000
    # A test batch's whole time, from its first case: past it, the cases still running are
    # stopped and the rest skipped (the job ends timed_out), so one batch of many slow cases
    # cannot hold a worker's sandboxes for hours.
    worker_batch_wall_ms: int = 600000
    worker_heartbeat_ms: int = 2000
    worker_lease_ttl_ms: int = 10000
    worker_shutdown_grace_ms: int = 10000
    run_result_ttl_s: int = 600
    job_record_ttl_s: int = 86400

    sandbox_profiles_dir: str = ""
    sandbox_work_root: str = "/run/coderunner"
    # Where a worker keeps what it compiles at start-up (its C helpers, the prestart shims)
    # for the next deployment on the host or the next boot; "" keeps nothing.
    sandbox_build_cache: str = "/var/cache/coderunner"
    sandbox_cgroup_name: str = "coderunner"
    sandbox_uid_base: int = 61000
    # The memory all of this deployment's jails may use together (its cgroup's ceiling), so
    # that jobs at their limits can only OOM one another, never Redis, the API or the
    # worker. 0: the host's memory less a reserve (1/8 of it, at least 1 GiB).
    sandbox_memory_total_mb: int = 0
    # Where the worker reads the mount table to find cgroup hierarchies (tests point it at
    # a fabricated table to exercise the refusal path).
    sandbox_mounts_file: str = "/proc/self/mounts"
    sandbox_swaps_file: str = "/proc/swaps"
    nsjail_path: str = ""
    # Fork each jail's nsjail from the fork server built next to nsjail (nsjail-forkserver,
    # scripts/build-nsjail.sh), when there is one; off: exec nsjail for every jail.
    nsjail_forkserver: bool = True

    # Callbacks (`callbackUrl`): results are POSTed signed with this secret (HMAC-SHA256);
    # without one, a request with a callbackUrl is refused (503) and workers send nothing.
    callback_secret: str = ""
    # Plain http callback URLs, and callbacks to loopback, private and CGNAT addresses, are
    # refused unless these allow them (development and tests; see shared/callbacks.py).
    callback_allow_http: bool = False
    callback_allow_private: bool = False
    # One attempt: connecting, then the whole attempt (resolution, request, response).
    callback_connect_timeout_ms: int = 3000
    callback_timeout_ms: int = 10000
    # Failed attempts are retried after CALLBACK_BACKOFF_MS, doubling up to
    # CALLBACK_BACKOFF_MAX_MS, for at most CALLBACK_RETRY_FOR_S after the job ended (and never
    # past RUN_RESULT_TTL: the result must still be there to send).
    callback_backoff_ms: int = 1000
    callback_backoff_max_ms: int = 60000
    callback_retry_for_s: int = 300
    # Deliveries one worker process sends at once.
    callback_concurrency: int = 16
    # Deliveries to one receiver (host and port) in flight at once, across every worker
    # (0: no bound). One receiver that never answers then holds this many attempts, not
    # every worker's every slot; the rest wait for one of its attempts to end.
    callback_max_per_host: int = 8

    log_level: str = "INFO"

    @property
    def realtime_host(self) -> str:
        return self.pusher_ws_host or self.pusher_host

    @property
    def realtime_port(self) -> int:
        return self.pusher_ws_port or self.pusher_port

    @property
    def realtime_tls(self) -> bool:
        return (self.pusher_ws_scheme or self.pusher_scheme) == "https"

    @property
    def callback_window_s(self) -> int:
        """How long after a job ends its callback is retried (within RUN_RESULT_TTL)."""
        return min(self.callback_retry_for_s, self.run_result_ttl_s)


# Environment variable -> (field, parser). Parsers raise ValueError with a short reason.
# Longer numbers are refused: nothing here needs them, and Redis refuses a TTL past its
# clock's range (as "invalid expire time", on every request) where 10**16 seconds would be.
_MAX_DIGITS = 12


def _int(raw: str) -> int:
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    # (int() also takes "1_000" and other scripts' digits, which no one means here.)
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError("must be an integer (ASCII digits)")
    if len(digits.lstrip("0")) > _MAX_DIGITS:
        raise ValueError(f"must have at most {_MAX_DIGITS} digits")
    return int(text, 10)


def _positive_int(raw: str) -> int:
    value = _int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


# What JOB_RECORD_TTL must give a job beyond its warm-up and longest run.
_RECORD_SLACK_MS = 300_000
# Job tokens carry their expiry in at most 12 digits (shared/tokens.py); the other TTLs get
# the same ceiling.
_MAX_JOB_TOKEN_TTL_S = 10 * 365 * 86400

# How long a stopping worker waits for the jobs it cancels past WORKER_SHUTDOWN_GRACE_MS to
# write their results.
JOB_CANCEL_WAIT_S = 10.0


def worker_stop_s(worker_shutdown_grace_ms: int) -> float:
    """How long to give a stopping worker before SIGKILL (a supervisor's stop timeout): its
    grace for running jobs, the wait for the ones it then cancels, and a few seconds to hand
    jobs back and leave the fleet. Killed sooner, the jobs it was ending get no result (they
    end `lost` when another worker reaps them)."""
    return worker_shutdown_grace_ms / 1000 + JOB_CANCEL_WAIT_S + 5.0
# The stdin route reads bodies of at most 512 KiB (api/routes.py): room for this as base64.
_MAX_STDIN_PENDING_BYTES = 384 * 1024 - 1024


def parse_port(raw: str) -> int:
    """A TCP port, as API_PORT takes it (ValueError saying why not)."""
    value = _int(raw)
    if not 0 < value < 65536:
        raise ValueError("must be a TCP port (1 to 65535)")
    return value


def _non_negative_int(raw: str) -> int:
    value = _int(raw)
    if value < 0:
        raise ValueError("must be 0 or a positive integer")
    return value


def _str(raw: str) -> str:
    return raw


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    level = "WARNING" if level == "WARN" else level
    if level not in _LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(_LOG_LEVELS)}")
    return level


def _redis_url(raw: str) -> str:
    url = raw.strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here, as the client would later)
    except ValueError:
        # (A password with a `/` or `?` in it ends the host part early: percent-encode it.)
        raise ValueError("has a port that is not a number (percent-encode a password holding / ? # or @)") from None
    path = parts.path.lstrip("/")
    if parts.scheme != "unix" and path and not path.isdigit():
        raise ValueError("must name its database by number (redis://host:6379/0)")
    return url


# Settings whose value an error names but never shows.
_NOT_SHOWN = frozenset({"REDIS_URL"})

_ORIGIN = re.compile(r"https?://(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?", re.I)


def _origins(raw: str) -> tuple[str, ...]:
    """Comma-separated web origins (`https://ide.example.com`, no path), or `*` alone."""
    origins = tuple(part.strip() for part in raw.split(",") if part.strip())
    if origins == ("*",):
        return origins
    normal = []
    for origin in origins:
        if origin == "*":
            raise ValueError("'*' stands alone (any origin), not in a list")
        if not _ORIGIN.fullmatch(origin):
            raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], no path or trailing slash)")
        # As browsers send it: lower case, without the scheme's default port.
        origin = origin.lower()
        for default in ("http://", ":80"), ("https://", ":443"):
            if origin.startswith(default[0]) and origin.endswith(default[1]):
                origin = origin[: -len(default[1])]
        normal.append(origin)
    return tuple(normal)


def _public_url(raw: str) -> str:
    """An http(s) URL where clients reach the API (a path prefix allowed; no query)."""
    url = raw.strip().rstrip("/")
    if not url:
        return ""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(f"{raw!r} is not an http(s) URL such as https://runner.example.com (no query or credentials)")
    return url


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 1/true/yes/on or 0/false/no/off")


ENV_NAMES: dict[str, tuple[str, Any]] = {
    "REDIS_URL": ("redis_url", _redis_url),
    "EXECUTOR_API_TOKEN": ("api_token", _str),
    "METRICS_TOKEN": ("metrics_token", _str),
    "JOB_TOKEN_SECRET": ("job_token_secret", _str),
    "JOB_TOKEN_TTL": ("job_token_ttl_s", _positive_int),
    "API_HOST": ("api_host", _str),
    "API_PORT": ("api_port", parse_port),
    "CORS_ALLOW_ORIGINS": ("cors_allow_origins", _origins),
    "MAX_QUEUE_DEPTH": ("max_queue_depth", _positive_int),
    "MAX_PARKED_PER_PRINCIPAL": ("max_parked_per_principal", _positive_int),
    "MAX_UNSTARTED_INPUT_MB": ("max_unstarted_input_mb", _positive_int),
    "MAX_RETAINED_OUTPUT_MB": ("max_retained_output_mb", _positive_int),
    "MAX_REQUEST_BYTES": ("max_request_bytes", _positive_int),
    "MAX_BODIES_IN_FLIGHT_MB": ("max_bodies_in_flight_mb", _positive_int),
    "MAX_SMALL_BODIES_IN_FLIGHT_MB": ("max_small_bodies_in_flight_mb", _positive_int),
    "MAX_FILES_BYTES": ("max_files_bytes", _positive_int),
    "BLOB_TTL_S": ("blob_ttl_s", _positive_int),
    "PUBLIC_API_URL": ("public_api_url", _public_url),
    "MAX_BLOB_UPLOADS": ("max_blob_uploads", _positive_int),
    "MAX_BLOB_STORAGE_MB": ("max_blob_storage_mb", _positive_int),
    "MAX_BLOBS_PER_PRINCIPAL": ("max_blobs_per_principal", _positive_int),
    "MAX_EVENT_STREAMS": ("max_event_streams", _positive_int),
    "MAX_EVENT_STREAMS_PER_JOB": ("max_event_streams_per_job", _positive_int),
    "MAX_EVENT_STREAMS_PER_PRINCIPAL": ("max_event_streams_per_principal", _positive_int),
    "MAX_EVENT_RATE": ("max_event_rate", _positive_int),
    "MAX_ARTIFACT_DOWNLOADS": ("max_artifact_downloads", _positive_int),
    "MAX_ARTIFACT_DOWNLOADS_PER_JOB": ("max_artifact_downloads_per_job", _positive_int),
    "MAX_OUTPUT_WAITS": ("max_output_waits", _positive_int),
    "MAX_OUTPUT_WAITS_PER_PRINCIPAL": ("max_output_waits_per_principal", _positive_int),
    "API_HEADER_TIMEOUT_MS": ("api_header_timeout_ms", _positive_int),
    "API_BODY_TIMEOUT_MS": ("api_body_timeout_ms", _positive_int),
    "API_SEND_TIMEOUT_MS": ("api_send_timeout_ms", _positive_int),
    "API_SHUTDOWN_GRACE_MS": ("api_shutdown_grace_ms", _positive_int),
    "API_MAX_CONNECTIONS": ("api_max_connections", _positive_int),
    "STDIN_MAX_FRAMES_PER_S": ("stdin_max_frames_per_s", _positive_int),
    "STDIN_MAX_PENDING_BYTES": ("stdin_max_pending_bytes", _positive_int),
    "PUSHER_HOST": ("pusher_host", _str),
    "PUSHER_PORT": ("pusher_port", parse_port),
    "PUSHER_SCHEME": ("pusher_scheme", _str),
    "PUSHER_APP_ID": ("pusher_app_id", _str),
    "PUSHER_KEY": ("pusher_key", _str),
    "PUSHER_SECRET": ("pusher_secret", _str),
    "PUSHER_WS_HOST": ("pusher_ws_host", _str),
    "PUSHER_WS_PORT": ("pusher_ws_port", parse_port),
    "PUSHER_WS_SCHEME": ("pusher_ws_scheme", _str),
    "PUSHER_TIMEOUT_MS": ("pusher_timeout_ms", _positive_int),
    "REALTIME_SWEEP_MS": ("realtime_sweep_ms", _non_negative_int),
    "PUSHER_MAX_PAYLOAD_KB": ("pusher_max_payload_kb", _positive_int),
    "PUSHER_PUBLISH": ("pusher_publish", _str),
    "PUSHER_REDIS_PREFIX": ("pusher_redis_prefix", _str),
    "WORKER_ID": ("worker_id", _str),
    "WORKER_MAX_SANDBOXES": ("worker_max_sandboxes", _positive_int),
    "WORKER_MAX_PARKED": ("worker_max_parked", _positive_int),
    "WORKER_PRESTART": ("worker_prestart", _str),
    "WORKER_WARMUP_MS": ("worker_warmup_ms", _positive_int),
    "WORKER_BATCH_WALL_MS": ("worker_batch_wall_ms", _positive_int),
    "WORKER_HEARTBEAT_MS": ("worker_heartbeat_ms", _positive_int),
    "WORKER_LEASE_TTL_MS": ("worker_lease_ttl_ms", _positive_int),
    "WORKER_SHUTDOWN_GRACE_MS": ("worker_shutdown_grace_ms", _positive_int),
    "RUN_RESULT_TTL": ("run_result_ttl_s", _positive_int),
    "JOB_RECORD_TTL": ("job_record_ttl_s", _positive_int),
    "SANDBOX_PROFILES_DIR": ("sandbox_profiles_dir", _str),
    "SANDBOX_WORK_ROOT": ("sandbox_work_root", _str),
    "SANDBOX_BUILD_CACHE": ("sandbox_build_cache", _str),
    "SANDBOX_CGROUP_NAME": ("sandbox_cgroup_name", _str),
    "SANDBOX_UID_BASE": ("sandbox_uid_base", _positive_int),
    "SANDBOX_MEMORY_TOTAL_MB": ("sandbox_memory_total_mb", _non_negative_int),
    "SANDBOX_MOUNTS_FILE": ("sandbox_mounts_file", _str),
    "SANDBOX_SWAPS_FILE": ("sandbox_swaps_file", _str),
    "NSJAIL_PATH": ("nsjail_path", _str),
    "NSJAIL_FORKSERVER": ("nsjail_forkserver", _bool),
    "CALLBACK_SECRET": ("callback_secret", _str),
    "CALLBACK_ALLOW_HTTP": ("callback_allow_http", _bool),
    "CALLBACK_ALLOW_PRIVATE": ("callback_allow_private", _bool),
    "CALLBACK_CONNECT_TIMEOUT_MS": ("callback_connect_timeout_ms", _positive_int),
    "CALLBACK_TIMEOUT_MS": ("callback_timeout_ms", _positive_int),
    "CALLBACK_BACKOFF_MS": ("callback_backoff_ms", _positive_int),
    "CALLBACK_BACKOFF_MAX_MS": ("callback_backoff_max_ms", _positive_int),
    "CALLBACK_RETRY_FOR_S": ("callback_retry_for_s", _positive_int),
    "CALLBACK_CONCURRENCY": ("callback_concurrency", _positive_int),
    "CALLBACK_MAX_PER_HOST": ("callback_max_per_host", _non_negative_int),
    "LOG_LEVEL": ("log_level", _log_level),
}


# Variables whose empty value means something (else empty is the same as unset).
_EMPTY_IS_A_VALUE = {"WORKER_PRESTART"}  # no prestarted runtime until a job names a language
# The smallest maximum an operator may set: below it no job (and no default) could run.
_LEAST_MAXIMA = {"memory_mb": 16}


def maximum_env_name(field: str) -> str:
    """The variable that sets a limit's maximum: MAX_WALL_TIME_MS, …, MAX_ARTIFACTS."""
    return field.upper() if field.startswith("max_") else "MAX_" + field.upper()


def load_settings(environ: Mapping[str, str], **overrides: Any) -> Settings:
    """Build Settings from an environment mapping (and explicit overrides).

    Raises:
        ConfigError: naming the variable that could not be parsed or is inconsistent.
    """
    values: dict[str, Any] = {}
    for env_name, (field, parse) in ENV_NAMES.items():
        raw = environ.get(env_name)
        if raw is None or (raw == "" and env_name not in _EMPTY_IS_A_VALUE):
            continue
        try:
            values[field] = parse(raw)
        except ValueError as exc:
            # (REDIS_URL may hold a password: an error on the terminal or in a log never shows it.)
            shown = f"{env_name} (its value not shown)" if env_name in _NOT_SHOWN else f"{env_name}={raw!r}"
            raise ConfigError(f"{shown} is invalid: {exc}") from None
    maxima: dict[str, int] = {}
    for field in Limits.__struct_fields__:
        env_name = maximum_env_name(field)
        raw = environ.get(env_name)
        if raw:
            try:
                # Artifacts may be turned off (0); every other limit needs room to run at all.
                maxima[field] = _int(raw) if field.startswith("max_") else _positive_int(raw)
                least = _LEAST_MAXIMA.get(field, 0)
                if maxima[field] < least:
                    raise ValueError(f"must be at least {least}")
            except ValueError as exc:
                raise ConfigError(f"{env_name}={raw!r} is invalid: {exc}") from None
    if maxima:
        values["limit_maxima"] = msgspec.structs.replace(DEFAULT_MAXIMA, **maxima)
    values.update(overrides)
    settings = Settings(**values)
    if settings.pusher_scheme not in ("http", "https"):
        raise ConfigError("PUSHER_SCHEME must be 'http' or 'https'")
    if settings.pusher_ws_scheme not in ("", "http", "https"):
        raise ConfigError("PUSHER_WS_SCHEME must be 'http' or 'https'")
    if settings.pusher_publish not in ("http", "redis"):
        raise ConfigError("PUSHER_PUBLISH must be 'http' or 'redis'")
    if settings.pusher_max_payload_kb < 64:
        # An 8 KiB output chunk can take six times that as JSON.
        raise ConfigError("PUSHER_MAX_PAYLOAD_KB must be at least 64 (soketi's default is 100)")
    if not (settings.pusher_app_id.isascii() and settings.pusher_app_id.isdigit()):
        raise ConfigError("PUSHER_APP_ID must be numeric (Pusher clients require it)")
    if settings.worker_lease_ttl_ms < 3 * settings.worker_heartbeat_ms:
        # A live worker renews about once an interval; a shorter lease lapses on one late beat,
        # and a Redis stall that lapses leases could then hide between two beats (worker/
        # messaging/continuity.py).
        raise ConfigError(
            f"WORKER_LEASE_TTL_MS ({settings.worker_lease_ttl_ms}) must be at least three times "
            f"WORKER_HEARTBEAT_MS ({settings.worker_heartbeat_ms})"
        )
    if settings.max_bodies_in_flight_mb * 1024 * 1024 < settings.max_request_bytes:
        # Else the biggest request allowed could never be received.
        raise ConfigError(
            f"MAX_BODIES_IN_FLIGHT_MB ({settings.max_bodies_in_flight_mb}) must hold at least one request of "
            f"MAX_REQUEST_BYTES ({settings.max_request_bytes})"
        )
    if settings.max_event_streams_per_principal >= settings.max_event_streams:
        raise ConfigError(
            f"MAX_EVENT_STREAMS_PER_PRINCIPAL ({settings.max_event_streams_per_principal}) must be smaller than "
            f"MAX_EVENT_STREAMS ({settings.max_event_streams}), so one caller cannot hold every event stream"
        )
    if settings.api_max_connections <= settings.max_event_streams + settings.max_output_waits:
        # Else the streams and waits the API admits could take every connection.
        raise ConfigError(
            f"API_MAX_CONNECTIONS ({settings.api_max_connections}) must be larger than MAX_EVENT_STREAMS "
            f"({settings.max_event_streams}) and MAX_OUTPUT_WAITS ({settings.max_output_waits}) together"
        )
    if settings.max_output_waits_per_principal >= settings.max_output_waits:
        raise ConfigError(
            f"MAX_OUTPUT_WAITS_PER_PRINCIPAL ({settings.max_output_waits_per_principal}) must be smaller than "
            f"MAX_OUTPUT_WAITS ({settings.max_output_waits}), so one caller cannot hold every wait"
        )
    if settings.callback_secret and len(settings.callback_secret) < 16:
        raise ConfigError("CALLBACK_SECRET must be at least 16 characters (receivers verify signatures with it)")
    if settings.callback_connect_timeout_ms > settings.callback_timeout_ms:
        raise ConfigError("CALLBACK_CONNECT_TIMEOUT_MS must not be larger than CALLBACK_TIMEOUT_MS")
    if settings.callback_backoff_ms > settings.callback_backoff_max_ms:
        raise ConfigError("CALLBACK_BACKOFF_MS must not be larger than CALLBACK_BACKOFF_MAX_MS")
    if settings.max_artifact_downloads_per_job >= settings.max_artifact_downloads:
        raise ConfigError(
            f"MAX_ARTIFACT_DOWNLOADS_PER_JOB ({settings.max_artifact_downloads_per_job}) must be smaller than "
            f"MAX_ARTIFACT_DOWNLOADS ({settings.max_artifact_downloads}), so one link cannot hold every download"
        )
    # A job's record is written once, at submit, and must outlive the job: its warm-up, then
    # its longest run (a batch's budget, or the wall maximum), plus a compile and some slack.
    longest_ms = settings.worker_warmup_ms + max(settings.limit_maxima.wall_time_ms, settings.worker_batch_wall_ms)
    if settings.job_record_ttl_s * 1000 < longest_ms + _RECORD_SLACK_MS:
        raise ConfigError(
            f"JOB_RECORD_TTL ({settings.job_record_ttl_s} s) must be at least "
            f"{-(-(longest_ms + _RECORD_SLACK_MS) // 1000)} s: WORKER_WARMUP_MS, the longer of MAX_WALL_TIME_MS and "
            "WORKER_BATCH_WALL_MS, and 5 minutes more (a job whose record expires mid-run loses its result)"
        )
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", settings.sandbox_cgroup_name) or settings.sandbox_cgroup_name == "init":
        # One folder at the top of each hierarchy (v2 enables controllers level by level:
        # a nested name would need them in folders it does not make); `init` is where a
        # container's own processes are moved on v2.
        raise ConfigError("SANDBOX_CGROUP_NAME must be one folder name (letters, digits, _ . -), not 'init'")
    for env_name, ttl_s in (
        ("JOB_TOKEN_TTL", settings.job_token_ttl_s),
        ("RUN_RESULT_TTL", settings.run_result_ttl_s),
        ("JOB_RECORD_TTL", settings.job_record_ttl_s),
        ("BLOB_TTL_S", settings.blob_ttl_s),
    ):
        if ttl_s > _MAX_JOB_TOKEN_TTL_S:
            raise ConfigError(f"{env_name} must be at most {_MAX_JOB_TOKEN_TTL_S} (ten years)")
    if settings.stdin_max_pending_bytes > _MAX_STDIN_PENDING_BYTES:
        # A frame may carry that much; as base64 in a JSON body it must fit the stdin body's bound.
        raise ConfigError(f"STDIN_MAX_PENDING_BYTES must be at most {_MAX_STDIN_PENDING_BYTES} (one frame's bytes as base64 in a 512 KiB body)")
    return settings
