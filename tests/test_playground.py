"""The playground page (web/index.html) driven like a person would, in a real headless Chromium.

The page is loaded through the link `coderunner up` prints (`<api>/#token=<apiToken>`); each
scenario saves a screenshot under test-output/playground/ and prints its path.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from shared.paths import REPO_ROOT

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium tries to reach outside hosts.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
SHOTS = REPO_ROOT / "test-output" / "playground"
RUN_TIMEOUT_MS = 30000

ASK_NAME = 'name = input("What is your name?\\n")\nprint(f"Hello, {name}!")\n'


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail("chromium is not installed (scripts/bootstrap.sh --test installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a test extra")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, stack: Stack) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    p.set_default_timeout(RUN_TIMEOUT_MS)
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    # Anything of the page's own its Content Security Policy refused (an inline script whose
    # hash changed, a connection to a place the policy does not name) is an error too, but
    # for what a test says it expects (`page.refusals_expected`).

    def refused(message: Any) -> None:
        text = message.text
        if "Content Security Policy" in text and not any(part in text for part in getattr(p, "refusals_expected", ())):
            errors.append(text)

    p.on("console", refused)
    yield p
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def expect() -> Any:
    from playwright.sync_api import expect as _expect

    return _expect


def shot(page: Any, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def open_playground(page: Any, stack: Stack) -> None:
    """Open the link `coderunner up` prints and check the token left the address bar and storage."""
    page.goto(f"{stack.api_url}/#token={stack.api_token}")
    expect()(page.locator("#status")).to_have_text(re.compile("ready"), timeout=15000)
    href = page.evaluate("location.href")
    assert stack.api_token not in href and "token" not in href, href
    assert stack.api_token not in page.url
    storage = page.evaluate(
        "JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage), document.cookie])"
    )
    assert stack.api_token not in storage, storage
    # (pusher-js keeps its transport cache in localStorage; nothing of ours is there.)
    assert "token" not in page.evaluate("JSON.stringify(Object.keys(localStorage))").lower()
    # The history entry was rewritten too: going "back" cannot bring the fragment again.
    assert stack.api_token not in page.evaluate("history.state === null ? '' : JSON.stringify(history.state)")
    assert stack.api_token not in page.locator("#token").input_value()


def run_and_wait(page: Any, timeout_ms: int = RUN_TIMEOUT_MS) -> dict[str, Any]:
    page.click("#run")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", re.compile(r"\w"), timeout=timeout_ms)
    return {
        "outcome": page.get_attribute("#result", "data-outcome"),
        "exit": page.get_attribute("#result", "data-exit-code"),
        "text": page.inner_text("#result"),
        "output": page.inner_text("#output"),
    }


def without_realtime(page: Any, stack: Stack) -> None:
    """Send the page's pusher-js to a port nothing listens on (9): soketi unreachable. The
    page's policy refuses that connection before it is tried, which is what the test stands
    in for, so that refusal is expected."""
    page.refusals_expected = ["'ws://127.0.0.1:9/", "'wss://127.0.0.1:9/"]
    page.route(
        re.compile(r".*/v1/realtime$"),
        lambda route: route.fulfill(json={"key": stack.pusher_key, "wsHost": "127.0.0.1", "wsPort": 9, "forceTLS": False}),
    )


def test_token_link_then_reload_asks_again(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    # The picker starts on the editor's sample language; every runtime is offered.
    assert page.input_value("#language") == "python"
    assert "What is your name?" in page.input_value("#code")
    offered = page.eval_on_selector_all("#language option", "os => os.map(o => o.value)")
    assert set(offered) >= {"python", "javascript", "c", "cpp", "rust", "java", "bash", "go", "ruby", "sqlite"}, offered
    # Each language has its own sample that asks for a name.
    page.select_option("#language", "go")
    assert "What is your name?" in page.input_value("#code") and "package main" in page.input_value("#code")
    page.select_option("#language", "python")
    assert 'print("What is your name?")' in page.input_value("#code")

    page.reload()
    expect()(page.locator("#token")).to_be_visible()
    expect()(page.locator("#status")).to_contain_text("API token")
    assert stack.api_token not in page.evaluate("JSON.stringify(Object.entries(localStorage))")
    page.fill("#token", stack.api_token)
    page.press("#token", "Enter")
    expect()(page.locator("#status")).to_have_text(re.compile("ready"))
    assert page.input_value("#token") == ""  # the field keeps no copy
    shot(page, "0-token")


def test_a_script_injected_into_the_page_does_not_run(browser: Any, stack: Stack) -> None:
    # The page's Content Security Policy runs its own inline scripts (the `page` fixture fails
    # every other test on any it refused) and nothing added later: an inline script, an event
    # handler attribute or one from another place never runs, and no other page may frame it.
    context = browser.new_context()
    page = context.new_page()
    response = page.goto(f"{stack.api_url}/")
    policy = response.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "'unsafe-inline'" not in policy, policy
    expect()(page.locator("#status")).to_contain_text("API token")
    refused = page.evaluate(
        """async () => {
            const seen = [];
            document.addEventListener("securitypolicyviolation", (e) => seen.push(e.effectiveDirective));
            const inline = document.createElement("script");
            inline.textContent = "window.ranInline = true";
            document.body.appendChild(inline);
            const handler = document.createElement("img");
            handler.setAttribute("onerror", "window.ranHandler = true");
            handler.src = "data:,not-an-image";
            document.body.appendChild(handler);
            const outside = document.createElement("script");
            outside.src = "data:text/javascript,window.ranOutside=true";
            document.body.appendChild(outside);
            await new Promise((done) => setTimeout(done, 300));
            return {seen, ran: [window.ranInline, window.ranHandler, window.ranOutside]};
        }"""
    )
    context.close()
    assert refused["ran"] == [None, None, None], refused
    assert sorted(set(refused["seen"])) == ["script-src-attr", "script-src-elem"], refused


def test_the_sqlite_sample_reads_a_name_from_stdin(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    page.select_option("#language", "sqlite")
    assert page.input_value("#code").startswith("-- An in-memory database")
    page.click("#run")
    expect()(page.locator("#output")).to_contain_text("What is your name?", timeout=RUN_TIMEOUT_MS)
    page.fill("#stdin-line", "Ada, of course")
    page.press("#stdin-line", "Enter")
    page.click("#eof")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "completed", timeout=RUN_TIMEOUT_MS)
    stdout = "".join(page.eval_on_selector_all("#output .stdout", "s => s.map(x => x.textContent)"))
    assert stdout == "What is your name?\nHello, Ada, of course!\n", stdout
    shot(page, "15-sqlite-sample")


def test_python_asks_a_name_and_greets(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    # The python sample as shipped: prompt, read a line, greet.
    page.click("#run")
    output = page.locator("#output")
    expect()(output).to_contain_text("What is your name?", timeout=RUN_TIMEOUT_MS)
    expect()(page.locator("#status")).to_contain_text("running")
    page.fill("#stdin-line", "Ada")
    page.press("#stdin-line", "Enter")
    expect()(output).to_contain_text("Hello, Ada!")
    result = page.locator("#result")
    expect()(result).to_have_attribute("data-outcome", "completed")
    expect()(result).to_have_attribute("data-exit-code", "0")
    expect()(result).to_contain_text("exit 0")
    for part in ("wall", "CPU", "memory"):
        expect()(result).to_contain_text(part)
    # The transcript reads naturally: prompt (stdout), the echoed line (input), the greeting.
    text = page.inner_text("#output")
    assert text.index("What is your name?") < text.index("Ada") < text.index("Hello, Ada!"), text
    assert page.inner_text("#output .stdin") == "Ada\n"
    assert "Hello, Ada!" in " ".join(page.eval_on_selector_all("#output .stdout", "s => s.map(x => x.textContent)"))
    shot(page, "1-python-greets")

    # Send EOF instead of a name: the sample says so on stderr, shown as stderr.
    page.click("#run")
    expect()(output).to_contain_text("What is your name?", timeout=RUN_TIMEOUT_MS)
    page.click("#eof")
    expect()(output).to_contain_text("Hello, stranger!")
    expect()(result).to_have_attribute("data-outcome", "completed")
    # (print() writes the line and its newline apart: they may come as two stderr chunks.)
    stderr = "".join(page.eval_on_selector_all("#output .stderr", "s => s.map(x => x.textContent)"))
    assert "No name given (stdin closed)" in stderr, page.inner_text("#output")
    # Told apart by more than colour: a screen reader hears which stream (and copying the
    # output takes none of those words).
    spoken = output.aria_snapshot()
    assert "stderr: No name given (stdin closed)" in spoken, spoken
    assert "stderr" not in page.inner_text("#output"), page.inner_text("#output")
    shot(page, "1b-python-eof-stderr")


def test_stop_kills_an_infinite_loop(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    page.fill("#code", "print('spinning', flush=True)\nwhile True:\n    pass\n")
    page.click("#run")
    expect()(page.locator("#output")).to_contain_text("spinning", timeout=RUN_TIMEOUT_MS)
    expect()(page.locator("#stop")).to_be_enabled()
    time.sleep(0.5)
    page.click("#stop")
    result = page.locator("#result")
    expect()(result).to_have_attribute("data-outcome", "killed", timeout=10000)
    expect()(result).to_contain_text("killed")
    expect()(result).to_contain_text("SIGKILL")
    expect()(result).to_contain_text("stopped by you")
    expect()(page.locator("#run")).to_be_enabled()
    expect()(page.locator("#stop")).to_be_disabled()
    shot(page, "2-stop-killed")


def test_c_compile_error_is_shown_as_one(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    page.select_option("#language", "c")
    assert "#include <stdio.h>" in page.input_value("#code")
    page.fill("#code", '#include <stdio.h>\nint main(void) {\n    printf("missing semicolon")\n    return 0;\n}\n')
    result = run_and_wait(page, timeout_ms=60000)
    assert result["outcome"] == "compile_error", result
    assert "compile_error" in result["text"] and "compile error" in result["text"]
    compiler = page.inner_text("#output .compile")
    assert "error" in compiler and "main.c" in compiler, compiler
    assert page.locator("#output .stdout").count() == 0
    expect()(page.locator("#status")).to_contain_text("compile error")
    shot(page, "3-c-compile-error")


def test_ten_quick_runs_in_a_row_all_finish(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    timings = []
    for i in range(10):
        page.fill("#code", f"print('run {i}')\n")
        t0 = time.monotonic()
        result = run_and_wait(page, timeout_ms=20000)
        timings.append(round((time.monotonic() - t0) * 1000))
        assert result["outcome"] == "completed" and result["exit"] == "0", (i, result)
        assert result["output"].strip().endswith(f"run {i}"), (i, result)
    stats = page.evaluate("window.coderunnerPlayground.stats")
    print(f"10 runs, click → result ms: {timings}; page stats: {stats}")
    assert stats["runs"] == 10
    # Live delivery carried every run: no run needed the status poll to finish.
    assert stats["statusPolls"] == 0, stats
    shot(page, "4-ten-runs")


def test_bad_limit_is_a_400_naming_the_field(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    page.fill("#limit-memoryMb", "99999")
    page.click("#run")
    result = page.locator("#result")
    expect()(result).to_contain_text("limits.memoryMb")
    expect()(result).to_contain_text("400")
    expect()(page.locator("#limit-memoryMb")).to_have_attribute("aria-invalid", "true")
    expect()(page.locator("#run")).to_be_enabled()
    shot(page, "5-bad-limit")
    # Fixing the field clears the mark on the next run.
    page.fill("#limit-memoryMb", "64")
    page.fill("#code", "print('fits')\n")
    out = run_and_wait(page)
    assert out["outcome"] == "completed", out
    assert page.get_attribute("#limit-memoryMb", "aria-invalid") is None


def test_lost_websocket_frames_are_recovered_from_the_event_log(page: Any, stack: Stack) -> None:
    """A frame that never arrives leaves a gap: the page fills it from the SSE log, in order, once."""
    dropped: list[str] = []

    def relay(ws: Any) -> None:
        server = ws.connect_to_server()
        ws.on_message(server.send)

        def to_page(message: str | bytes) -> None:
            text = message if isinstance(message, str) else message.decode()
            if '"event":"stdout"' in text and "one" in text and not dropped:
                dropped.append(text)  # lose this one
                return
            ws.send(message)
            if '"event":"std' in text:
                ws.send(message)  # and deliver every other output frame twice

        server.on_message(to_page)

    page.route_web_socket(re.compile(r"^ws://"), relay)
    open_playground(page, stack)
    page.fill("#code", "import time\nfor word in ('one', 'two', 'three'):\n    print(word)\n    time.sleep(0.3)\n")
    result = run_and_wait(page)
    assert dropped, "the test did not drop a frame"
    assert result["outcome"] == "completed", result
    assert result["output"].startswith("one\ntwo\nthree\n"), result["output"]
    assert result["output"].count("two") == 1
    stats = page.evaluate("window.coderunnerPlayground.stats")
    assert stats["eventLogFallbacks"] == 1 and stats["statusPolls"] == 0, stats
    shot(page, "6-gap-filled-from-log")


def test_without_realtime_the_event_log_carries_the_run(page: Any, stack: Stack) -> None:
    """soketi unreachable: the page starts anyway and follows the SSE log, input included."""
    without_realtime(page, stack)
    open_playground(page, stack)
    page.click("#run")
    output = page.locator("#output")
    expect()(output).to_contain_text("What is your name?", timeout=RUN_TIMEOUT_MS)
    expect()(output).to_contain_text("following the event log")
    page.fill("#stdin-line", "Grace")
    page.press("#stdin-line", "Enter")
    expect()(output).to_contain_text("Hello, Grace!")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "completed")
    stats = page.evaluate("window.coderunnerPlayground.stats")
    assert stats["eventLogFallbacks"] == 1 and stats["statusPolls"] == 0, stats
    shot(page, "7-no-realtime")


def test_limits_are_sent_and_the_limit_that_fired_is_named(page: Any, stack: Stack) -> None:
    open_playground(page, stack)
    page.fill("#limit-idleMs", "1000")
    # The sample waits for a name; nobody types: the idle clock ends it.
    result = run_and_wait(page)
    assert result["outcome"] == "idle_timed_out", result
    assert "killed by the idle limit" in result["text"] and "SIGKILL" in result["text"], result
    assert "What is your name?" in result["output"]
    shot(page, "8-idle-limit")


def test_fast_typing_past_the_stdin_rate_is_retried_not_lost(page: Any, stack: Stack) -> None:
    """More lines than the 30 frames/s cap allows: the page waits retryAfterMs and resends."""
    open_playground(page, stack)
    page.fill(
        "#code", "import sys\nlines = sys.stdin.readlines()\nprint(len(lines), 'lines, last', lines[-1].strip())\n"
    )
    page.click("#run")
    expect()(page.locator("#status")).to_contain_text("running", timeout=RUN_TIMEOUT_MS)
    page.evaluate("""() => {
        const line = document.getElementById("stdin-line"), form = document.getElementById("stdin-form");
        for (let i = 0; i < 45; i++) { line.value = "line " + i; form.requestSubmit(); }
    }""")
    page.click("#eof")
    output = page.locator("#output")
    expect()(output).to_contain_text("45 lines, last line 44")
    expect()(output).to_contain_text("retrying in")
    assert page.locator("#output .note").count() == 1  # said once, not per line
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "completed")
    shot(page, "9-stdin-rate-retried")


def _run_typing(page: Any, stack: Stack, code: str, typing: str, eof: bool = False) -> tuple[str, list[str]]:
    """Run `code`, submit the stdin lines the JavaScript `typing` gives `type(line)` at once
    (then EOF), and wait for it to complete: its stdout and the page's notes."""
    open_playground(page, stack)
    page.fill("#code", code)
    page.click("#run")
    expect()(page.locator("#status")).to_contain_text("running", timeout=RUN_TIMEOUT_MS)
    page.evaluate("""(typing) => {
        const line = document.getElementById("stdin-line"), form = document.getElementById("stdin-form");
        const type = (text) => { line.value = text; form.requestSubmit(); };
        new Function("type", typing)(type);
    }""", typing)
    if eof:
        page.click("#eof")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "completed", timeout=RUN_TIMEOUT_MS)
    stdout = "".join(page.eval_on_selector_all("#output .stdout", "s => s.map(x => x.textContent)"))
    return stdout, page.eval_on_selector_all("#output .note", "s => s.map(x => x.textContent)")


