"""The IDE path as a person feels it: click Run → first output line visible, in headless Chromium.

It starts a private stack, opens the playground through the link `coderunner up` prints,
puts a one-line program in the editor and clicks Run N times. The page itself measures
(performance.now(), a MutationObserver on the output):

    click→first line    the Run click … the first complete stdout line is in the page's DOM
    click→painted       … the frame that shows it (the next animation frame) has started
    click→result        … the result line is filled in

Each run goes through everything a browser does: POST /v1/execute, the pusher-js
subscription and its channel auth, POST /start, the WebSocket events, rendering.

    .venv/bin/python bench/ide_browser.py                 # 30 runs of python print("hello")
    .venv/bin/python bench/ide_browser.py -n 100 --language c --json bench/results/ide.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import pct
from launcher.stack import Stack

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium tries to reach outside hosts.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip

PROGRAMS = {
    "python": 'print("hello")\n',
    "javascript": 'console.log("hello");\n',
    "bash": "echo hello\n",
    "ruby": 'puts "hello"\n',
    "c": '#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello" << std::endl; }\n',
    "go": 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n',
    "rust": 'fn main() { println!("hello"); }\n',
    "java": 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n',
}

# Installed before the page's own scripts run: a capture-phase click listener (fires before
# the Run button's handler) and an observer that notes when the output and result change.
PROBE = """
(() => {
  const probe = window.__ideProbe = { runs: [] };
  let cur = null;
  document.addEventListener("click", (e) => {
    if (e.target && e.target.id === "run" && !e.target.disabled) { cur = { click: performance.now() }; probe.runs.push(cur); }
  }, true);
  const check = () => {
    if (!cur) return;
    if (cur.firstLine === undefined) {
      const out = document.querySelector("#output .stdout");
      if (out && out.textContent.includes("\\n")) {
        cur.firstLine = performance.now();
        const run = cur;
        requestAnimationFrame(() => { run.painted = performance.now(); });
      }
    }
    if (cur.result === undefined) {
      const result = document.getElementById("result");
      if (result && result.dataset.outcome) { cur.result = performance.now(); cur.outcome = result.dataset.outcome; }
    }
  };
  new MutationObserver(check).observe(document, { subtree: true, childList: true, characterData: true, attributes: true });
})();
"""


def series(values: list[float]) -> dict[str, float]:
    return {
        "min_ms": round(min(values), 1),
        "p50_ms": round(pct(values, 50), 1),
        "p90_ms": round(pct(values, 90), 1),
        "max_ms": round(max(values), 1),
    }


def bench(stack: Stack, language: str, n: int, warmup: int, headless: bool) -> dict[str, list[float]]:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=headless, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.add_init_script(PROBE)
            page.goto(f"{stack.api_url}/#token={stack.api_token}")
            expect(page.locator("#status")).to_have_text("ready", timeout=15000)
            page.select_option("#language", language)
            page.fill("#code", PROGRAMS[language])
            for i in range(n + warmup):
                page.click("#run")
                expect(page.locator("#result")).to_have_attribute("data-outcome", "completed", timeout=60000)
                page.wait_for_function(
                    "() => { const r = window.__ideProbe.runs.at(-1); return r && r.painted !== undefined; }"
                )
                stdout = "".join(page.eval_on_selector_all("#output .stdout", "s => s.map(x => x.textContent)"))
                if stdout != "hello\n":
                    raise SystemExit(
                        f"run {i} misbehaved: {page.inner_text('#output')!r} {page.inner_text('#result')!r}"
                    )
            runs = page.evaluate("window.__ideProbe.runs")[warmup:]
            stats = page.evaluate("window.coderunnerPlayground.stats")
        finally:
            browser.close()
    if stats.get("eventLogFallbacks") or stats.get("statusPolls"):
        print(f"note: some runs needed the event-log fallback: {stats}")
    return {
        "click_to_first_line": [r["firstLine"] - r["click"] for r in runs],
        "click_to_painted": [r["painted"] - r["click"] for r in runs],
        "click_to_result": [r["result"] - r["click"] for r in runs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=30, help="measured runs (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="runs before measuring (default 3)")
    parser.add_argument("--language", default="python", choices=sorted(PROGRAMS), help="default python")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--headed", action="store_true", help="show the browser (needs a display)")
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install chromium (scripts/bootstrap.sh --test does)")

    stack = Stack(extra_env={"LOG_LEVEL": "WARNING"})
    stack.start()
    try:
        measured = bench(stack, args.language, args.n, args.warmup, headless=not args.headed)
    finally:
        stack.cleanup()

    figures: dict[str, object] = {"runs": args.n, "language": args.language, "program": PROGRAMS[args.language]}
    print(f"{args.language}: {args.n} runs in headless Chromium (after {args.warmup} warm-up runs)")
    print(f"{'series':<22}{'min ms':>10}{'p50 ms':>10}{'p90 ms':>10}{'max ms':>10}")
    for name, values in measured.items():
        s = series(values)
        figures[name] = s
        print(f"{name:<22}{s['min_ms']:>10}{s['p50_ms']:>10}{s['p90_ms']:>10}{s['max_ms']:>10}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
