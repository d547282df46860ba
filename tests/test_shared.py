"""Unit tests of the pure wire-contract package (no I/O, no services)."""

from __future__ import annotations

import ast
import base64
import hashlib
import hmac
import json
import logging
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.chunking import Utf8Chunker, split_utf8
from shared.codec import decode_request, encode
from shared.errors import ConfigError, ValidationError
from shared.limits import DEFAULT_LIMITS, DEFAULT_MAXIMA, RequestedLimits, resolve_limits, with_overrides
from shared.manifest import compiled_shim_name, expand_argv, names_compiled_shim, parse_manifest, with_home
from shared.messages import ExecuteRequest, FileSpec, JobSpec, RealtimeInfo, ResultEvent
from shared.paths import REPO_ROOT
from shared.pusher import channel_auth, signed_query, valid_socket_id
from shared.settings import load_settings
from shared.tokens import mint_job_token, verify_job_token
from shared.validation import check_file_name, decode_files, file_refs

# ------------------------------------------------------------------ chunking


@given(st.lists(st.binary(max_size=300), max_size=40), st.integers(min_value=4, max_value=64))
def test_chunker_never_splits_characters_and_respects_size(pieces: list[bytes], size: int) -> None:
    chunker = Utf8Chunker(max_bytes=size)
    out = [c for piece in pieces for c in chunker.feed(piece)] + chunker.flush()
    assert all(0 < len(c.encode("utf-8")) <= size for c in out)
    whole = b"".join(pieces)
    assert "".join(out) == whole.decode("utf-8", "replace") or _equivalent_replacement("".join(out), whole)


def _equivalent_replacement(text: str, raw: bytes) -> bool:
    # Read boundaries may change how many U+FFFD an invalid run becomes; valid text must match.
    return text.replace("\ufffd", "") == raw.decode("utf-8", "replace").replace("\ufffd", "")


@given(st.text(max_size=2000))
def test_valid_text_round_trips_exactly_across_any_split(text: str) -> None:
    data = text.encode("utf-8")
    for cut in (1, 2, 3, 7, 8192):
        chunker = Utf8Chunker()
        out = [c for i in range(0, len(data), cut) for c in chunker.feed(data[i : i + cut])] + chunker.flush()
        assert "".join(out) == text


def test_split_utf8_keeps_multibyte_whole() -> None:
    text = "é" * 5000  # 10000 bytes
    parts = split_utf8(text, 8192)
    assert [len(p.encode()) for p in parts] == [8192, 1808]
    assert "".join(parts) == text


def test_nul_and_invalid_bytes_do_not_break_the_stream() -> None:
    chunker = Utf8Chunker()
    assert chunker.feed(b"a\x00b\xff\xfec") == ["a\x00b\ufffd\ufffdc"]
    assert chunker.feed(b"\xe2\x82") == []  # half of a euro sign is held back
    assert chunker.feed(b"\xac!") == ["€!"]
    assert chunker.feed(b"\xe2") == [] and chunker.flush() == ["\ufffd"]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "name",
    ["../../etc/passwd", "/etc/cron.d/job", "a/../../x", "..", ".", "", "a\x00b", "line\nbreak", "-o/tmp/pwn.c",
     "--help", "@opts", "x" * 5000, "dir/", "a//../../b", "\u202egnp.py", "main.py\r", "main.py/.", "a\\b"],
)  # fmt: skip
def test_hostile_names_are_refused(name: str) -> None:
    assert check_file_name(name) is not None


@pytest.mark.parametrize(
    "name", ["main.py", "src/lib/util.rs", "Main.java", "données.txt", "a-b_c.d", "node_modules/@scope/x.js"]
)
def test_ordinary_names_pass(name: str) -> None:
    assert check_file_name(name) is None


def test_decode_files_checks_everything() -> None:
    ok = decode_files([FileSpec(name="a.py", content="é"), FileSpec(name="d/b.bin", content="AAE=", encoding="base64")], 100)
    assert ok == [("a.py", "é".encode()), ("d/b.bin", b"\x00\x01")]
    for files, field in [
        ([FileSpec(name="a", content="x"), FileSpec(name="a", content="y")], "files[1].name"),
        ([FileSpec(name="a", content="x"), FileSpec(name="a/b", content="y")], "files[1].name"),
        ([FileSpec(name="a/b", content="x"), FileSpec(name="a", content="y")], "files[1].name"),
        ([FileSpec(name="a", content="x" * 101)], "files"),
        ([FileSpec(name="a", content="é"), FileSpec(name="b", content="x\ud800")], "files[1].content"),
        ([FileSpec(name="a", content="QQ=", encoding="base64")], "files[0].content"),
    ]:
        with pytest.raises(ValidationError) as info:
            decode_files(files, 100)
        assert info.value.details[0].field == field