def test_input_typed_ahead_past_the_pending_cap_waits_and_goes_in_order(page: Any, stack: Stack) -> None:
    """A program that has not read yet: what waits for it is capped (64 KiB, a 429 with
    capBytes). That is a wait, not an end: every line goes once the program reads, in order,
    and the EOF after them."""
    code = "import sys, time\ntime.sleep(1.5)\ndata = sys.stdin.read()\nprint(len(data), data.count('\\n'), data.rsplit('|', 1)[1].strip())\n"
    stdout, notes = _run_typing(page, stack, code, "for (let i = 0; i < 20; i++) type(String(i % 10).repeat(8000) + '|line-' + i);", eof=True)
    assert stdout == "160170 20 line-19\n", (stdout, notes)  # (the pipe holds 64 KiB, then 64 KiB may wait)
    assert any("the program is not reading its input yet" in n for n in notes), notes
    shot(page, "12-stdin-waits-for-the-program")


def test_a_pasted_line_longer_than_may_wait_at_once_goes_in_pieces(page: Any, stack: Stack) -> None:
    """One line over the 64 KiB that may wait for a program (a paste) is a 429 with capBytes
    however often it is sent: the page sends it in pieces of at most that, in order, never
    cutting a character, and the program reads the line whole."""
    code = "import sys\nline = sys.stdin.readline()\nprint(len(line), len(line.encode()), line.count('é'), line[-3:-1])\n"
    # 100,004 characters (its newline included), 150,005 bytes: pieces end beside two-byte 'é's.
    stdout, notes = _run_typing(page, stack, code, "type('aé'.repeat(50000) + 'a' + 'éz');")
    assert stdout == "100004 150005 50001 éz\n", (stdout, notes)
    assert not any("not sent" in n for n in notes), notes
    shot(page, "16-pasted-long-line")


