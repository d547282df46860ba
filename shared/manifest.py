"""Language manifests: the data in `sandbox-profiles/languages/*.toml`, parsed and checked.

Nothing about a language is hard-coded in Python; a manifest says where the toolchain
is, how to probe its version, which file names to expect, how to compile and run, what
extra read-only paths and environment it needs, and its default run and compile limits.

Placeholders:
    {home}        the toolchain folder printed by `home_probe` (anywhere: argv, env, mounts,
                  version_probe); for toolchains that do not live under /usr
    {entry}       the program's entry point: the submitted file named `source_file` (main.py,
                  Main.java...), else the first submitted file (Manifest.entry_of)
    {entryStem}   {entry} without its extension (a Java class name)
    {sources}     every submitted file ending in one of `source_extensions` (several arguments)
    {args}        the request's `args` (run only; several arguments)
    {memoryMb}, {heapMb}   the step's memory limit, and 60 % of it (for -Xmx and similar)

Mount entries are `path` (same path inside the jail) or `host_path:jail_path`.
"""

from __future__ import annotations

import re
import tomllib
from typing import Annotated

import msgspec

from shared.errors import ManifestError
from shared.limits import RequestedLimits

__all__ = [
    "PRESTART_DIR_IN_JAIL",
    "CompileStep",
    "HeapLimit",
    "Manifest",
    "PrestartCache",
    "compiled_shim_name",
    "entry_of",
    "expand_argv",
    "interpreter_prefix",
    "names_compiled_shim",
    "parse_manifest",
    "prestart_argv_for",
    "with_home",
]

SCALARS = ("{entry}", "{entryStem}", "{memoryMb}", "{heapMb}", "{home}")
PRESTART_CACHE_PLACEHOLDERS = ("{shim}", "{out}", "{inJail}", "{home}")
LISTS = ("{sources}", "{args}")
_PLACEHOLDER = re.compile(r"\{[A-Za-z]+\}")

NonEmptyArgv = Annotated[list[str], msgspec.Meta(min_length=1)]


class CompilerArchive(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A file of the compiler's own start-up state (a JVM's class-data archive) that the
    worker makes once at start-up, by compiling the language's prestart shim with `make`
    added to the compile command ({archive}: where to write it), and binds read-only at
    `path` in compile jails. The compile command names `path` itself; a compiler that finds
    no usable file there must go on without it (the JVM does, silently)."""

    path: Annotated[str, msgspec.Meta(pattern=r"^/\.coderunner/[A-Za-z0-9._-]{1,64}$")]
    make: NonEmptyArgv


class PrestartCache(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The prestart shim in a form its runtime loads without compiling it (CPython's
    bytecode), made once at worker start-up by running `make` on the host with the
    language's own toolchain, in a folder of its own holding a copy of the shim. {shim} is
    that copy, {out} where to write (`file`, in the same folder), {inJail} the path the
    source has in the jail (for the names the file records). A warm jail then
    starts the runtime on `file`, bound at PRESTART_DIR_IN_JAIL in the source's stead; if
    `make` fails, warm jails start on the source as before."""

    file: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,32}\.[a-z]{1,4}$")]
    make: NonEmptyArgv

    def argv(self, shim: str, in_jail: str) -> list[str]:
        """`make` for the shim at `shim`, writing `file` (both paths as the command runs)."""
        values = {"{shim}": shim, "{out}": self.file, "{inJail}": in_jail}
        return [_PLACEHOLDER.sub(lambda m: values.get(m.group(0), m.group(0)), item) for item in self.make]