# ------------------------------------------------------------------ limits


def test_limits_resolution() -> None:
    defaults = with_overrides(DEFAULT_LIMITS, RequestedLimits(memory_mb=256))
    assert defaults.memory_mb == 256 and defaults.wall_time_ms == 30000
    limits = resolve_limits(RequestedLimits(cpu_ms=500, wall_time_ms=120000), defaults, DEFAULT_MAXIMA)
    assert (limits.cpu_ms, limits.wall_time_ms, limits.memory_mb) == (500, 120000, 256)
    with pytest.raises(ValidationError) as info:
        resolve_limits(RequestedLimits(memory_mb=10**6, pids=10**6), defaults, DEFAULT_MAXIMA)
    assert [d.field for d in info.value.details] == ["limits.memoryMb", "limits.pids"]
    assert info.value.sentence == f"limits.memoryMb must be at most {DEFAULT_MAXIMA.memory_mb}"


# ------------------------------------------------------------------ tokens and signing


def test_job_tokens() -> None:
    job = "ab" * 16
    token = mint_job_token("s3cret", job, now_s=1000, ttl_s=60)
    assert verify_job_token("s3cret", token, now_s=1059) == job
    assert verify_job_token("s3cret", token, now_s=1061) is None  # expired
    assert verify_job_token("other", token, now_s=1000) is None  # forged
    tampered = token.replace(job, "cd" * 16)
    assert verify_job_token("s3cret", tampered, now_s=1000) is None
    assert verify_job_token("s3cret", "garbage", now_s=1000) is None
    # One spelling: the expiry padded with a zero is another token (security review).
    job_id, expires, signature = token.split(".")
    assert verify_job_token("s3cret", f"{job_id}.0{expires}.{signature}", now_s=1000) is None


def test_a_job_token_does_not_confirm_a_guess_at_the_api_token() -> None:
    """Without JOB_TOKEN_SECRET the job-token key comes from the API token through scrypt: a
    browser holding a job token cannot check guesses at the API token with one fast hash."""
    from api.auth import Authenticator

    settings = load_settings({"PUSHER_SECRET": "x" * 16, "EXECUTOR_API_TOKEN": "correct-horse-battery"})
    job = "ab" * 16
    token = Authenticator(settings).mint(job)
    fast = hashlib.sha256(b"jobtoken:correct-horse-battery").hexdigest()  # (the old key)
    assert verify_job_token(fast, token, int(time.time())) is None
    # Another API process with the same API token derives the same key.
    again = Authenticator(settings)
    assert verify_job_token(again._secret, token, int(time.time())) == job
    assert Authenticator(load_settings({"PUSHER_SECRET": "x" * 16, "EXECUTOR_API_TOKEN": "y" * 21}))._secret != again._secret


def test_pusher_signatures_match_the_protocol() -> None:
    # Channel auth: HMAC-SHA256 of "socket_id:channel" with the app secret.
    expected = hmac.new(b"sec", b"1234.5678:private-run-x", hashlib.sha256).hexdigest()
    assert channel_auth("key", "sec", "1234.5678", "private-run-x") == f"key:{expected}"
    assert valid_socket_id("1234.5678") and not valid_socket_id("1234.5678:evil")
    # HTTP API: sorted query string, body md5, signature over method/path/query.
    params = signed_query("POST", "/apps/1/events", b'{"a":1}', "key", "sec", 1353088179)
    assert params["body_md5"] == hashlib.md5(b'{"a":1}').hexdigest()
    query = f"auth_key=key&auth_timestamp=1353088179&auth_version=1.0&body_md5={params['body_md5']}"
    assert params["auth_signature"] == hmac.new(b"sec", f"POST\n/apps/1/events\n{query}".encode(), hashlib.sha256).hexdigest()


# ------------------------------------------------------------------ messages and settings


def test_realtime_info_uses_pusher_js_names() -> None:
    data = msgspec.json.decode(encode(RealtimeInfo(key="k", ws_host="h", ws_port=1, force_tls=False)))
    assert data == {"key": "k", "wsHost": "h", "wsPort": 1, "forceTLS": False, "cluster": "mt1"}


def test_result_event_shape_is_the_contract() -> None:
    event = ResultEvent(exit_code=None, signal="SIGKILL", timed_out=True, idle_timed_out=False, truncated=False,
                        duration_ms=1, cpu_ms=2, memory_kb=3, outcome="timed_out", compile=None, seq=7)  # type: ignore[arg-type]  # fmt: skip
    data = msgspec.json.decode(encode(event))
    assert data == {"exitCode": None, "signal": "SIGKILL", "timedOut": True, "idleTimedOut": False, "truncated": False,
                    "durationMs": 1, "cpuMs": 2, "memoryKb": 3, "outcome": "timed_out", "compile": None, "seq": 7}  # fmt: skip