def test_a_line_whose_answer_was_lost_is_sent_again_and_stored_once(page: Any, stack: Stack) -> None:
    """The first stdin request reaches the server, its answer does not (a dropped
    connection): the page sends it again under the same Idempotency-Key, and the program
    reads the line once."""
    lost: list[str] = []

    def lose_first_answer(route: Any) -> None:
        if not lost:
            route.fetch()  # (the server has it)
            lost.append(route.request.headers.get("idempotency-key", ""))
            route.abort("connectionreset")
            return
        route.continue_()

    page.route(re.compile(r"/stdin$"), lose_first_answer)
    open_playground(page, stack)
    page.fill("#code", "import sys\nfor line in sys.stdin:\n    print('echo:' + line, end='')\nprint('eof')\n")
    page.click("#run")
    expect()(page.locator("#status")).to_contain_text("running", timeout=RUN_TIMEOUT_MS)
    for text in ("first", "second"):
        page.fill("#stdin-line", text)
        page.press("#stdin-line", "Enter")
    page.click("#eof")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "completed", timeout=RUN_TIMEOUT_MS)
    stdout = "".join(page.eval_on_selector_all("#output .stdout", "s => s.map(x => x.textContent)"))
    assert stdout == "echo:first\necho:second\neof\n", stdout
    assert lost and lost[0].startswith("pg-"), lost
    shot(page, "13-stdin-answer-lost-resent")


