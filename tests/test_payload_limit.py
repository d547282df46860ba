"""Every published event fits soketi's payload limit, so a live client never loses one.

soketi refuses an event over its limit (100 KiB by default), and a refused batch drops every
event in it. A manifest may let a compile log grow to 4 MiB, and JSON escaping can make
control bytes six times larger: the `result` must still reach the live client.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from shared.messages import CaseFacts, CompileInfo, Outcome, result_without_run
from shared.paths import REPO_ROOT
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime
from worker.job.payload import CUT_MARKER, fit_result


def test_fit_result_keeps_small_results_and_cuts_long_compile_logs() -> None:
    small = result_without_run(Outcome.COMPILE_ERROR, None, CompileInfo(
        exit_code=1, signal=None, timed_out=False, duration_ms=5, output="main.c:1: error"))  # fmt: skip
    same, raw = fit_result(small, 100 * 1024)
    assert same == small and raw == msgspec.json.encode(small)

    log = "\x01" * (1024 * 1024)
    big = msgspec.structs.replace(small, compile=msgspec.structs.replace(small.compile, output=log))
    fitted, raw = fit_result(big, 100 * 1024)
    assert len(raw) <= 100 * 1024 - 512
    assert len(raw) > 90 * 1024  # it keeps as much as fits, not a token amount
    assert fitted.compile is not None and fitted.compile.output.endswith(CUT_MARKER)
    assert log.startswith(fitted.compile.output[: -len(CUT_MARKER)])
    assert msgspec.json.decode(raw)["outcome"] == "compile_error"


def test_a_batch_result_with_long_case_names_fits_the_smallest_limit() -> None:
    # 100 cases named with 128 four-byte characters each: about 63 KiB of result (more with a
    # summary, a compile step, kill reasons), at the edge of the smallest limit the settings
    # allow (64 KiB; 48 here, to be past it). It goes out without the names (its test_result
    # events and the pullable result have them); a small batch keeps them.
    cases = [
        CaseFacts(index=i, name="\U0001f600" * 128, outcome=Outcome.COMPLETED, verdict="accepted", exit_code=0,
                  signal=None, duration_ms=1, cpu_ms=1, memory_kb=1)
        for i in range(100)
    ]  # fmt: skip
    event = msgspec.structs.replace(result_without_run(Outcome.COMPLETED, None), tests=cases)
    assert len(msgspec.json.encode(event)) > 48 * 1024
    fitted, raw = fit_result(event, 48 * 1024)
    assert len(raw) <= 48 * 1024 - 512
    assert fitted.tests is not None and len(fitted.tests) == 100 and all(c.name is None for c in fitted.tests)
    few = msgspec.structs.replace(event, tests=cases[:3])
    assert fit_result(few, 48 * 1024)[0] == few


@pytest.mark.stack
@pytest.mark.sandbox
def test_a_megabyte_of_control_characters_in_diagnostics_reaches_the_live_client(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    profiles = tmp_path / "profiles"
    shutil.copytree(REPO_ROOT / "sandbox-profiles", profiles)
    manifest = profiles / "languages" / "c.toml"
    manifest.write_text(manifest.read_text().replace("[compile]\n", "[compile]\noutput_kb = 4096\n"))
    stack = make_stack(SANDBOX_PROFILES_DIR=str(profiles), WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        # gcc repeats the offending line raw in its diagnostic: about 1 MiB of \x01 in all.
        source = '#error "' + "\x01" * (512 * 1024) + '"\nint main(void) { return 0; }\n'
        job = api.execute({"language": "c", "files": [{"name": "main.c", "content": source}], "collectOutput": True})
        followed = rt.follow(job)
        api.start(job)
        result = followed.wait_result(timeout_s=60)
        assert result["outcome"] == "compile_error"
        assert result["compile"]["output"].endswith(CUT_MARKER)
        # Every event arrived live, in order, and matches the durable log.
        log = api.replay(job, timeout_s=60)
        live = sorted(followed.events, key=lambda e: e[1]["seq"])
        assert [p["seq"] for _, p in live] == list(range(len(log)))
        assert live == log
        streamed = "".join(p["chunk"] for n, p in log if n == "compile_output")
        assert streamed.count("\x01") >= 1024 * 1024
        # The pullable result has the whole log.
        out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"}).json()
        assert out["compile"]["output"] == streamed
    finally:
        rt.close()
        api.close()
