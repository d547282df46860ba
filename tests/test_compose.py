"""docker-compose.yml cannot run here (no Docker engine), so check it against the code (and
run the one script of its own it holds, the redis service's start)."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import redis
import yaml

from launcher.stack import free_port
from shared.limits import Limits
from shared.paths import REPO_ROOT
from shared.settings import ENV_NAMES, maximum_env_name
from worker.isolation.forkserver import FORKSERVER_NAME


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_services_and_commands() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "soketi", "api", "worker"}
    assert services["api"]["command"][:2] == ["coderunner", "api"]
    assert services["worker"]["command"] == ["coderunner", "worker"]
    # No unauthenticated Redis (CVE-2024-29021 class), and no password on a command line.
    redis_start = services["redis"]["entrypoint"][2]
    assert "requirepass" in redis_start and "exec docker-entrypoint.sh redis-server" in redis_start
    assert "command" not in services["redis"] and "--requirepass" not in redis_start


def test_environment_names_exist_in_settings() -> None:
    services = _compose()["services"]
    known = set(ENV_NAMES) | {maximum_env_name(f) for f in Limits.__struct_fields__}
    for name in ("api", "worker"):
        env = services[name]["environment"]
        unknown = set(env) - known
        assert not unknown, f"{name} sets variables the code never reads: {unknown}"
        assert "REDIS_URL" in env and "PUSHER_SECRET" in env
    assert "EXECUTOR_API_TOKEN" in services["api"]["environment"]
    soketi = services["soketi"]["environment"]
    assert all(k.startswith("SOKETI_") for k in soketi if k != "NODE_OPTIONS")
    # The app credentials soketi gets are the ones API and worker sign with.
    assert soketi["SOKETI_DEFAULT_APP_KEY"].startswith("${PUSHER_KEY")
    assert soketi["SOKETI_DEFAULT_APP_SECRET"].startswith("${PUSHER_SECRET")
    # Workers publish through soketi's Redis adapter: soketi must be on the same Redis.
    assert services["worker"]["environment"]["PUSHER_PUBLISH"] == "redis"
    assert soketi["SOKETI_ADAPTER_DRIVER"] == "redis"
    redis_url = services["worker"]["environment"]["REDIS_URL"]
    assert redis_url == f"redis://:{soketi['SOKETI_DB_REDIS_PASSWORD']}@{soketi['SOKETI_DB_REDIS_HOST']}:{soketi['SOKETI_DB_REDIS_PORT']}/{soketi['SOKETI_DB_REDIS_DB']}"
    assert services["api"]["environment"]["PUSHER_HOST"] == "soketi"


def test_every_service_comes_back_and_waits_for_a_redis_that_answers() -> None:
    services = _compose()["services"]
    assert all(service.get("restart") == "unless-stopped" for service in services.values())
    assert "healthcheck" in services["redis"]
    for name in ("soketi", "api", "worker"):
        assert services[name]["depends_on"]["redis"] == {"condition": "service_healthy"}, name
    # /metrics on the published port is not for everyone.
    assert services["api"]["environment"]["METRICS_TOKEN"].startswith("${METRICS_TOKEN:?")


def test_the_api_runs_as_the_images_unprivileged_user_and_the_worker_as_root() -> None:
    services = _compose()["services"]
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert services["api"]["user"] == "10001:10001" and "useradd --system --uid 10001 --user-group" in dockerfile
    assert "user" not in services["worker"]  # (it builds jails)


def test_the_build_context_leaves_out_local_state_and_secrets() -> None:
    ignored = [line for line in (REPO_ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    for local in (".git", ".env", ".venv", ".tools", "**/node_modules", "test-output"):
        assert local in ignored, local
    # Nothing the Dockerfile copies is left out.
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert not any(source == i or source.startswith(i.rstrip("*") + "/") for i in ignored), source


def test_the_package_data_holds_every_header_the_workers_c_includes() -> None:
    listed = set(re.findall(r'"([a-z_]+\.[ch])"', (REPO_ROOT / "pyproject.toml").read_text()))
    for source in ("gate.c", "enter.c"):
        assert source in listed
        for header in re.findall(r'#include "([^"]+)"', (REPO_ROOT / "worker" / "isolation" / source).read_text()):
            assert header in listed, (source, header)


def test_secrets_have_no_defaults() -> None:
    text = (REPO_ROOT / "docker-compose.yml").read_text()
    for secret in ("REDIS_PASSWORD", "EXECUTOR_API_TOKEN", "PUSHER_SECRET", "PUSHER_KEY", "METRICS_TOKEN"):
        assert not re.search(r"\$\{" + secret + r":-", text), f"{secret} must not have a default"


def test_dockerfile_copies_what_exists() -> None:
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (REPO_ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_dockerfile_copies_every_package_the_project_installs() -> None:
    """The image installs the project from what it copied: a package named in pyproject's
    find-include but not copied would be missing at import time in the container."""
    include = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {
        source
        for line in (REPO_ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    }
    packages = {pattern.rstrip("*") for pattern in include}
    assert packages and packages <= copied, sorted(packages - copied)


def test_dockerfile_workers_run_the_nsjail_it_builds() -> None:
    """The build stage runs scripts/build-nsjail.sh (its output lands in .tools/nsjail of
    the stage's folder) and the image points NSJAIL_PATH at the copy it takes, with the fork
    server next to it."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    workdir = re.search(r"AS nsjail\n(?:.*\n)*?WORKDIR (\S+)", text)
    assert workdir and "RUN scripts/build-nsjail.sh" in text
    copied = re.search(r"COPY --from=nsjail (\S+) (\S+)", text)
    assert copied and copied.group(1) == f"{workdir.group(1)}/.tools/nsjail/bin/nsjail"
    assert re.search(r"ENV .*NSJAIL_PATH=" + re.escape(copied.group(2)) + r"\b", text)
    # ... and the fork server built with it, beside it, where workers look for it
    server = f"{workdir.group(1)}/.tools/nsjail/bin/{FORKSERVER_NAME}"
    assert f"COPY --from=nsjail {server} {Path(copied.group(2)).with_name(FORKSERVER_NAME)}\n" in text
    assert "COPY worker/isolation/forkserver.c worker/isolation/forkserver_warm.cc" in text  # (what it builds from)


def test_the_image_holds_the_playgrounds_pusher_js() -> None:
    """The API serves the playground's pusher-js from the checkout's clients/js; the image
    must put it at the same place under its WORKDIR, or the playground breaks in compose."""
    from api.playground import _PUSHER_JS

    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    wanted = str(_PUSHER_JS.relative_to(REPO_ROOT))
    copies = [line.split() for line in text.splitlines() if line.startswith("COPY --from=")]
    assert any(parts[-1] == wanted for parts in copies), f"no COPY puts {wanted} into the image"
    assert "WORKDIR /app" in text


def test_the_worker_locks_its_job_uids_in_the_hosts_folder() -> None:
    # Its uids are the host's; locks in a /run of the container's own would not see another
    # container's worker drawing the same ones.
    from worker.isolation.uids import LOCK_DIR

    worker = _compose()["services"]["worker"]
    assert f"{LOCK_DIR}:{LOCK_DIR}" in worker.get("volumes", [])


def test_the_worker_can_run_what_it_builds_in_its_work_root_and_agrees_with_soketi_on_payloads() -> None:
    # Docker mounts a tmpfs noexec unless told: the jail helper the worker builds in its
    # work root could not run, and no sandbox would start.
    services = _compose()["services"]
    worker = services["worker"]
    mounts = [entry.split(":", 1) for entry in worker["tmpfs"]]
    work_root = next(options for path, *options in mounts if path == "/run/coderunner")
    assert "exec" in work_root[0].split(",") and "noexec" not in work_root[0].split(",")
    # Workers keep events under the payload limit soketi enforces: both read one variable.
    limit = services["soketi"]["environment"]["SOKETI_DEFAULT_APP_MAX_EVENT_PAYLOAD_IN_KB"]
    for name in ("api", "worker"):
        assert services[name]["environment"]["PUSHER_MAX_PAYLOAD_KB"] == limit


def test_the_image_has_a_toolchain_for_every_language_but_rust() -> None:
    """Debian's package of each language's tools (the manifests' paths are Debian's); rust's
    manifest wants rustup's toolchain, which the image does not fetch (README says so)."""
    packages = {"python": "python3", "javascript": "nodejs", "c": "gcc", "cpp": "g++",
                "java": "default-jdk-headless", "go": "golang-go", "ruby": "ruby", "sqlite": "sqlite3", "bash": None}  # fmt: skip
    languages = {path.stem for path in (REPO_ROOT / "sandbox-profiles" / "languages").glob("*.toml")}
    assert languages == set(packages) | {"rust"}
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final_stage = text.rsplit("\nFROM ", 1)[1]
    installed = set(re.search(r"RUN apt-get update && apt-get install -y (.*)", final_stage).group(1).split())
    for language, package in packages.items():
        assert package is None or package in installed, f"the image cannot run {language}: no {package}"


def test_a_stopped_worker_container_has_time_to_end_its_jobs() -> None:
    # Docker SIGKILLs after 10 s unless told: exactly the worker's default grace, so the jobs
    # it was ending got no result.
    from shared.settings import load_settings, worker_stop_s

    worker = _compose()["services"]["worker"]
    period = worker.get("stop_grace_period", "10s")
    assert period.endswith("s") and period[:-1].isdigit(), period
    grace = worker["environment"].get("WORKER_SHUTDOWN_GRACE_MS")
    settings = load_settings({"PUSHER_SECRET": "s" * 16, **({"WORKER_SHUTDOWN_GRACE_MS": grace} if grace else {})})
    assert int(period[:-1]) >= worker_stop_s(settings.worker_shutdown_grace_ms)
    assert worker.get("init") is True


def test_soketi_runs_with_the_message_guard_and_batched_webhooks_as_the_launcher_does() -> None:
    # One malformed client message stopped soketi 1.6.1 (realtime/guard.js), and a client
    # subscribing in a loop made soketi send the API a webhook request each time.
    soketi = _compose()["services"]["soketi"]
    env = soketi["environment"]
    mounted = {inside: host for host, inside, *_ in (volume.split(":") for volume in soketi["volumes"])}
    required = env["NODE_OPTIONS"].split("--require ", 1)[1].split()[0]
    assert (REPO_ROOT / mounted[required].removeprefix("./")) == REPO_ROOT / "realtime" / "guard.js"
    assert env["SOKETI_WEBHOOKS_BATCHING"] == "true" and int(env["SOKETI_WEBHOOKS_BATCHING_DURATION"]) <= 50
    assert soketi["restart"] == "unless-stopped"


def test_a_stopped_api_container_has_time_to_close_cleanly() -> None:
    # Docker SIGKILLs after 10 s unless told: the API's own default grace for requests under
    # way, so its shutdown (the sweep stopped, the publisher closed) never ran.
    from shared.settings import load_settings

    api = _compose()["services"]["api"]
    period = api.get("stop_grace_period", "10s")
    assert period.endswith("s") and period[:-1].isdigit(), period
    settings = load_settings({"PUSHER_SECRET": "s" * 16})
    assert int(period[:-1]) * 1000 >= settings.api_shutdown_grace_ms + settings.pusher_timeout_ms + 2000


def test_the_redis_container_gets_its_password_from_a_file_only_its_user_reads() -> None:
    # The redis service's own entrypoint script, run here as compose would run it (its `$$`
    # is compose's escape for `$`), with a stand-in for the image's docker-entrypoint.sh that
    # drops to the redis user as that one does, and a private /tmp. A password of quotes,
    # backslashes, `$`, spaces and non-ASCII bytes is the one Redis asks for; it is on no
    # command line and in no environment of redis-server, and its file is 0600, redis's own.
    script = _compose()["services"]["redis"]["entrypoint"][2].replace("$$", "$")
    # (Outside /tmp, which the private one hides.)
    where = Path(tempfile.mkdtemp(prefix="coderunner-compose-", dir="/run"))
    where.chmod(0o755)  # (redis-server, as the redis user, works in a folder of it)
    try:
        _run_redis_start(script, where)
    finally:
        shutil.rmtree(where)


def _run_redis_start(script: str, where: Path) -> None:
    bin_dir = where / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "docker-entrypoint.sh"
    seen = where / "seen"
    stand_in.write_text(
        "#!/bin/sh\n"
        # What redis-server is started with (it overwrites both with its title once it runs).
        f'printf "%s\\0" "$@" > {seen}.argv && env > {seen}.env\n'
        'exec setpriv --reuid=redis --regid=redis --init-groups "$@"'
        ' --port "$TEST_PORT" --bind 127.0.0.1 --dir "$TEST_DIR" --appendonly no --save ""\n'
    )
    stand_in.chmod(0o755)
    data = where / "data"
    data.mkdir()
    shutil.chown(data, "redis", "redis")
    password = "pa\"ss\\word $HOME 'q' /+=?#@ \u00e9t\u00e9"
    port = free_port()
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "REDIS_PASSWORD": password, "TEST_PORT": str(port), "TEST_DIR": str(data)}
    private_tmp = 'mount -t tmpfs -o mode=1777 coderunner-test /tmp && exec /bin/sh -c "$0"'
    server = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", private_tmp, script],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "redis-server never answered"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password=password + "x").ping()
        # Every exec kept the pid: the one started is redis-server, as the redis user.
        proc = Path(f"/proc/{server.pid}")
        assert (proc / "comm").read_text().strip() == "redis-server"
        assert proc.stat().st_uid == pwd.getpwnam("redis").pw_uid
        argv = Path(f"{seen}.argv").read_bytes().split(b"\0")[:-1]
        assert argv == [b"redis-server", b"/tmp/redis-auth.conf", b"--appendonly", b"yes"], argv
        assert b"REDIS_PASSWORD" not in Path(f"{seen}.env").read_bytes()
        for exposed in ("cmdline", "environ"):
            assert password.encode() not in (proc / exposed).read_bytes(), exposed
        conf = Path(f"/proc/{server.pid}/root/tmp/redis-auth.conf")
        info = conf.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o600, pwd.getpwnam("redis").pw_uid)
        client.close()
        # The healthcheck, as compose runs it in the container: it passes with the password
        # and fails without it (redis-cli here is pointed at this server's port).
        (bin_dir / "redis-cli").write_text('#!/bin/sh\nexec /usr/bin/redis-cli -p "$TEST_PORT" "$@"\n')
        (bin_dir / "redis-cli").chmod(0o755)
        test = _compose()["services"]["redis"]["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and "REDIS_PASSWORD" not in test[1].split("redis-cli", 1)[1]
        check = test[1].replace("$$", "$")
        assert subprocess.run(["/bin/sh", "-c", check], env=env, timeout=10).returncode == 0
        wrong = {**env, "REDIS_PASSWORD": password + "x"}
        assert subprocess.run(["/bin/sh", "-c", check], env=wrong, timeout=10, stderr=subprocess.DEVNULL).returncode != 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