class CompileStep(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    argv: NonEmptyArgv
    # Limits of the compile step (its own clocks and cgroup); unset fields take the
    # platform's compile defaults.
    limits: RequestedLimits = RequestedLimits()
    # Compiler output beyond this is dropped (with a marker) from events and the result.
    output_kb: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    # Environment for the compiler only (on top of the manifest's `env`).
    env: dict[str, str] = {}
    archive: CompilerArchive | None = None


class HeapLimit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the runtime ends a program that filled the heap `run` caps below memoryMb (JVM
    -Xmx, V8 --max-old-space-size): it gives up by itself, before the cgroup would kill it,
    with one of `messages` among the last words on stderr and this exit code or signal.
    Judged `memory_exceeded` (a program that says the same and ends the same way is judged
    the same: it can only mislabel its own run)."""

    messages: Annotated[list[Annotated[str, msgspec.Meta(min_length=8)]], msgspec.Meta(min_length=1)]
    exit_code: int | None = None
    signal: str | None = None

    def ran_out(self, exit_code: int | None, signal: str | None, stderr_tail: bytes) -> bool:
        if self.exit_code is not None and exit_code != self.exit_code:
            return False
        if self.signal is not None and signal != self.signal:
            return False
        return any(message.encode() in stderr_tail for message in self.messages)


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    language: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9+#._-]{0,31}$")]
    aliases: list[str] = []
    interactive: bool = True
    source_file: str
    source_extensions: list[str] = []
    # Optional: prints the toolchain folder, which becomes {home}.
    home_probe: list[str] = []
    # Extra PATH entries for the probes (host side, e.g. where rustup puts its proxies).
    probe_path: list[str] = []
    version_probe: NonEmptyArgv
    # Regular expression with one group that extracts the version from the probe's output.
    version_pattern: str
    run: NonEmptyArgv
    compile: CompileStep | None = None
    env: dict[str, str] = {}
    mounts: list[str] = []
    limits: RequestedLimits = RequestedLimits()
    # A shim in sandbox-profiles/prestart/ that lets a warm jail hold this language's
    # runtime already started (the interpreter part of `run`, before {entry}, plus the shim)
    # until the job's start; see prestart_argv_for.
    prestart: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,32}\.[a-z]{1,4}$")] | None = None
    prestart_cache: PrestartCache | None = None
    heap_limit: HeapLimit | None = None

    @property
    def compiled(self) -> bool:
        return self.compile is not None

    @property
    def names(self) -> list[str]:
        return [self.language, *self.aliases]


PRESTART_DIR_IN_JAIL = "/.coderunner/prestart"


def interpreter_prefix(argv: list[str], entry: str) -> list[str] | None:
    """The part of an expanded `run` argv before the entry file, or None without one."""
    try:
        return argv[: argv.index(entry)]
    except ValueError:
        return None


def prestart_argv_for(run: list[str], shim: str, memory_mb: int, compiled: bool = False) -> list[str] | None:
    """What a warm jail starts for a language with a prestart shim, or None if it cannot.

    It is `run` up to the entry file, expanded for `memory_mb`, plus the shim: the runtime
    is the very one (same binary, same options) the job's own command would start, and a
    job adopts it only if its own expanded command starts with the same prefix. The shim is
    the file bound at PRESTART_DIR_IN_JAIL; for a compiled language it was compiled like a
    job's entry file, and `run` names it as it names a compiled entry (Java: its class).
    """
    marker = "\x00entry"
    argv = expand_argv(run, entry=marker, sources=[], args=[], memory_mb=memory_mb)
    prefix = interpreter_prefix(argv, marker)
    if not prefix:
        return None
    if compiled:
        named = expand_argv(run, entry=shim, sources=[], args=[], memory_mb=memory_mb)
        return [*prefix, named[len(prefix)]]
    return [*prefix, f"{PRESTART_DIR_IN_JAIL}/{shim}"]


def compiled_shim_name(manifest: Manifest) -> str | None:
    """The name a compiled prestart shim is started by, as `run` names a compiled entry
    (Java: its class); None for a language whose shim is not compiled."""
    if manifest.prestart is None or manifest.compile is None:
        return None
    return manifest.prestart.rpartition(".")[0]


def names_compiled_shim(manifest: Manifest, files: list[tuple[str, bytes]]) -> bool:
    """Whether a job's files name the class of its language's compiled prestart shim.

    A warm runtime has loaded that class before the job's own (Java: in the same application
    class loader), so a class of the job's with that name would resolve to the shim's. Such
    a job runs in a plain jail, where its own class is the only one of that name.
    """
    name = compiled_shim_name(manifest)
    if name is None:
        return False
    wanted = name.encode()
    return any(wanted in data or (b"\\u" in data and wanted in _unicode_unescaped(data)) for _, data in files)


# Java reads `\uXXXX` (any number of u) as that character anywhere in a source, names
# included: `\u0043oderunnerPrestart` is the shim's class too. (Taken as an escape even after
# another backslash, where Java would not: that errs towards a plain jail, which is harmless.)
_UNICODE_ESCAPE = re.compile(rb"\\u+([0-9a-fA-F]{4})")


def _unicode_unescaped(data: bytes) -> bytes:
    return _UNICODE_ESCAPE.sub(lambda m: chr(int(m[1], 16)).encode("utf-8", "surrogatepass"), data)


def _check_templates(manifest: Manifest, origin: str) -> None:
    templates: list[tuple[str, list[str]]] = [("run", manifest.run), ("version_probe", manifest.version_probe)]
    if manifest.compile is not None:
        templates.append(("compile.argv", manifest.compile.argv))
    for where, template in templates:
        for item in template:
            if item in LISTS:
                continue
            for found in _PLACEHOLDER.findall(item):
                if found not in SCALARS:
                    raise ManifestError(f"{origin}: unknown placeholder {found} in {where}")
    cache = manifest.prestart_cache
    if cache is not None:
        if manifest.prestart is None:
            raise ManifestError(f"{origin}: prestart_cache needs a prestart shim")
        if cache.file == manifest.prestart:
            raise ManifestError(f"{origin}: prestart_cache.file must differ from the prestart shim's name")
        for item in cache.make:
            for found in _PLACEHOLDER.findall(item):
                if found not in PRESTART_CACHE_PLACEHOLDERS:
                    raise ManifestError(f"{origin}: unknown placeholder {found} in prestart_cache.make")


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
    _check_templates(manifest, origin)
    if "/" in manifest.source_file or manifest.source_file.startswith("."):
        raise ManifestError(f"{origin}: source_file must be a plain file name")
    heap = manifest.heap_limit
    if heap is not None and heap.exit_code is None and heap.signal is None:
        # Words alone would take any ending for a heap that ran out, an exit 0 included.
        raise ManifestError(f"{origin}: heap_limit must name the exit_code or the signal the runtime ends with")
    try:
        re.compile(manifest.version_pattern)
    except re.error as exc:
        raise ManifestError(f"{origin}: version_pattern is not a regular expression: {exc}") from None
    return manifest


def with_home(manifest: Manifest, home: str) -> Manifest:
    """The manifest with {home} filled in everywhere it may appear."""

    def fill(items: list[str]) -> list[str]:
        return [item.replace("{home}", home) for item in items]

    compile_step = manifest.compile
    if compile_step is not None:
        compile_step = msgspec.structs.replace(
            compile_step,
            argv=fill(compile_step.argv),
            env={k: v.replace("{home}", home) for k, v in compile_step.env.items()},
        )
    cache = manifest.prestart_cache
    if cache is not None:
        cache = msgspec.structs.replace(cache, make=fill(cache.make))
    return msgspec.structs.replace(
        manifest,
        prestart_cache=cache,
        run=fill(manifest.run),
        version_probe=fill(manifest.version_probe),
        mounts=fill(manifest.mounts),
        env={k: v.replace("{home}", home) for k, v in manifest.env.items()},
        compile=compile_step,
    )


def entry_of(manifest: Manifest, names: list[str]) -> str:
    """The program's entry file among the submitted `names`: the manifest's `source_file`
    when one of them is exactly that (the seed product always ran it, wherever it was
    listed), else the first."""
    return manifest.source_file if manifest.source_file in names else names[0]


def expand_argv(
    template: list[str],
    *,
    entry: str,
    sources: list[str],
    args: list[str],
    memory_mb: int,
) -> list[str]:
    """Fill a manifest argv template; list placeholders expand in place."""
    stem = entry.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    scalars = {
        "{entry}": entry,
        "{entryStem}": stem,
        "{memoryMb}": str(memory_mb),
        "{heapMb}": str(max(16, memory_mb * 6 // 10)),
    }
    out: list[str] = []
    for item in template:
        if item == "{sources}":
            out.extend(sources)
        elif item == "{args}":
            out.extend(args)
        else:
            out.append(_PLACEHOLDER.sub(lambda m: scalars.get(m.group(0), m.group(0)), item))
    return out