def test_lost_tail_of_a_run_is_noticed_by_its_silence(page: Any, stack: Stack) -> None:
    """Live delivery loses every frame after the first line, result included (no gap to see):
    the page asks the job's status after a few silent seconds and takes the rest from the log."""
    seen_first: list[bool] = []

    def relay(ws: Any) -> None:
        server = ws.connect_to_server()
        ws.on_message(server.send)

        def to_page(message: str | bytes) -> None:
            text = message if isinstance(message, str) else message.decode()
            if seen_first and ('"event":"std' in text or '"event":"result"' in text):
                return
            if '"event":"stdout"' in text and "first" in text:
                seen_first.append(True)
            ws.send(message)

        server.on_message(to_page)

    page.route_web_socket(re.compile(r"^ws://"), relay)
    open_playground(page, stack)
    page.fill("#code", "import time\nprint('first')\ntime.sleep(0.3)\nprint('last')\n")
    result = run_and_wait(page, timeout_ms=15000)
    assert seen_first
    assert result["outcome"] == "completed", result
    assert result["output"] == "first\nlast\n", result["output"]
    stats = page.evaluate("window.coderunnerPlayground.stats")
    assert stats["eventLogFallbacks"] == 1 and stats["statusPolls"] == 0, stats


def test_narrow_window_stacks_the_panels_without_overlap(page: Any, stack: Stack) -> None:
    """On a phone-sized window the panels stack in one column and nothing overlaps (the
    limits form once spilled over the output)."""
    page.set_viewport_size({"width": 390, "height": 844})
    open_playground(page, stack)
    page.click("#run")
    expect()(page.locator("#output")).to_contain_text("What is your name?", timeout=RUN_TIMEOUT_MS)
    page.fill("#stdin-line", "Ada")
    page.press("#stdin-line", "Enter")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "completed")
    order = ["#code", "#limits", "#output", "#stdin-line", "#result"]
    boxes = {sel: page.locator(sel).bounding_box() for sel in order}
    for upper, lower in itertools.pairwise(order):
        assert boxes[upper]["y"] + boxes[upper]["height"] <= boxes[lower]["y"] + 1, (upper, lower, boxes)
    for sel, box in boxes.items():
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390 + 1, (sel, box)
    shot(page, "11-narrow-window")