def test_old_job_payload_decodes_in_new_code() -> None:
    # A job queued before fields with defaults were added must still decode.
    old = b'{"jobId":"x","language":"python","version":"3","files":[{"name":"a","content":"b"}],' + (
        b'"limits":' + encode(DEFAULT_LIMITS) + b',"createdAtMs":1}'
    )
    spec = msgspec.json.decode(old, type=JobSpec)
    assert spec.collect_output is False and spec.args == [] and spec.spec_version == 1


def test_request_decoding_names_fields() -> None:
    with pytest.raises(ValidationError) as info:
        decode_request(ExecuteRequest, b'{"language":"python","files":[{"name":"a","content":5}]}')
    assert info.value.sentence == "files[0].content is invalid: Expected `str`, got `int`"
    # A file needs its content or a blob's ref, which only a check after decoding can tell.
    with pytest.raises(ValidationError) as info:
        file_refs(decode_request(ExecuteRequest, b'{"language":"python","files":[{"name":"a"}]}').files)
    assert info.value.sentence == "files[0].content is required (or `ref`, naming an uploaded blob)"
    # An unknown field's name runs to its last backtick; an empty one is named by its object.
    for body, field in [
        (b'{"language":"python","files":[{"name":"a","content":"x"}],"a`b":1}', "a`b"),
        (b'{"language":"python","files":[{"name":"a","content":"x"}],"":1}', "body"),
        (b'{"language":"python","files":[{"name":"a","content":"x","":1}]}', "files[0]"),
    ]:
        with pytest.raises(ValidationError) as info:
            decode_request(ExecuteRequest, body)
        assert info.value.details[0].field == field, info.value.details
    # What the client sent comes back clipped: a 10 MB key or enum value came back twice.
    huge = "k" * (10 << 20)
    for body in [
        b'{"language":"python","files":[{"name":"a","content":"x"}],"%s":1}' % huge.encode(),
        b'{"language":"python","files":[{"name":"a","content":"x"}],"compare":"%s"}' % huge.encode(),
    ]:
        with pytest.raises(ValidationError) as info:
            decode_request(ExecuteRequest, body)
        detail = info.value.details[0]
        assert len(detail.field) <= 201 and len(detail.message) <= 201 and len(info.value.sentence) <= 403, detail
        assert detail.field.startswith(("kkk", "compare"))


def test_settings_errors_name_the_variable() -> None:
    assert load_settings({"WORKER_MAX_SANDBOXES": "3"}).worker_max_sandboxes == 3
    assert load_settings({"MAX_MEMORY_MB": "64"}).limit_maxima.memory_mb == 64
    # Every limit's maximum is read from the variable the README names, artifacts' too.
    maxima = load_settings({"MAX_ARTIFACTS": "5", "MAX_ARTIFACT_BYTES": "0"}).limit_maxima
    assert (maxima.max_artifacts, maxima.max_artifact_bytes) == (5, 0)
    # An empty WORKER_PRESTART is "none until a job names a language", not the default.
    assert load_settings({"WORKER_PRESTART": ""}).worker_prestart == ""
    assert load_settings({"WORKER_MAX_SANDBOXES": ""}).worker_max_sandboxes == 8  # empty is unset elsewhere
    for env, name in [({"WORKER_MAX_SANDBOXES": "lots"}, "WORKER_MAX_SANDBOXES"), ({"PUSHER_APP_ID": "app"}, "PUSHER_APP_ID"),
                      ({"MAX_CPU_MS": "-5"}, "MAX_CPU_MS"), ({"PUSHER_PUBLISH": "soketi"}, "PUSHER_PUBLISH"),
                      ({"MAX_MEMORY_MB": "8"}, "MAX_MEMORY_MB=.*at least 16"), ({"MAX_ARTIFACTS": "-1"}, "MAX_ARTIFACTS")]:  # fmt: skip
        with pytest.raises(ConfigError, match=name):
            load_settings(env)


