"""Language manifests: the data in `sandbox-profiles/languages/*.toml`, parsed and checked.

Nothing about a language is hard-coded in Python; a manifest says how to probe the
version, which file names to expect, how to compile and run, what extra read-only paths
the toolchain needs, and the language's default limits.

Placeholders in argv templates:
    {entry}     the first submitted file (the program's entry point)
    {sources}   every submitted file whose name ends with one of `source_extensions`
                (expands to several arguments)
    {args}      the request's `args` (run only; expands to several arguments)
    {memoryMb}, {heapMb}   the job's memory limit, and 60 % of it (for -Xmx and similar)
"""

from __future__ import annotations

import tomllib
from typing import Annotated

import msgspec

from shared.errors import ManifestError
from shared.limits import RequestedLimits

__all__ = ["PLACEHOLDERS", "CompileStep", "Manifest", "expand_argv", "parse_manifest"]

PLACEHOLDERS = ("{entry}", "{sources}", "{args}", "{memoryMb}", "{heapMb}")

NonEmptyArgv = Annotated[list[str], msgspec.Meta(min_length=1)]


class CompileStep(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    argv: NonEmptyArgv
    limits: RequestedLimits = RequestedLimits()
    # Compiler output beyond this is dropped (with a marker) from events and the result.
    output_kb: int = 64
    # Extra environment for the compiler only.
    env: dict[str, str] = {}


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    language: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9+#._-]{0,31}$")]
    aliases: list[str] = []
    interactive: bool = True
    source_file: str
    source_extensions: list[str] = []
    version_probe: NonEmptyArgv
    # Regular expression with one group that extracts the version from the probe's output.
    version_pattern: str
    run: NonEmptyArgv
    compile: CompileStep | None = None
    env: dict[str, str] = {}
    # Extra read-only bind mounts (host path, same path inside), beyond the base profile's.
    mounts: list[str] = []
    limits: RequestedLimits = RequestedLimits()
    # Seccomp/profile knobs a runtime needs; the base profile applies when empty.
    profile: str = "base"

    @property
    def compiled(self) -> bool:
        return self.compile is not None

    @property
    def names(self) -> list[str]:
        return [self.language, *self.aliases]


def parse_manifest(text: str, origin: str) -> Manifest:
    """Parse one manifest file's text.

    Raises:
        ManifestError: naming the origin and the problem.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{origin}: not valid TOML: {exc}") from None
    try:
        manifest = msgspec.convert(data, Manifest)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{origin}: {exc}") from None
    for template in (manifest.run, manifest.compile.argv if manifest.compile else []):
        for item in template:
            if "{" in item and item not in PLACEHOLDERS and not _only_known(item):
                raise ManifestError(f"{origin}: unknown placeholder in {item!r}")
    if "/" in manifest.source_file or manifest.source_file.startswith("."):
        raise ManifestError(f"{origin}: source_file must be a plain file name")
    return manifest


def _only_known(item: str) -> bool:
    rest = item
    for placeholder in ("{entry}", "{memoryMb}", "{heapMb}"):
        rest = rest.replace(placeholder, "")
    return "{" not in rest and "}" not in rest


def expand_argv(
    template: list[str],
    *,
    entry: str,
    sources: list[str],
    args: list[str],
    memory_mb: int,
) -> list[str]:
    """Fill a manifest argv template; list placeholders expand in place."""
    heap_mb = max(16, memory_mb * 6 // 10)
    out: list[str] = []
    for item in template:
        if item == "{sources}":
            out.extend(sources)
        elif item == "{args}":
            out.extend(args)
        else:
            out.append(
                item.replace("{entry}", entry)
                .replace("{memoryMb}", str(memory_mb))
                .replace("{heapMb}", str(heap_mb))
            )
    return out
