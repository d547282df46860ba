#!/usr/bin/env bash
# Install whatever this machine lacks to run (and test) coderunner. Idempotent: every step
# checks first, so a second run costs a few stat calls. Debian/Ubuntu, run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# --- system packages -------------------------------------------------------------------
apt_missing=()
command -v redis-server >/dev/null 2>&1 || apt_missing+=(redis-server)
command -v node >/dev/null 2>&1 || apt_missing+=(nodejs npm)
# Toolchains of the languages in sandbox-profiles/languages (a missing one is simply not
# offered; these are the ones this project installs and tests).
command -v go >/dev/null 2>&1 || apt_missing+=(golang-go)
command -v ruby >/dev/null 2>&1 || apt_missing+=(ruby)
command -v javac >/dev/null 2>&1 || apt_missing+=(default-jdk-headless)
command -v g++ >/dev/null 2>&1 || apt_missing+=(g++)
# The worker compiles its tiny jail gate (worker/gate.c) once at start-up.
command -v cc >/dev/null 2>&1 || apt_missing+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -f /usr/lib/aarch64-linux-gnu/libc.a ] || apt_missing+=(libc6-dev)
if [ ${#apt_missing[@]} -gt 0 ]; then
    say "installing ${apt_missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
fi
# Debian's redis-server package starts a system-wide instance; coderunner runs its own.

# --- Python environment ---------------------------------------------------------------
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.coderunner-installed
extras=""
[ $want_test = 1 ] && extras="[test]"
if [ ! -f "$stamp$extras" ] || [ pyproject.toml -nt "$stamp$extras" ]; then
    say "installing the coderunner package$extras into .venv"
    if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e ".$extras"; } >.venv/install.log 2>&1; then
        tail -30 .venv/install.log >&2
        echo "pip install failed (full log: .venv/install.log)" >&2
        exit 1
    fi
    touch "$stamp$extras"
fi

# --- soketi and pusher-js (npm, into folders of this repo) ----------------------------
npm_install() {
    local dir=$1
    if [ ! -d "$dir/node_modules" ] || [ "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
        say "installing npm packages in $dir"
        (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    fi
}
npm_install realtime
npm_install clients/js
npm_install tests/seed_clients

# --- nsjail cgroup parents -------------------------------------------------------------
# The worker creates its own per-job cgroups under these at start-up; nsjail's default
# parents are created too so nsjail run by hand behaves the same.
for ctrl in memory pids cpu; do
    if [ -d "/sys/fs/cgroup/$ctrl" ] && [ ! -d "/sys/fs/cgroup/$ctrl/NSJAIL" ]; then
        mkdir -p "/sys/fs/cgroup/$ctrl/NSJAIL" 2>/dev/null || true
    fi
done
