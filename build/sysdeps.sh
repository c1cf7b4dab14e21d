#!/usr/bin/env bash
# Installs the system tools the tests and the demo use: OpenSSH, rsync, Slurm + munge, rclone, Debian's chromium
# with fonts (the dashboard's browser test drives it through Playwright: no browser is downloaded at test time),
# Debian's docker.io with the Python 3.11 packages the container tests' local image is made of (build/python_image.py;
# the tests start a private dockerd of their own: a system daemon that the package may start is not used),
# qemu-user-static (the aarch64 pyz runs under it, with build/arm64-sysroot.sh's Python), and e2fsprogs with
# mount (a loop-mounted ext4 volume: commits to a durable disk of its own, tests/hosts/blockfs.py), and Debian's
# prometheus with promtool (the tracker's /metrics scraped by a real Prometheus the test starts on loopback with its
# own config and data dir, and the example alert rules checked and fired: tests/hosts/prometheus.py; its packaged
# service is never used).
# Idempotent and quick when everything is present. Needs root (or sudo) only when something is missing.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v rclone >/dev/null 2>&1 || need+=(rclone)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v mount >/dev/null 2>&1 || need+=(mount)
command -v mkfs.ext4 >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.ext4 ] || need+=(e2fsprogs)
command -v fuser >/dev/null 2>&1 || need+=(psmisc)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || need+=(docker.io)
[ -x /usr/bin/python3.11 ] || need+=(python3.11-minimal)
[ -f /usr/lib/python3.11/json/__init__.py ] || need+=(libpython3.11-stdlib)
command -v fc-list >/dev/null 2>&1 || need+=(fontconfig)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
command -v qemu-aarch64-static >/dev/null 2>&1 || need+=(qemu-user-static)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
echo "sysdeps: installing ${need[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
