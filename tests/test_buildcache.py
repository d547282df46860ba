"""The build cache (worker/isolation/buildcache.py): what a worker compiles at start-up is
made once per host, and a cached file is used only if nobody but this user could have
written it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.manifest import CompilerArchive, PrestartCache, parse_manifest
from shared.paths import REPO_ROOT
from worker.isolation.buildcache import BuildCache
from worker.isolation.sandbox import (
    GATE_SOURCE,
    ShimCompiler,
    _compile,
    build_compiled_shims,
    build_enter,
    build_gate,
    build_prestart_caches,
)

NOBODY = 65534


def _work_root(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    (root / ".gate").mkdir(parents=True)
    return root


@pytest.fixture
def roots(tmp_path: Path) -> Iterator[list[Path]]:
    """Two work roots (two deployments on one host); their gate tmpfs unmounted afterwards."""
    made = [_work_root(tmp_path, "first"), _work_root(tmp_path, "second")]
    yield made
    for root in made:
        if os.path.ismount(root / ".gate"):
            subprocess.run(["umount", "--lazy", str(root / ".gate")], check=True)


def _no_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record (and refuse) every process a build would start from here on."""
    started: list[tuple[Any, ...]] = []

    async def refused(*argv: Any, **_kwargs: Any) -> Any:
        started.append(argv)
        raise OSError("no builds here")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", refused)
    return started


def test_a_kept_file_comes_back_whole_with_its_mode(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache" / "nested")
    built = tmp_path / "built"
    built.write_bytes(b"\x7fELF and the rest")
    assert not cache.fetch("tool-1", tmp_path / "out", 0o755)  # nothing kept yet
    cache.keep("tool-1", built)
    folder = tmp_path / "cache" / "nested"
    assert folder.stat().st_mode & 0o777 == 0o700  # made for this user only
    assert (folder / "tool-1").stat().st_mode & 0o777 == 0o600
    assert cache.fetch("tool-1", tmp_path / "out", 0o755)
    assert (tmp_path / "out").read_bytes() == built.read_bytes()
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built", "cache", "out"]  # no temporaries left


@pytest.mark.parametrize("how", ["folder writable by a group", "folder owned by another user", "folder is a link"])
def test_a_cache_folder_others_could_write_to_is_not_used(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    (folder / "tool-1").write_bytes(b"planted")
    os.chmod(folder / "tool-1", 0o600)
    if how == "folder writable by a group":
        os.chmod(folder, 0o770)
    elif how == "folder owned by another user":
        os.chown(folder, NOBODY, NOBODY)
    else:
        folder.rename(tmp_path / "real")
        folder.symlink_to(tmp_path / "real")
    cache = BuildCache(folder)
    assert not cache.fetch("tool-1", tmp_path / "out", 0o755)
    assert not (tmp_path / "out").exists()
    built = tmp_path / "built"
    built.write_bytes(b"mine")
    cache.keep("tool-2", built)  # nothing goes into it either
    assert not (folder / "tool-2").exists()


@pytest.mark.parametrize("how", ["writable by its group", "writable by anyone", "owned by another user", "a link"])
def test_a_cached_file_others_could_have_written_is_not_used(tmp_path: Path, how: str) -> None:
    cache = BuildCache(tmp_path / "cache")
    built = tmp_path / "built"
    built.write_bytes(b"genuine")
    cache.keep("tool-1", built)
    kept = tmp_path / "cache" / "tool-1"
    if how == "writable by its group":
        os.chmod(kept, 0o620)
    elif how == "writable by anyone":
        os.chmod(kept, 0o602)
    elif how == "owned by another user":
        os.chown(kept, NOBODY, NOBODY)
    else:
        kept.unlink()
        kept.symlink_to(built)
    assert not cache.fetch("tool-1", tmp_path / "out", 0o755)
    assert not (tmp_path / "out").exists()


def test_a_read_only_cache_is_read_and_never_fails_a_start(tmp_path: Path) -> None:
    # A host whose /var/cache is read-only to the worker (a systemd ProtectSystem=strict
    # unit, a container's read-only root): what is there is used, nothing new is kept, and
    # neither raises (keeping used to fail the start on its clean-up's unlink, EROFS).
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "cachefs", str(ro)], check=True)
    try:
        cache = BuildCache(ro / "cache")
        built = tmp_path / "built"
        built.write_bytes(b"kept while writable")
        cache.keep("tool-1", built)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        late = BuildCache(ro / "cache")  # (a worker started after the remount)
        assert late.fetch("tool-1", tmp_path / "out", 0o755)
        assert (tmp_path / "out").read_bytes() == b"kept while writable"
        late.keep("tool-2", built)
        assert not late.fetch("tool-2", tmp_path / "out2", 0o755)
        assert not (ro / "cache" / "tool-2").exists()
    finally:
        subprocess.run(["umount", "--lazy", str(ro)], check=True)