# A page of another origin that holds a job token (its backend made the job): it starts the
# job, feeds its stdin and follows its event log, all straight against the API.
_CROSS_ORIGIN_PAGE = b"""<!doctype html><meta charset="utf-8"><pre id="out"></pre><p id="end"></p><script>
const params = new URLSearchParams(location.hash.slice(1));
const api = params.get("api"), job = params.get("job"), token = params.get("token");
const auth = {Authorization: "Bearer " + token};
(async () => {
  try {
    const started = await fetch(`${api}/v1/jobs/${job}/start`, {method: "POST", headers: auth});
    await fetch(`${api}/v1/jobs/${job}/stdin`, {method: "POST", headers: {...auth, "Content-Type": "application/json"},
                                               body: JSON.stringify({chunk: "Ada\\n"})});
    const log = new EventSource(`${api}/v1/jobs/${job}/events?token=${encodeURIComponent(token)}`);
    log.addEventListener("stdout", (e) => { document.getElementById("out").textContent += JSON.parse(e.data).chunk; });
    log.addEventListener("result", (e) => {
      log.close();
      document.getElementById("end").textContent = started.status + " " + JSON.parse(e.data).outcome;
    });
    log.onerror = () => { if (log.readyState === EventSource.CLOSED) document.getElementById("end").textContent = "refused"; };
  } catch (exc) {
    document.getElementById("end").textContent = "refused";
  }
})();
</script>"""


