"""bench/ide_trace.py reads the job's way through the worker off Redis MONITOR lines."""

from __future__ import annotations

from bench.ide_trace import logged_marks

JOB = "4c95920e211b42f288581571e32d6ade"


def _line(command: str, *args: str) -> str:
    return "[0 127.0.0.1:5555] " + " ".join(f'"{word}"' for word in (command, *args))


def test_the_running_write_the_first_output_after_it_and_the_result_are_found() -> None:
    status, events = f"job:{JOB}:status", f"job:{JOB}:events"
    lines = [
        (1.000, _line("EVALSHA", "b5c5", "6", status, "claim")),
        (1.001, '[0 lua] "XADD" "' + events + '" "*" "seq" "0" "name" "stage"'),
        # A stage logged before the running one names no output: nothing is taken from it.
        (1.002, _line("EVALSHA", "1ca9", "3", status, events, "1", "86400", "running", "17")),
        (1.003, _line("EVALSHA", "1ca9", "2", status, events, "1", "86400", "", "stdout", "1\\n")),
        (1.004, _line("EVALSHA", "1ca9", "2", status, events, "1", "86400", "", "stdout", "2\\n")),
        (1.005, _line("EVALSHA", "93ec", "17", status, events, '{\\"outcome\\":\\"completed\\"}')),
        (1.006, _line("EXISTS", f"job:{JOB}:signed")),
    ]
    assert logged_marks(lines) == {"running_logged": 1.002, "stdout_logged": 1.003, "result_logged": 1.005}


def test_a_job_with_no_output_has_no_output_mark() -> None:
    status = f"job:{JOB}:status"
    lines = [
        (2.0, _line("EVALSHA", "1ca9", "3", status, "running")),
        (2.1, _line("EVALSHA", "93ec", "17", status, '{\\"outcome\\":\\"completed\\"}')),
    ]
    assert logged_marks(lines) == {"running_logged": 2.0, "result_logged": 2.1}