def test_builds_nobody_used_for_a_month_and_crash_leftovers_are_pruned(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "cache")
    built = tmp_path / "built"
    built.write_bytes(b"x")
    for name in ("used-lately", "used-long-ago", "fetched-today"):
        cache.keep(name, built)
    folder = tmp_path / "cache"
    (folder / ".kept-half-way.abc").write_bytes(b"cut off")
    (folder / ".keeping-now.def").write_bytes(b"being written")
    now = time.time()
    for name, age_s in [
        ("used-lately", 29 * 86400),
        ("used-long-ago", 31 * 86400),
        ("fetched-today", 40 * 86400),
        (".kept-half-way.abc", 2 * 3600),
        (".keeping-now.def", 10),
    ]:
        os.utime(folder / name, (now - age_s, now - age_s))
    assert cache.fetch("fetched-today", tmp_path / "out", 0o755)  # a use renews it
    assert sorted(cache.prune()) == [".kept-half-way.abc", "used-long-ago"]
    assert sorted(p.name for p in folder.iterdir()) == [".keeping-now.def", "fetched-today", "used-lately"]
    # A folder that is not the worker's alone is left as it is.
    os.utime(folder / "used-lately", (now - 90 * 86400, now - 90 * 86400))
    os.chmod(folder, 0o770)
    assert BuildCache(folder).prune() == []
    assert (folder / "used-lately").exists()