def _serve_page(body: bytes) -> tuple[Any, str]:
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_page_of_an_allowed_origin_runs_a_job_with_its_token(browser: Any, make_stack: Any) -> None:
    from tests.helpers import Api, py_job

    allowed, allowed_origin = _serve_page(_CROSS_ORIGIN_PAGE)
    other, other_origin = _serve_page(_CROSS_ORIGIN_PAGE)
    try:
        stack = make_stack(CORS_ALLOW_ORIGINS=allowed_origin, WORKER_MAX_SANDBOXES="2")
        api = Api(stack)
        try:
            # Only the job API answers other origins: not /metrics or /health.
            origin = {"Origin": allowed_origin}
            assert api.client.get("/v1/realtime", headers=origin).headers["access-control-allow-origin"] == allowed_origin
            for path in ("/metrics", "/health"):
                assert "access-control-allow-origin" not in api.client.get(path, headers=origin).headers, path
            outcomes = {}
            for origin in (allowed_origin, other_origin):
                job = api.execute(py_job('print(f"Hello, {input()}!")\n'))
                context = browser.new_context()
                try:
                    page = context.new_page()
                    page.goto(f"{origin}/#api={stack.api_url}&job={job['jobId']}&token={job['jobToken']}")
                    expect()(page.locator("#end")).not_to_have_text("", timeout=20000)
                    outcomes[origin] = (page.inner_text("#end"), page.inner_text("#out"))
                finally:
                    context.close()
                if origin == other_origin:
                    # Refused by the browser: the job never started.
                    assert api.status(job)["state"] in ("queued", "parked"), api.status(job)
                    api.post(f"/v1/jobs/{job['jobId']}/kill")
        finally:
            api.close()
    finally:
        allowed.shutdown()
        other.shutdown()
    assert outcomes[allowed_origin] == ("202 completed", "Hello, Ada!\n"), outcomes
    assert outcomes[other_origin][0] == "refused", outcomes


def first_time(answer: Callable[[Any], None], seen: list[str]) -> Callable[[Any], None]:
    """A route handler: the first request matched gets `answer`, later ones go through;
    `seen` collects the URL of the one answered."""

    def handle(route: Any) -> None:
        if not seen:
            seen.append(route.request.url)
            answer(route)
        else:
            route.continue_()

    return handle