def test_settings_that_would_misbehave_once_running_are_refused_at_start() -> None:
    refusals = [
        # A record that expires mid-run loses its job's result.
        ({"JOB_RECORD_TTL": "120"}, "JOB_RECORD_TTL .*at least 930 s"),
        ({"JOB_RECORD_TTL": "3600", "WORKER_BATCH_WALL_MS": "3600000"}, "JOB_RECORD_TTL"),
        # One signed link could hold every download slot.
        ({"MAX_ARTIFACT_DOWNLOADS": "4"}, "MAX_ARTIFACT_DOWNLOADS_PER_JOB"),
        ({"MAX_ARTIFACT_DOWNLOADS": "8", "MAX_ARTIFACT_DOWNLOADS_PER_JOB": "8"}, "MAX_ARTIFACT_DOWNLOADS_PER_JOB"),
        # An expiry past 12 digits: every job token would be refused.
        ({"JOB_TOKEN_TTL": "1000000000000"}, "JOB_TOKEN_TTL"),
        # A frame that may wait whole could not be sent in one stdin body.
        ({"STDIN_MAX_PENDING_BYTES": "1000000"}, "STDIN_MAX_PENDING_BYTES"),
        ({"PUSHER_PORT": "70000"}, "PUSHER_PORT"),
        ({"API_PORT": "0"}, "API_PORT"),
        ({"PUSHER_WS_PORT": "65536"}, "PUSHER_WS_PORT"),
        # Review: each of these once started, then failed on every request or crashed later.
        ({"LOG_LEVEL": "verbose"}, "LOG_LEVEL='verbose' is invalid: must be one of DEBUG"),
        ({"RUN_RESULT_TTL": "10000000000000000"}, "RUN_RESULT_TTL=.*at most 12 digits"),
        ({"JOB_RECORD_TTL": "400000000"}, "JOB_RECORD_TTL must be at most 315360000"),
        ({"BLOB_TTL_S": "999999999999"}, "BLOB_TTL_S must be at most"),
        ({"REDIS_URL": "localhost:6379"}, "REDIS_URL .*redis://"),
        # Review: a password holding `/` (openssl rand -base64) cut the host part short: the
        # client failed later, naming no setting. And no error shows the password.
        ({"REDIS_URL": "redis://:ab/cd@redis:6379/0"}, r"^REDIS_URL \(its value not shown\) is invalid: has a port that is not a number"),
        ({"REDIS_URL": "redis://redis:6379/zero"}, "REDIS_URL .*database by number"),
        ({"MAX_QUEUE_DEPTH": "1_000"}, "MAX_QUEUE_DEPTH=.*ASCII digits"),
        ({"MAX_QUEUE_DEPTH": "\u0661\u0662"}, "MAX_QUEUE_DEPTH=.*ASCII digits"),
        ({"PUSHER_APP_ID": "\u0661\u0662"}, "PUSHER_APP_ID must be numeric"),
    ]
    for env, message in refusals:
        with pytest.raises(ConfigError, match=message):
            load_settings(env)
    # uvicorn has no "warn"; the API gets the level logging and uvicorn both know.
    assert load_settings({"LOG_LEVEL": "warn"}).log_level == "WARNING"
    assert load_settings({"LOG_LEVEL": " debug "}).log_level == "DEBUG"
    assert load_settings({"REDIS_URL": "unix:///run/redis.sock"}).redis_url == "unix:///run/redis.sock"
    for fine_url in ("redis://:p%2Fw@redis:6379/0", "rediss://redis", "redis://[::1]:6380/2"):
        assert load_settings({"REDIS_URL": fine_url}).redis_url == fine_url
    assert load_settings({"MAX_QUEUE_DEPTH": "+0010"}).max_queue_depth == 10
    fine = load_settings({"JOB_RECORD_TTL": "930", "STDIN_MAX_PENDING_BYTES": "392192", "JOB_TOKEN_TTL": "315360000"})
    # The biggest frame allowed fits the stdin body as base64 in JSON.
    assert len(json.dumps({"data": base64.b64encode(b"x" * fine.stdin_max_pending_bytes).decode(), "encoding": "base64"})) <= 512 * 1024
    assert verify_job_token("s" * 32, mint_job_token("s" * 32, "a" * 32, 10**9, fine.job_token_ttl_s), 10**9) == "a" * 32


def test_the_api_refuses_secrets_that_could_be_guessed_or_never_sent() -> None:
    # Every job token a browser holds is an HMAC under a key derived from the API token (and
    # every channel signature one under PUSHER_SECRET): a short one is guessed offline.
    from api.app import _check_secrets

    good = {"EXECUTOR_API_TOKEN": "t" * 16, "PUSHER_SECRET": "s" * 16}
    _check_secrets(load_settings(good))
    for change, name in [
        ({"EXECUTOR_API_TOKEN": "changeme"}, "EXECUTOR_API_TOKEN must be at least 16"),
        ({"EXECUTOR_API_TOKEN": ""}, "EXECUTOR_API_TOKEN must be set"),
        ({"PUSHER_SECRET": "x"}, "PUSHER_SECRET must be at least 16"),
        ({"JOB_TOKEN_SECRET": "short"}, "JOB_TOKEN_SECRET"),
        ({"METRICS_TOKEN": "scrape"}, "METRICS_TOKEN"),
        # A bearer token no header can carry: every backend call would be a 401.
        ({"EXECUTOR_API_TOKEN": "t" * 16 + "\n"}, "EXECUTOR_API_TOKEN must be printable ASCII"),
        ({"EXECUTOR_API_TOKEN": "t" * 8 + " " + "t" * 8}, "EXECUTOR_API_TOKEN must be printable ASCII"),
        ({"METRICS_TOKEN": "m" * 16 + "\u00e9"}, "METRICS_TOKEN must be printable ASCII"),
    ]:
        with pytest.raises(ConfigError, match=name):
            _check_secrets(load_settings({**good, **change}))


