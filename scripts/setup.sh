#!/bin/bash
# Installs everything this project needs on a fresh Debian (bookworm) machine, as root:
# build dependencies of libibverbs bindings, FUSE, the Soft-RoCE VM tools, and Debian's non-free
# component (for iozone3). Safe to run again: it only installs what is missing.
#
#   bash scripts/setup.sh            # building, running and testing
#   bash scripts/setup.sh --build    # building and running only (what scripts/install.sh needs)
set -euo pipefail
log() { printf '[setup] %s\n' "$*" >&2; }
export DEBIAN_FRONTEND=noninteractive

# Debian's non-free component (iozone3 lives there).
if [ -f /etc/apt/sources.list.d/debian.sources ] &&
   ! grep -q '^Components:.*non-free' /etc/apt/sources.list.d/debian.sources; then
  log "enabling the non-free component"
  sed -i '/^URIs: http:\/\/deb.debian.org\/debian$/,/^Components:/ s/^Components: main$/Components: main non-free/' \
    /etc/apt/sources.list.d/debian.sources
  touch /tmp/.rfs-apt-stale
fi

PKGS=(build-essential pkg-config cmake libclang-dev libnl-3-dev libnl-route-3-dev libibverbs-dev
      ibverbs-providers fuse3 libfuse3-dev)
[ "${1:-}" = --build ] || PKGS+=(fio qemu-system-x86 debootstrap cpio kmod python3 acl rsync)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})) || [ -f /tmp/.rfs-apt-stale ]; then
  log "apt-get install ${missing[*]:-(refreshing lists)}"
  apt-get update -qq
  rm -f /tmp/.rfs-apt-stale
  ((${#missing[@]})) && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust (https://rustup.rs) and run this again" >&2
  exit 1
fi
if command -v rustup >/dev/null; then
  rustup component add clippy rustfmt >/dev/null 2>&1 || true
fi
log "ready"