def test_a_program_that_leaves_a_file_finishes_at_once_and_links_it(page: Any, stack: Stack) -> None:
    """An `artifact` event the page did not know held the result behind its seq: 4.5 s late,
    a false "stream was lost" in red, and no sign of the file."""
    open_playground(page, stack)
    page.fill("#code", 'open("out.txt", "w").write("hi from a file")\nprint("done")\n')
    result = run_and_wait(page)
    assert result["outcome"] == "completed" and "done" in result["output"], result
    assert page.locator("#output .note.bad").count() == 0, result["output"]
    stats = page.evaluate("window.coderunnerPlayground.stats")
    assert stats["eventLogFallbacks"] == 0 and stats["statusPolls"] == 0, stats
    link = page.locator("#output a", has_text="out.txt")
    expect()(link).to_have_count(1)
    href = link.get_attribute("href")
    assert href is not None and href.startswith("/v1/jobs/"), href
    assert page.evaluate("(u) => fetch(u).then((r) => r.text())", href) == "hi from a file"
    shot(page, "14-artifact")


def test_a_start_that_fails_once_is_sent_again(page: Any, stack: Stack) -> None:
    """Start is idempotent: a network error (or a 503 while Redis blinks) is retried; once
    meant a job parked until its warm-up ran out, then `expired`."""
    failed: list[str] = []
    page.route(re.compile(r".*/v1/jobs/[0-9a-f]+/start$"), first_time(lambda route: route.abort(), failed))
    open_playground(page, stack)
    page.fill("#code", 'print("started after all")\n')
    result = run_and_wait(page)
    assert failed and result["outcome"] == "completed" and "started after all" in result["output"], result


def test_stop_pressed_while_the_run_is_still_being_submitted_kills_it(page: Any, stack: Stack) -> None:
    """Stop did nothing until the execute was answered (seconds, while the server asks for
    a retry), and the job then ran anyway."""
    busy = {"error": "queue is full", "details": [], "retryAfterMs": 1500}
    page.route(re.compile(r".*/v1/execute$"), first_time(lambda route: route.fulfill(status=429, json=busy), []))
    open_playground(page, stack)
    page.fill("#code", "import time\nwhile True:\n    time.sleep(1)\n")
    page.click("#run")
    expect()(page.locator("#status")).to_contain_text("retrying")
    assert page.is_disabled("#stdin-line") and page.is_disabled("#run")
    page.click("#stop")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "killed", timeout=RUN_TIMEOUT_MS)


def test_an_event_log_refused_once_is_opened_again(page: Any, stack: Stack) -> None:
    """Without the WebSocket the event log is the output's only way in: one 503 from it
    (every stream slot busy) used to leave the run to status polls, its output unseen."""
    without_realtime(page, stack)
    refused: list[str] = []
    full = {"error": "All event streams are in use", "details": [], "retryAfterMs": 1000}
    page.route(re.compile(r".*/v1/jobs/[0-9a-f]+/events\?.*"), first_time(lambda route: route.fulfill(status=503, json=full), refused))
    open_playground(page, stack)
    page.fill("#code", 'print("hello through the log")\n')
    result = run_and_wait(page)
    assert refused and result["outcome"] == "completed", result
    assert "hello through the log" in result["output"], result["output"]
    stats = page.evaluate("window.coderunnerPlayground.stats")
    assert stats["eventLogFallbacks"] == 1 and stats["statusPolls"] == 0, stats  # (a reopen is the same fallback)


def test_enter_in_a_limit_field_runs_with_that_limit(page: Any, stack: Stack) -> None:
    """The limits form's submit handler never fired: a form of six fields and no submit
    button does not submit on Enter."""
    open_playground(page, stack)
    page.fill("#limit-idleMs", "1000")
    page.press("#limit-idleMs", "Enter")
    expect()(page.locator("#result")).to_have_attribute("data-outcome", "idle_timed_out", timeout=RUN_TIMEOUT_MS)


def test_eof_from_the_keyboard_leaves_focus_on_the_output(page: Any, stack: Stack) -> None:
    """Ctrl+D disabled the focused input line: focus fell to the page's body."""
    open_playground(page, stack)
    page.click("#run")
    expect()(page.locator("#output")).to_contain_text("What is your name?", timeout=RUN_TIMEOUT_MS)
    page.focus("#stdin-line")
    page.press("#stdin-line", "Control+d")
    expect()(page.locator("#output")).to_be_focused()
    expect()(page.locator("#result")).to_have_attribute("data-outcome", re.compile(r"\w"), timeout=RUN_TIMEOUT_MS)
