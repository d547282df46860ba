"""docker-compose.yml cannot run here (no Docker engine), so check it against the code."""

from __future__ import annotations

import re

import yaml

from shared.limits import Limits
from shared.paths import REPO_ROOT
from shared.settings import ENV_NAMES


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_services_and_commands() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "soketi", "api", "worker"}
    assert services["api"]["command"][:2] == ["coderunner", "api"]
    assert services["worker"]["command"] == ["coderunner", "worker"]
    assert services["redis"]["command"][0] == "redis-server"
    assert "--requirepass" in services["redis"]["command"]  # no unauthenticated Redis (CVE-2024-29021 class)


def test_environment_names_exist_in_settings() -> None:
    services = _compose()["services"]
    known = set(ENV_NAMES) | {"MAX_" + f.upper() for f in Limits.__struct_fields__}
    for name in ("api", "worker"):
        env = services[name]["environment"]
        unknown = set(env) - known
        assert not unknown, f"{name} sets variables the code never reads: {unknown}"
        assert "REDIS_URL" in env and "PUSHER_SECRET" in env
    assert "EXECUTOR_API_TOKEN" in services["api"]["environment"]
    soketi = services["soketi"]["environment"]
    assert all(k.startswith("SOKETI_") for k in soketi)
    # The app credentials soketi gets are the ones API and worker sign with.
    assert soketi["SOKETI_DEFAULT_APP_KEY"].startswith("${PUSHER_KEY")
    assert soketi["SOKETI_DEFAULT_APP_SECRET"].startswith("${PUSHER_SECRET")
    assert services["api"]["environment"]["PUSHER_HOST"] == "soketi"


def test_secrets_have_no_defaults() -> None:
    text = (REPO_ROOT / "docker-compose.yml").read_text()
    for secret in ("REDIS_PASSWORD", "EXECUTOR_API_TOKEN", "PUSHER_SECRET", "PUSHER_KEY"):
        assert not re.search(r"\$\{" + secret + r":-", text), f"{secret} must not have a default"


def test_dockerfile_copies_what_exists() -> None:
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO_ROOT / source).exists(), f"Dockerfile copies missing {source}"
