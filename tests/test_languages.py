"""Every language end to end through the API: hello world, stdin, a runtime error with its
exit code, and (compiled languages) a compile error."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from shared.manifest import expand_argv
from shared.paths import REPO_ROOT
from tests.helpers import Api, Realtime, pids_with_cmdline
from worker.runtimes import load_manifests

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

LANGUAGES: dict[str, dict[str, Any]] = {
    "python": {
        "file": "main.py",
        "hello": "print('Hello, world!')\n",
        "echo": "import sys\nfor line in sys.stdin:\n    print('got', line.strip())\n",
        "crash": "import sys\nprint('before', flush=True)\nraise ValueError('boom')\n",
        "crash_exit": 1,
        "crash_stderr": "ValueError: boom",
    },
    "javascript": {
        "file": "main.js",
        "hello": "console.log('Hello, world!');\n",
        "echo": "for (const l of require('fs').readFileSync(0, 'utf8').split('\\n').filter(Boolean)) console.log('got', l);\n",
        "crash": "console.log('before');\nthrow new Error('boom');\n",
        "crash_exit": 1,
        "crash_stderr": "Error: boom",
    },
    "c": {
        "file": "main.c",
        "hello": '#include <stdio.h>\nint main(void) { puts("Hello, world!"); return 0; }\n',
        "echo": '#include <stdio.h>\n#include <string.h>\nint main(void) { char b[256];\n'
        '  while (fgets(b, sizeof b, stdin)) { b[strcspn(b, "\\n")] = 0; printf("got %s\\n", b); } return 0; }\n',
        "crash": '#include <stdio.h>\n#include <stdlib.h>\nint main(void) { puts("before"); fflush(stdout);\n'
        '  fprintf(stderr, "boom\\n"); exit(42); }\n',
        "crash_exit": 42,
        "crash_stderr": "boom",
        "broken": "int main(void) { return 0 }\n",
        "broken_says": "error",
    },
    "cpp": {
        "file": "main.cpp",
        "hello": '#include <iostream>\nint main() { std::cout << "Hello, world!" << std::endl; }\n',
        "echo": '#include <iostream>\n#include <string>\nint main() { std::string l;\n'
        '  while (std::getline(std::cin, l)) std::cout << "got " << l << "\\n"; }\n',
        "crash": '#include <iostream>\n#include <stdexcept>\nint main() { std::cout << "before" << std::endl;\n'
        '  throw std::runtime_error("boom"); }\n',
        "crash_signal": "SIGABRT",
        "crash_stderr": "boom",
        "broken": "int main() { undeclared(); }\n",
        "broken_says": "undeclared",
    },
    "rust": {
        "file": "main.rs",
        "hello": 'fn main() { println!("Hello, world!"); }\n',
        "echo": "use std::io::BufRead;\nfn main() { for l in std::io::stdin().lock().lines() { println!(\"got {}\", l.unwrap()); } }\n",
        "crash": 'fn main() { println!("before"); panic!("boom"); }\n',
        "crash_exit": 101,
        "crash_stderr": "boom",
        "broken": 'fn main() { let x: i32 = "text"; }\n',
        "broken_says": "mismatched types",
    },
    "java": {
        "file": "Main.java",
        "hello": 'public class Main { public static void main(String[] a) { System.out.println("Hello, world!"); } }\n',
        "echo": "import java.io.*;\npublic class Main { public static void main(String[] a) throws IOException {\n"
        '  BufferedReader r = new BufferedReader(new InputStreamReader(System.in)); String l;\n'
        '  while ((l = r.readLine()) != null) System.out.println("got " + l); } }\n',
        "crash": 'public class Main { public static void main(String[] a) { System.out.println("before");\n'
        '  throw new IllegalStateException("boom"); } }\n',
        "crash_exit": 1,
        "crash_stderr": "IllegalStateException: boom",
        "broken": "public class Main { public static void main(String[] a) { int x = 1 } }\n",
        "broken_says": "error",
    },
    "bash": {
        "file": "main.sh",
        "hello": "echo 'Hello, world!'\n",
        "echo": 'while read -r l; do echo "got $l"; done\n',
        "crash": "echo before\necho boom >&2\nexit 7\n",
        "crash_exit": 7,
        "crash_stderr": "boom",
    },
    "go": {
        "file": "main.go",
        "hello": 'package main\nimport "fmt"\nfunc main() { fmt.Println("Hello, world!") }\n',
        "echo": 'package main\nimport ("bufio"; "fmt"; "os")\n'
        'func main() { s := bufio.NewScanner(os.Stdin); for s.Scan() { fmt.Println("got", s.Text()) } }\n',
        "crash": 'package main\nimport "fmt"\nfunc main() { fmt.Println("before"); panic("boom") }\n',
        "crash_exit": 2,
        "crash_stderr": "panic: boom",
        "broken": "package main\nfunc main() { x := 1 }\n",
        "broken_says": "declared",
    },
    # The seed product's `sqlite`: main.sql on an in-memory database; stdin is data the
    # script reads itself; the first error ends it with exit code 1.
    "sqlite": {
        "file": "main.sql",
        "hello": "SELECT 'Hello, world!';\n",
        "echo": "CREATE TABLE t(line TEXT);\n.import /dev/stdin t\nSELECT 'got ' || line FROM t;\n",
        "crash": "SELECT 'before';\nSELECT * FROM missing_table;\nSELECT 'after';\n",
        "crash_exit": 1,
        "crash_stderr": "no such table: missing_table",
    },
    "ruby": {
        "file": "main.rb",
        "hello": "puts 'Hello, world!'\n",
        "echo": "STDIN.each_line { |l| puts \"got #{l.strip}\" }\n",
        "crash": "puts 'before'\nSTDOUT.flush\nraise 'boom'\n",
        "crash_exit": 1,
        "crash_stderr": "boom",
    },
}


def run(api: Api, realtime: Realtime, language: str, code: str, stdin: str | None = None) -> tuple[dict, Any]:  # type: ignore[type-arg]
    spec = LANGUAGES[language]
    body: dict[str, Any] = {"language": language, "files": [{"name": spec["file"], "content": code}], "collectOutput": True}
    if stdin is not None:
        body["stdin"] = stdin
    job = api.execute(body)
    followed = realtime.follow(job)
    api.start(job)
    followed.wait_result(timeout_s=90)
    response = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"})
    assert response.status_code == 200, response.text
    return response.json(), followed


def test_languages_endpoint_lists_every_runtime(api: Api) -> None:
    listed = {entry["language"]: entry for entry in api.get("/v1/languages").json()}
    assert set(LANGUAGES) <= set(listed), f"missing runtimes: {set(LANGUAGES) - set(listed)}"
    for name, spec in LANGUAGES.items():
        assert listed[name]["version"][0].isdigit(), listed[name]
        assert listed[name]["compiled"] == ("broken" in spec), name


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_hello_world(api: Api, realtime: Realtime, language: str) -> None:
    out, followed = run(api, realtime, language, LANGUAGES[language]["hello"])
    assert out["outcome"] == "completed", out
    assert out["exitCode"] == 0 and out["signal"] is None
    assert out["stdout"] == "Hello, world!\n"
    # The pulled result carries the result event's fields, its seq too (SPEC: RunResult).
    assert out["seq"] == next(p["seq"] for n, p in followed.events if n == "result")
    phases = [p["phase"] for n, p in sorted(followed.events, key=lambda e: e[1]["seq"]) if n == "stage"]
    if "broken" in LANGUAGES[language]:
        assert phases[-2:] == ["compiling", "running"]
        assert out["compile"]["exitCode"] == 0 and out["compile"]["timedOut"] is False
        assert out["compile"]["durationMs"] > 0
    else:
        assert phases[-1] == "running" and "compiling" not in phases
        assert out["compile"] is None


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_the_main_file_is_the_entry_wherever_it_is_listed(api: Api, realtime: Realtime, language: str) -> None:
    # The seed product ran its manifest's main file (main.py, Main.java...) whatever the
    # order of `files`; its clients may list a data file or a module first.
    spec = LANGUAGES[language]
    files = [{"name": "notes.txt", "content": "not a program\n"}, {"name": spec["file"], "content": spec["hello"]}]
    job = api.execute({"language": language, "files": files})
    followed = realtime.follow(job)
    api.start(job)
    out = followed.wait_result(timeout_s=90)
    assert out["outcome"] == "completed" and out["exitCode"] == 0, out
    assert followed.text("stdout") == "Hello, world!\n"


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_reads_stdin(api: Api, realtime: Realtime, language: str) -> None:
    out, _ = run(api, realtime, language, LANGUAGES[language]["echo"], stdin="alpha\nbeta\n")
    assert out["outcome"] == "completed", out
    assert out["stdout"] == "got alpha\ngot beta\n"


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_runtime_error_reports_its_exit_code(api: Api, realtime: Realtime, language: str) -> None:
    spec = LANGUAGES[language]
    out, _ = run(api, realtime, language, spec["crash"])
    assert out["outcome"] == "completed", out  # the program ended by itself, badly
    assert out["stdout"].startswith("before")
    assert spec["crash_stderr"] in out["stderr"]
    if "crash_signal" in spec:
        assert out["exitCode"] is None and out["signal"] == spec["crash_signal"]
    else:
        assert out["exitCode"] == spec["crash_exit"] and out["signal"] is None


@pytest.mark.parametrize("language", sorted(name for name, spec in LANGUAGES.items() if "broken" in spec))
def test_compile_error(api: Api, realtime: Realtime, language: str) -> None:
    spec = LANGUAGES[language]
    out, followed = run(api, realtime, language, spec["broken"])
    assert out["outcome"] == "compile_error", out
    compile_block = out["compile"]
    assert compile_block["exitCode"] not in (0, None) and compile_block["timedOut"] is False
    assert spec["broken_says"] in compile_block["output"]
    assert out["exitCode"] is None and out["stdout"] == "" and out["durationMs"] == 0
    ordered = sorted(followed.events, key=lambda e: e[1]["seq"])
    phases = [p["phase"] for n, p in ordered if n == "stage"]
    assert "compiling" in phases and "running" not in phases  # the run never started
    live_output = "".join(p["chunk"] for n, p in ordered if n == "compile_output")
    assert live_output == compile_block["output"]
    assert api.status(followed.job)["state"] == "done"
    # The pullable result also has each stream apart, as the seed's CompileResult does; the
    # interleaved log is both of them together.
    assert spec["broken_says"] in compile_block["stdout"] + compile_block["stderr"]
    assert sorted(compile_block["output"]) == sorted(compile_block["stdout"] + compile_block["stderr"])
    # The published result (and the status) keep to the interleaved log.
    published = followed.results()[0]["compile"]
    assert "stdout" not in published and "stderr" not in published
    assert published["output"] == compile_block["output"]


@pytest.mark.parametrize("language", ["bash", "python"])
def test_a_program_opens_its_own_stdio_by_name(api: Api, realtime: Realtime, language: str) -> None:
    # `echo x > /dev/stderr`, `cat /dev/stdin`, open("/dev/stdin"): the jail had no such names,
    # and its stdio pipes (the worker's, mode 0600) could not be opened again through
    # /proc/self/fd even so.
    body = {
        "bash": "cat /dev/stdin\necho to-stderr > /dev/stderr\necho to-stdout > /dev/stdout\ncat < /dev/fd/0\n",
        "python": "print(open('/dev/stdin').read(), end='')\nopen('/dev/stderr', 'w').write('to-stderr\\n')\n"
        "open('/proc/self/fd/1', 'w').write('to-stdout\\n')\n",
    }[language]
    job = api.execute({"language": language, "files": [{"name": "main." + ("sh" if language == "bash" else "py"), "content": body}],
                       "stdin": "line one\n", "collectOutput": True})  # fmt: skip
    api.start(job)
    out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "30000"}).json()
    assert (out["outcome"], out["exitCode"]) == ("completed", 0), out
    assert out["stdout"] == "line one\nto-stdout\n" and out["stderr"] == "to-stderr\n", out


def test_javac_starts_from_the_archive_the_worker_made(stack: Stack, api: Api, realtime: Realtime, tmp_path: Path) -> None:
    """The worker archives javac's classes at start-up (while it compiles Java's prestart
    shim) and binds the archive into compile jails; javac run with the manifest's own
    options maps it, which takes a compile from about 1.0 s of CPU to 0.7 s. The VM says
    nothing when it cannot use an archive, so this asks it."""
    archives = sorted(Path(f"/run/{stack.deployment}").glob(".compiler-archive-*"))
    assert len(archives) == 1 and archives[0].stat().st_size > 1 << 20, archives
    manifest = {m.language: m for m in load_manifests(REPO_ROOT / "sandbox-profiles")}["java"]
    assert manifest.compile is not None and manifest.compile.archive is not None
    jail_path = manifest.compile.archive.path
    (tmp_path / "Main.java").write_text("public class Main { public static void main(String[] a) {} }\n")
    argv = expand_argv(manifest.compile.argv, entry="Main.java", sources=["Main.java"], args=[], memory_mb=768)
    argv = [item.replace(jail_path, str(archives[0])) for item in argv]
    said = subprocess.run([argv[0], "-J-Xlog:cds=info", *argv[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert said.returncode == 0, said.stderr
    assert f"Opened archive {archives[0]}" in said.stdout, said.stdout[-2000:]

    # A job's compile jail has it bound where the manifest's command looks.
    bind = f"{archives[0]}:{jail_path}".encode()
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(pids_with_cmdline(b"nsjail", bind))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out, followed = run(api, realtime, "java", LANGUAGES["java"]["hello"])
    finally:
        done.set()
        watcher.join()
    assert followed.text("stdout") == "Hello, world!\n" and out["compile"]["output"] == "", out
    assert seen, "no compile jail had the archive bound"
