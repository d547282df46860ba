"""Job uid ranges: a worker holds its uids for its life, and a second worker on the host
whose range overlaps is refused at start-up, saying which uid and what to change."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.paths import REPO_ROOT
from tests.conftest import StackFactory
from worker.isolation.uids import UidLease, UidsInUse, accounts_in


def test_overlapping_ranges_are_refused_and_freed_on_close(tmp_path: Path) -> None:
    first = UidLease(70000, 9, tmp_path)
    try:
        with pytest.raises(UidsInUse, match=r"job uid 70008 is in use by another worker on this host \(pid \d+\)"):
            UidLease(70008, 9, tmp_path)
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(UidsInUse, match="at least 9 apart"):
            UidLease(69995, 9, tmp_path)
        assert len(os.listdir("/proc/self/fd")) == fds  # a refused lease keeps nothing open
        beside = UidLease(70009, 9, tmp_path)  # adjacent, not overlapping
        beside.close()
    finally:
        first.close()
    UidLease(70004, 9, tmp_path).close()  # free again once closed
    assert list(tmp_path.iterdir()) == []  # and the lock files go with their leases


def test_a_lease_ends_with_its_process_however_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from worker.isolation.uids import UidLease; import sys, time\n"
         f"UidLease(71000, 3, __import__('pathlib').Path({str(tmp_path)!r}))\nprint('held', flush=True)\ntime.sleep(60)"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(UidsInUse, match=f"pid {holder.pid}"):
            UidLease(71002, 1, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    UidLease(71000, 3, tmp_path).close()


@pytest.mark.stack
@pytest.mark.sandbox
def test_a_second_worker_with_the_same_uids_is_refused(make_stack: StackFactory) -> None:
    stack = make_stack()
    env = stack.env()
    env["WORKER_ID"] = "uid-clash"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "worker"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    assert f"job uid {stack.uid_base} is in use by another worker on this host" in proc.stderr
    assert "SANDBOX_UID_BASE" in proc.stderr
    assert time.monotonic() - started < 30
    # The first worker is untouched: its liveness key is still there.
    assert stack._redis_call("exists", f"worker:{stack.worker_ids['worker']}:alive")
    # A check of the host takes no uid (it never stands in a starting worker's way) and says
    # who holds these.
    check = subprocess.run(
        [sys.executable, "-m", "worker", "--check"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90
    )
    assert check.returncode == 0, check.stderr
    assert f"note: job uids {stack.uid_base}-" in check.stdout and "held by a running worker" in check.stdout


def test_accounts_in_a_range_are_named() -> None:
    assert accounts_in(0, 1) == ["user root (0)", "group root (0)"]
    assert accounts_in(65530, 10) == ["user nobody (65534)", "group nogroup (65534)"]
    assert accounts_in(190000, 9) == []


@pytest.mark.parametrize("check", [True, False], ids=["check", "worker"])
def test_a_range_holding_a_real_account_is_refused_at_start(check: bool) -> None:
    # 65530 + 8 slots + the self-test's uid reaches nobody (65534): jobs would own its files.
    env = {**os.environ, "PUSHER_SECRET": "x", "SANDBOX_UID_BASE": "65530", "WORKER_MAX_SANDBOXES": "8",
           "REDIS_URL": "redis://127.0.0.1:9/0"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "worker", *(["--check"] if check else [])],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "job ids 65530-65538" in proc.stderr and "user nobody (65534), group nogroup (65534)" in proc.stderr
    assert "SANDBOX_UID_BASE" in proc.stderr