def test_cors_origins_are_origins() -> None:
    assert load_settings({}).cors_allow_origins == ()
    parsed = load_settings({"CORS_ALLOW_ORIGINS": " https://ide.example.com, http://127.0.0.1:5173,http://[::1]:8080 "})
    assert parsed.cors_allow_origins == ("https://ide.example.com", "http://127.0.0.1:5173", "http://[::1]:8080")
    assert load_settings({"CORS_ALLOW_ORIGINS": "*"}).cors_allow_origins == ("*",)
    # Compared as browsers send them: lower case, no default port.
    written = "HTTPS://IDE.Example.com:443,http://ide.example.com:80,http://ide.example.com:8080"
    assert load_settings({"CORS_ALLOW_ORIGINS": written}).cors_allow_origins == (
        "https://ide.example.com", "http://ide.example.com", "http://ide.example.com:8080"
    )  # fmt: skip
    for bad in ("https://ide.example.com/", "ide.example.com", "https://ide.example.com/app", "*,https://a.example", "ftp://x"):
        with pytest.raises(ConfigError, match="CORS_ALLOW_ORIGINS"):
            load_settings({"CORS_ALLOW_ORIGINS": bad})


# ------------------------------------------------------------------ manifests


def test_every_shipped_manifest_parses() -> None:
    paths = sorted((REPO_ROOT / "sandbox-profiles" / "languages").glob("*.toml"))
    assert paths
    for path in paths:
        manifest = parse_manifest(path.read_text(), str(path))
        assert manifest.run and manifest.version_probe


def test_argv_expansion() -> None:
    argv = expand_argv(["cc", "-o", "main", "{sources}", "-Xmx{heapMb}m", "run:{entry}", "{args}"],
                       entry="a.c", sources=["a.c", "b.c"], args=["x", "y z"], memory_mb=100)  # fmt: skip
    assert argv == ["cc", "-o", "main", "a.c", "b.c", "-Xmx60m", "run:a.c", "x", "y z"]


def test_manifest_errors_name_the_file() -> None:
    with pytest.raises(Exception, match=r"bad\.toml"):
        parse_manifest('language = "x"\nrun = []', "bad.toml")


def test_a_heap_limit_must_say_how_the_runtime_ends() -> None:
    # Its words alone would take any ending (an exit 0 included) for a heap that ran out.
    base = 'language = "x"\nsource_file = "m.x"\nversion_probe = ["x"]\nversion_pattern = "(1)"\nrun = ["x", "{entry}"]\n'
    with pytest.raises(Exception, match=r"h\.toml: heap_limit must name the exit_code or the signal"):
        parse_manifest(base + '[heap_limit]\nmessages = ["out of heap space"]\n', "h.toml")
    assert parse_manifest(base + '[heap_limit]\nmessages = ["out of heap space"]\nexit_code = 3\n', "h.toml").heap_limit


def test_a_prestart_cache_needs_a_shim_another_name_and_known_placeholders() -> None:
    base = 'language = "x"\nsource_file = "m.x"\nversion_probe = ["x"]\nversion_pattern = "(1)"\nrun = ["x", "{entry}"]\n'
    cache = 'prestart_cache = { file = "s.xc", make = ["{home}/x", "{shim}", "{out}", "{inJail}"] }\n'
    manifest = with_home(parse_manifest(base + 'prestart = "s.x"\n' + cache, "c.toml"), "/opt/x")
    assert manifest.prestart_cache is not None
    assert manifest.prestart_cache.make == ["/opt/x/x", "{shim}", "{out}", "{inJail}"]
    with pytest.raises(Exception, match=r"c\.toml: prestart_cache needs a prestart shim"):
        parse_manifest(base + cache, "c.toml")
    with pytest.raises(Exception, match=r"c\.toml: prestart_cache.file must differ"):
        parse_manifest(base + 'prestart = "s.xc"\n' + cache, "c.toml")
    with pytest.raises(Exception, match=r"c\.toml: unknown placeholder \{entry\} in prestart_cache.make"):
        parse_manifest(base + 'prestart = "s.x"\n' + cache.replace("{out}", "{entry}"), "c.toml")
    with pytest.raises(Exception, match=r"c\.toml: .*prestart_cache.file"):
        parse_manifest(base + 'prestart = "s.x"\n' + cache.replace("s.xc", "../s.xc"), "c.toml")


