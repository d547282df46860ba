"""A mixed fleet: a worker that lacks a job's language hands it to one that has it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.paths import REPO_ROOT
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job, run_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]


def test_job_reaches_a_worker_that_offers_its_language(make_stack: StackFactory, tmp_path: Path) -> None:
    bash_only = tmp_path / "profiles"
    (bash_only / "languages").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "sandbox-profiles" / "base.cfg", bash_only / "base.cfg")
    shutil.copy(REPO_ROOT / "sandbox-profiles" / "languages" / "bash.toml", bash_only / "languages" / "bash.toml")

    stack = make_stack(with_worker=False)
    stack.start_worker(extra_env={"SANDBOX_PROFILES_DIR": str(bash_only), "WORKER_MAX_SANDBOXES": "2"})
    api, rt = Api(stack), Realtime(stack)
    try:
        jobs = [api.execute(py_job(f"print({i})")) for i in range(3)]
        followed = [rt.follow(job) for job in jobs]
        for job in jobs:
            api.start(job)
        stack.start_worker(extra_env={"WORKER_MAX_SANDBOXES": "2"})
        for i, f in enumerate(followed):
            result = f.wait_result(timeout_s=30)
            assert result["outcome"] == "completed", result
            assert f.text("stdout") == f"{i}\n"
        bash = {"language": "bash", "files": [{"name": "main.sh", "content": "echo fine"}]}
        assert run_job(api, rt, bash)[0]["outcome"] == "completed"
    finally:
        rt.close()
        api.close()


def test_a_worker_started_with_a_live_workers_id_is_refused(make_stack: StackFactory) -> None:
    stack = make_stack()
    env = stack.env()
    env["WORKER_ID"] = stack.worker_ids["worker"]
    env["SANDBOX_UID_BASE"] = str(stack.uid_base + 500)  # its own uids: the id alone clashes
    proc = subprocess.run([sys.executable, "-m", "worker"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert f"another live worker already uses the id {stack.worker_ids['worker']!r}" in proc.stderr
    api, rt = Api(stack), Realtime(stack)
    try:  # the first one still serves
        assert run_job(api, rt, py_job("print('still here')"))[0]["outcome"] == "completed"
    finally:
        rt.close()
        api.close()