async def test_the_c_helpers_are_compiled_once_per_host(
    tmp_path: Path, roots: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = BuildCache(tmp_path / "cache")
    first, second = roots
    gate = await build_gate(first, cache)
    enter = await build_enter(first, cache)
    started = _no_builds(monkeypatch)
    # Another deployment's worker: the same binaries, and no compiler started.
    assert (await build_gate(second, cache)).read_bytes() == gate.read_bytes()
    enter_again = await build_enter(second, cache)
    assert enter_again.read_bytes() == enter.read_bytes() and os.access(enter_again, os.X_OK)
    assert started == []
    # Without the cache, that deployment would have compiled them.
    with pytest.raises(OSError, match="no builds here"):
        await _compile(GATE_SOURCE, tmp_path / "third", "gate")


async def test_a_helper_the_cache_holds_only_a_tampered_copy_of_is_compiled_again(
    tmp_path: Path, roots: list[Path]
) -> None:
    cache = BuildCache(tmp_path / "cache")
    first, second = roots
    gate = await _compile(GATE_SOURCE, first, "gate", cache)
    kept = tmp_path / "cache" / gate.name.lstrip(".")
    kept.write_bytes(b"#!/bin/sh\necho planted\n")
    os.chown(kept, NOBODY, NOBODY)
    again = await _compile(GATE_SOURCE, second, "gate", cache)
    assert again.read_bytes() == gate.read_bytes()


async def test_prestart_caches_and_compiled_shims_are_made_once_per_host(
    tmp_path: Path, roots: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pdir = tmp_path / "profiles"
    (pdir / "prestart").mkdir(parents=True)
    (pdir / "prestart" / "s.py").write_text("pass\n")
    (pdir / "prestart" / "Shim.src").write_text("shim source\n")
    copy = PrestartCache(file="s.pyc", make=["/bin/sh", "-c", 'cp "$0" "$1"', "{shim}", "{out}"])
    # A compile that makes two files, and the compiler archive its manifest names.
    script = 'cp "$0" A.class; echo b > B.class; echo archive > "$1"'
    archive = CompilerArchive(path="/.coderunner/archive.jsa", make=["{archive}"])
    compiler = ShimCompiler(["/bin/sh", "-c", script, "{entry}", "/.coderunner/archive.jsa"], 256, "1", archive)
    cache = BuildCache(tmp_path / "cache")
    first, second = roots

    made = await build_prestart_caches(pdir, first, {"s.py": (copy, "1")}, cache=cache)
    builds = await build_compiled_shims(pdir, first, {"Shim.src": compiler}, cache=cache)
    assert sorted(name for name, _ in builds.files["Shim.src"]) == ["A.class", "B.class"]
    assert len(builds.compile_mounts) == 1
    started = _no_builds(monkeypatch)
    made_again = await build_prestart_caches(pdir, second, {"s.py": (copy, "1")}, cache=cache)
    builds_again = await build_compiled_shims(pdir, second, {"Shim.src": compiler}, cache=cache)
    assert started == []
    assert made_again["s.py"][1].read_bytes() == made["s.py"][1].read_bytes() == b"pass\n"
    assert made_again["s.py"][1].parent == second / ".gate"
    assert builds_again.files == builds.files
    host_archive = Path(builds_again.compile_mounts[0].partition(":")[0])
    assert host_archive.parent == second and host_archive.read_text() == "archive\n"


async def test_a_compiled_shim_kept_half_way_is_compiled_again(tmp_path: Path, roots: list[Path]) -> None:
    # A worker stopped while it kept a build: the list of its files goes last, so the files
    # already kept are never taken for the whole build.
    pdir = tmp_path / "profiles"
    (pdir / "prestart").mkdir(parents=True)
    (pdir / "prestart" / "Shim.src").write_text("shim source\n")
    compiler = ShimCompiler(["/bin/sh", "-c", 'cp "$0" A.class; echo b > B.class', "{entry}"], 256, "1")
    cache = BuildCache(tmp_path / "cache")
    first, second = roots
    builds = await build_compiled_shims(pdir, first, {"Shim.src": compiler}, cache=cache)
    listing = next((tmp_path / "cache").glob("prestart-build-*-files"))
    listing.unlink()
    next((tmp_path / "cache").glob("prestart-build-*-B.class")).unlink()
    again = await build_compiled_shims(pdir, second, {"Shim.src": compiler}, cache=cache)
    assert again.files == builds.files  # compiled, whole
    assert listing.exists()  # and kept again


async def test_the_java_shim_from_the_cache_is_the_one_javac_made(
    tmp_path: Path, roots: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = parse_manifest((REPO_ROOT / "sandbox-profiles" / "languages" / "java.toml").read_text(), "java.toml")
    if manifest.prestart is None or manifest.compile is None:
        pytest.skip("java.toml prestarts no compiled shim")
    from shared.limits import COMPILE_DEFAULTS, with_overrides

    compiler = ShimCompiler(
        manifest.compile.argv,
        with_overrides(COMPILE_DEFAULTS, manifest.compile.limits).memory_mb,
        "test",
        manifest.compile.archive,
    )
    cache = BuildCache(tmp_path / "cache")
    first, second = roots
    pdir = REPO_ROOT / "sandbox-profiles"
    builds = await build_compiled_shims(pdir, first, {manifest.prestart: compiler}, cache=cache)
    assert builds.files[manifest.prestart], "javac made nothing"
    started = _no_builds(monkeypatch)
    again = await build_compiled_shims(pdir, second, {manifest.prestart: compiler}, cache=cache)
    assert started == []
    assert again.files == builds.files
    assert [m.partition(":")[2] for m in again.compile_mounts] == [m.partition(":")[2] for m in builds.compile_mounts]