# ------------------------------------------------------------------ boundaries


def _imports(package: str) -> set[str]:
    found: set[str] = set()
    for path in (REPO_ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_shared_does_no_io_and_api_worker_never_meet() -> None:
    assert not _imports("shared") & {"redis", "httpx", "starlette", "uvicorn", "socket", "subprocess", "api", "worker"}
    assert "worker" not in _imports("api")
    assert "api" not in _imports("worker")



def _worker_parts_used_by(part: str) -> set[str]:
    """The worker sub-packages and modules (`isolation`, `job`, `tasks`…) that worker/<part> imports."""
    found: set[str] = set()
    for path in (REPO_ROOT / "worker" / part).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found |= {name.split(".")[1] for name in names if name.startswith("worker.")}
    return found - {part}


def test_worker_layers_point_one_way() -> None:
    # How a jail is built knows nothing of jobs or of Redis and soketi; the wires know
    # nothing of either; a job uses both, never the process around it.
    assert _worker_parts_used_by("isolation") == set()
    # worker/tasks.py (cancelling tasks that may not honour it) is a leaf anyone may use.
    assert _worker_parts_used_by("messaging") <= {"tasks"}
    tasks = ast.parse((REPO_ROOT / "worker" / "tasks.py").read_text())
    assert not [n for n in ast.walk(tasks) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("worker")]
    assert _worker_parts_used_by("job") <= {"isolation", "messaging", "context", "tasks"}


def test_a_job_naming_a_compiled_shims_class_is_found() -> None:
    # Only a compiled shim's class can clash (Java's loads into the job's class loader); an
    # interpreted language's shim is a file outside the job's namespace.
    java = parse_manifest((REPO_ROOT / "sandbox-profiles" / "languages" / "java.toml").read_text(), "java.toml")
    python = parse_manifest((REPO_ROOT / "sandbox-profiles" / "languages" / "python.toml").read_text(), "python.toml")
    assert java.prestart is not None and java.compile is not None
    shim = java.prestart.rpartition(".")[0]
    assert (compiled_shim_name(java), compiled_shim_name(python)) == (shim, None)
    plain = [("Main.java", b"public class Main {}")]
    assert not names_compiled_shim(java, plain)
    assert names_compiled_shim(java, [*plain, ("Util.java", f"class {shim} {{}}".encode())])
    # javac reads unicode escapes anywhere: the same class, spelled so its bytes differ.
    escaped = "class \\u0043oderunner\\uuu0050restart {}"
    assert names_compiled_shim(java, [*plain, ("Util.java", escaped.encode())]), escaped
    assert not names_compiled_shim(java, [*plain, ("Util.java", b"class \\u0044oderunnerPrestart {}")])
    assert not names_compiled_shim(python, [("main.py", b"CoderunnerPrestart = 1\npython = 2")])


async def test_browsers_are_told_tls_when_it_ends_at_an_edge_in_front_of_soketi() -> None:
    # The API and workers reach soketi in plain HTTP inside; browsers on an https page must
    # be told wss (forceTLS), or they are blocked as mixed content.
    from types import SimpleNamespace

    from api.routes import realtime

    async def answer(env: dict[str, str]) -> dict[str, object]:
        settings = load_settings({"PUSHER_SECRET": "x", "PUSHER_HOST": "soketi", **env})
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(coderunner=SimpleNamespace(settings=settings))))
        return json.loads((await realtime(request)).body)  # type: ignore[arg-type]

    assert (await answer({}))["forceTLS"] is False
    assert (await answer({"PUSHER_SCHEME": "https"}))["forceTLS"] is True
    edge = await answer({"PUSHER_WS_SCHEME": "https", "PUSHER_WS_HOST": "rt.example.com", "PUSHER_WS_PORT": "443"})
    assert edge == {"key": "coderunner-key", "wsHost": "rt.example.com", "wsPort": 443, "forceTLS": True, "cluster": "mt1"}
    with pytest.raises(ConfigError, match="PUSHER_WS_SCHEME"):
        load_settings({"PUSHER_WS_SCHEME": "wss"})


