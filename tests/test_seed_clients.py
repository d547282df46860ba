"""The seed product's published npm clients, unchanged, against this service.

`tests/seed_clients/` is a Node package pinning `@teovilla/code-runner-sdk-node` 0.4.0 and
`@teovilla/code-runner-react` 0.4.2 (with react, react-dom, jsdom, pusher-js). Its tests
(`node --test`) drive a real stack: the React hook mounted in jsdom follows jobs over
soketi while the SDK submits, starts, feeds stdin, closes stdin, kills and polls them, and
every typed error the SDK maps is provoked. `scripts/bootstrap.sh` installs the package.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from launcher.node import find_node
from launcher.stack import Stack
from shared.paths import REPO_ROOT

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

PACKAGE = REPO_ROOT / "tests" / "seed_clients"


def test_seed_npm_clients_work_unchanged(stack: Stack) -> None:
    installed = PACKAGE / "node_modules" / "@teovilla"
    assert (installed / "code-runner-sdk-node").is_dir() and (installed / "code-runner-react").is_dir(), (
        f"{PACKAGE}/node_modules is missing: run `make test-deps` (scripts/bootstrap.sh installs it)"
    )
    env = dict(os.environ)
    env.update(
        {
            "CODERUNNER_API_URL": stack.api_url,
            "CODERUNNER_API_TOKEN": stack.api_token,
            "CODERUNNER_PUSHER_SECRET": stack.pusher_secret,
            "NODE_NO_WARNINGS": "1",
        }
    )
    began = time.monotonic()
    try:
        run = subprocess.run(
            [find_node(), "--test", "tests/seed_clients/"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as exc:
        print(exc.stdout, exc.stderr, sep="\n")
        raise
    took = time.monotonic() - began
    if run.returncode != 0:
        print(run.stdout)
        print(run.stderr)
    assert run.returncode == 0, f"node --test tests/seed_clients/ exited {run.returncode} after {took:.1f}s (output above)"
    assert "# fail 0" in run.stdout and "# pass 0" not in run.stdout, run.stdout
