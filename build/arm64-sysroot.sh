#!/usr/bin/env bash
# An arm64 Debian sysroot holding python3.11 and busybox, so that the suite can run dist/onbox-aarch64.pyz under
# qemu user mode (qemu-aarch64-static from build/sysdeps.sh, QEMU_LD_PREFIX=<sysroot>; binfmt is never registered).
#
#     bash build/arm64-sysroot.sh [DIR]      # default build/out/arm64-sysroot; `make arm64-sysroot` calls it
#
# The machine's apt state is never changed: rather than `dpkg --add-architecture arm64` (which every other apt
# user on the machine would see until it is removed again, and which a failure half-way would leave behind), apt
# runs with an arm64-only architecture list and its own lists, cache and (empty) status under DIR.apt, on the
# machine's own sources and keys (the package files are checked against the signed indexes as usual). Nothing is
# installed: each package is unpacked with `dpkg-deb -x` into a staging dir, which becomes DIR in one rename, with
# DIR/.installed (this script's hash) last. Idempotent: returns at once when DIR is complete and current.
set -euo pipefail

PACKAGES=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 zlib1g libexpat1 libffi8
          libssl3 libbz2-1.0 liblzma5 libuuid1 libcrypt1 busybox-static)

here="$(cd "$(dirname "$0")" && pwd)"
dest="${1:-$here/out/arm64-sysroot}"
case "$dest" in /*) ;; *) dest="$PWD/$dest" ;; esac  # apt reads a relative Dir:: option below its own dirs
digest="$(sha256sum "$0" | cut -d' ' -f1)"
if [ -f "$dest/.installed" ] && [ "$(cat "$dest/.installed")" = "$digest" ]; then
  exit 0
fi
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null 2>&1 || { echo "arm64-sysroot: $tool is missing (a Debian machine has it)" >&2; exit 3; }
done

apt_dir="$dest.apt"
stage="$dest.stage-$$"
cleanup() { rm -rf "$apt_dir" "$stage"; }
trap cleanup EXIT
rm -rf "$apt_dir" "$stage"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs" "$stage"
: > "$apt_dir/status"
apt_opts=(-q -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
          -o "Dir::State::status=$apt_dir/status" -o "APT::Architecture=arm64" -o "APT::Architectures::=arm64"
          -o "APT::Sandbox::User=$(id -un)")

echo "arm64-sysroot: fetching ${#PACKAGES[@]} arm64 packages into $dest"
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download "${PACKAGES[@]/%/:arm64}" >/dev/null)
for deb in "$apt_dir"/debs/*.deb; do
  dpkg-deb -x "$deb" "$stage"
done
[ -x "$stage/usr/bin/python3.11" ] && [ -x "$stage/bin/busybox" ] \
  || { echo "arm64-sysroot: the unpacked packages lack usr/bin/python3.11 or bin/busybox" >&2; exit 1; }
rm -rf "$dest"
mv "$stage" "$dest"
echo "$digest" > "$dest/.installed"
echo "arm64-sysroot: $(du -sh "$dest" | cut -f1) in $dest"