def test_a_close_finds_the_input_sent_along_in_any_body_without_failing() -> None:
    # Read from a job token's body of up to 512 KiB: nesting past json's depth was a
    # RecursionError (a 500). A body that cannot be read may hold input the close would
    # drop: a 400 naming it (it was a 200 that dropped the bytes, until fuzzing found it).
    from api.routes import _bytes_sent_along

    for unreadable in (b"[" * 100_000, b'{"x": ' + b"[" * 100_000 + b"}", b"not json", b'[{"chunk": "x"}]'):
        with pytest.raises(ValidationError) as info:
            _bytes_sent_along(unreadable)
        assert info.value.details[0].field == "body"
    assert _bytes_sent_along(b"") is None and _bytes_sent_along(b"null") is None
    assert _bytes_sent_along(b'{"eof": true, "chunk": ""}') is None
    assert _bytes_sent_along(b'{"chunk": "last line\\n"}') == "chunk"
    assert _bytes_sent_along(b'{"data": "eA==", "encoding": "base64"}') == "data"


async def test_redis_away_is_logged_a_few_times_not_once_a_request(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every request meets the same fault while Redis is away: a line each was thousands a
    # second under load, for one fault.
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import OutOfMemoryError
    from starlette.requests import Request

    from api import errors

    scope = {"type": "http", "method": "GET", "path": "/v1/jobs/x", "headers": [], "query_string": b"",
             "scheme": "http", "server": ("127.0.0.1", 80)}  # fmt: skip
    monkeypatch.setattr(errors, "_say_redis_away", errors._Sparse(logging.WARNING))
    monkeypatch.setattr(errors, "_say_redis_full", errors._Sparse(logging.ERROR))
    with caplog.at_level("WARNING", logger="api.errors"):
        for _ in range(200):
            answer = await errors._redis_error(Request(scope), RedisConnectionError("Connection refused"))
            assert answer.status_code == 503
            assert (await errors._redis_error(Request(scope), OutOfMemoryError("OOM"))).status_code == 503
    assert caplog.text.count("redis unavailable") == 1 and caplog.text.count("redis is full") == 1, caplog.text


async def test_logged_streams_read_each_stream_of_a_log_in_pages() -> None:
    # A lost job's output, from its log: each stream's chunks in order across many pages,
    # other events skipped, a read from an earlier offset starting the pass again; never the
    # whole log held at once.
    import random

    from shared.eventlog import LOG_PAGE, LoggedStreams

    rng = random.Random(7)
    entries: list[tuple[bytes, dict[bytes, bytes]]] = []
    for i in range(LOG_PAGE * 9 + 5):
        name = rng.choice([b"stdout", b"stderr", b"stage"])
        fields = {b"seq": b"%d" % i, b"name": name}
        fields[b"chunk" if name != b"stage" else b"data"] = f"{name.decode()} {i} é\n".encode() * rng.randint(1, 20)
        entries.append((b"%d-0" % i, fields))
    entries.append((b"%d-0" % len(entries), {b"seq": b"%d" % len(entries), b"name": b"result", b"data": b"{}"}))
    pages: list[int] = []
    xrange = _paged(entries, pages)

    logged = LoggedStreams(xrange, "job:x:events")
    for name in (b"stdout", b"stderr"):
        expected = b"".join(f[b"chunk"] for _, f in entries if f[b"name"] == name)
        got, offset = b"", 0
        while piece := await logged(name.decode(), offset, 1000):
            got, offset = got + piece, offset + len(piece)
        assert got == expected
        assert await logged(name.decode(), 0, 10) == expected[:10]  # (from the start again)
    assert max(pages) <= len(entries) and len(pages) <= 4 * (len(entries) // LOG_PAGE + 1) + 2


def _paged(entries: list[tuple[bytes, dict[bytes, bytes]]], pages: list[int], expires_after: int | None = None) -> Any:
    """An XRANGE over `entries` (recording where each page starts); the log expires after
    `expires_after` pages (every later page is empty)."""

    async def xrange(_key: str, min: bytes | str, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        start = 0 if min == "-" else [entry_id for entry_id, _ in entries].index(bytes(min)[1:]) + 1
        pages.append(start)
        if expires_after is not None and len(pages) > expires_after:
            return []
        return entries[start : start + count]

    return xrange


@pytest.mark.parametrize("where", ["mid-read", "before the read"])
async def test_a_lost_jobs_output_read_from_a_log_that_expires_breaks_off(where: str) -> None:
    # A lost job's pulled output (or callback) is read from its log page by page: the log
    # expiring under the read ended the stream there, and a short stdout went out as whole,
    # valid JSON. The log ends with the result: a pass that runs out before it breaks off.
    from shared.eventlog import LOG_PAGE, LoggedStreams
    from shared.runresult import OutputGone, run_result_pieces

    entries = [(b"%d-0" % i, {b"seq": b"%d" % i, b"name": b"stdout", b"chunk": b"x" * 100}) for i in range(LOG_PAGE * 3)]
    entries.append((b"%d-0" % len(entries), {b"seq": b"%d" % len(entries), b"name": b"result", b"data": b"{}"}))
    logged = LoggedStreams(_paged(entries, [], expires_after=2 if where == "mid-read" else 0), "job:x:events")
    meta = b'{"outcome":"lost","stdoutBytes":null}'
    with pytest.raises(OutputGone):
        async for _piece in run_result_pieces(logged, meta):
            pass


@pytest.mark.parametrize(
    ("tail", "named"),
    [
        (b'\\ud83d"}', "\\ud83d at byte"),  # a high half, alone
        (b'ab\\uDE00"}', "surrogate"),  # a low half, alone (msgspec's own words)
        (b'\\ud83d\\ude00\\ud800"}', "\\ud800 at byte"),  # a pair, then a lone half
        (b'\\\\', None),  # cut short, no surrogate: msgspec's own words
    ],
)
def test_a_lone_surrogate_is_named_and_a_big_body_cut_short_is_judged_fast(tail: bytes, named: str | None) -> None:
    # The search that words the error for a lone surrogate could start with a look-behind, so
    # the regex engine tried it at every byte: 0.24-0.45 s of the API's loop for a 16 MiB
    # body cut short, every other request waiting. It now starts from the literal `\u`.
    body = b'{"language":"python","files":[{"name":"main.py","content":"' + b"a" * (16 << 20) + tail
    began = time.perf_counter()
    with pytest.raises(ValidationError) as caught:
        decode_request(ExecuteRequest, body)
    took = time.perf_counter() - began
    message = caught.value.details[0].message
    assert (named in message) if named else ("surrogate" not in message), message
    assert took < 0.1, f"{took * 1000:.0f} ms to word the error"


@given(st.text(max_size=40))
def test_a_job_id_is_exactly_32_lowercase_hex_digits(value: str) -> None:
    from shared.keys import is_job_id

    assert is_job_id(value) == (len(value) == 32 and all(c in "0123456789abcdef" for c in value))
    for bad in ("A" * 32, "g" * 32, "a" * 31, "a" * 33, "ab-" + "a" * 29, " " + "a" * 31, "a" * 31 + "\n", "ä" * 32):
        assert not is_job_id(bad), bad
    assert is_job_id("0123456789abcdef" * 2)


def test_the_playgrounds_policy_lets_in_exactly_its_own_inline_scripts_and_styles() -> None:
    import base64
    import hashlib

    from api.playground import content_security_policy
    from shared.settings import load_settings

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    page = (
        "<head><script>\r\nlet a = 1;\r\n</script><style>p { color: red }</style>"
        '<script src="/static/x.js"></script><script type="text/plain" data-sample="c">int main;</script>'
        "<SCRIPT type='module'>import('x')</SCRIPT ></head>"
    )
    settings = load_settings({"PUSHER_SECRET": "x", "PUSHER_WS_HOST": "rt.example", "PUSHER_WS_PORT": "443", "PUSHER_WS_SCHEME": "https"})
    directives = dict(part.split(" ", 1) for part in content_security_policy(page, settings).split("; "))
    # (CR LF counts as LF, as the browser reads it; the src and text/plain ones have no hash.)
    assert directives["script-src"] == " ".join(["'self'", digest("\nlet a = 1;\n"), digest("import('x')")])
    assert directives["style-src"] == digest("p { color: red }")
    assert directives["connect-src"] == "'self' wss://rt.example:443"
    assert directives["default-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
    ipv6 = load_settings({"PUSHER_SECRET": "x", "PUSHER_WS_HOST": "::1", "PUSHER_WS_PORT": "6001"})
    assert "connect-src 'self' ws: wss:" in content_security_policy("", ipv6)


def test_array_caps_are_checked_before_the_arrays_are_built() -> None:
    from shared.validation import check_array_lengths

    def refused(body: dict[str, Any]) -> str | None:
        try:
            check_array_lengths(json.dumps(body).encode())
        except ValidationError as exc:
            return f"{exc.details[0].field}: {exc.details[0].message}"
        return None

    assert refused({"files": [{}] * 100, "args": [""] * 64, "tests": [{"args": [""] * 64}] * 100}) is None
    assert refused({"files": [{}] * 101}) == "files: must contain at most 100 files"
    assert refused({"tests": [{}] * 101}) == "tests: must hold 1 to 100 cases"
    assert refused({"args": [""] * 65}) == "args: is invalid: Expected `array` of length <= 64"
    assert refused({"tests": [{}, {"args": [""] * 65}]}) == "tests[1].args: is invalid: Expected `array` of length <= 64"
    # Anything else wrong is left to the decoding proper, which says what.
    for other in ({"files": "x"}, {"tests": [5, {"args": 3}]}, {"x": [[[[]]]]}):
        assert refused(other) is None
    assert check_array_lengths(b"not json") is None
