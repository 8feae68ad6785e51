#!/bin/bash
# What mounts cost a metadata node in threads, and what a metadata call costs through a mount,
# for one or more mem-server binaries side by side (release builds; tcp on loopback).
#
#   bash iozone/node_threads.sh [MEM_SERVER ...]      (default: target/release/mem-server)
#
# For each binary: start a node, mount one client, time 2,000 creates and then 2,000 unlinks
# (python; each a metadata call to the node), then mount 29 more
# clients and print the node's threads with 1 and 30 mounts, and 15 s after the last one
# settled (a pool lets idle threads go after 10 s). Every mount and the node are gone after.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ]; then
  sed -n '2,10p' "$0"
  exit 0
fi
BINS=("$@")
[ ${#BINS[@]} -eq 0 ] && BINS=(target/release/mem-server)
CLIENT=target/release/fs-client
PORT=${RFS_PORT:-7491}
WORK=$(mktemp -d /tmp/rfs-threads.XXXXXX)
node=
cleanup() {
  for m in "$WORK"/m*; do
    [ -d "$m" ] && { fusermount3 -u "$m" 2>/dev/null || true; }
  done
  [ -n "$node" ] && { kill "$node" 2>/dev/null || true; wait "$node" 2>/dev/null || true; }
  rm -rf "$WORK"
}
trap cleanup EXIT

threads() { awk '/^Threads:/ {print $2}' "/proc/$1/status"; }

mount_one() {
  local m="$WORK/m$1"
  mkdir -p "$m"
  "$CLIENT" "127.0.0.1:$PORT" "$m" -o transport=tcp >"$WORK/client$1.log" 2>&1 &
  for _ in $(seq 200); do
    mountpoint -q "$m" && return 0
    sleep 0.05
  done
  echo "mount $1 did not appear" >&2
  cat "$WORK/client$1.log" >&2
  exit 1
}

unmount_all() {
  for m in "$WORK"/m*; do
    fusermount3 -u "$m" 2>/dev/null || true
  done
  sleep 0.5
}

for bin in "${BINS[@]}"; do
  "$bin" --listen "127.0.0.1:$PORT" --memory 256M --transport tcp >"$WORK/node.log" 2>&1 &
  node=$!
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
    sleep 0.1
  done
  mount_one 0
  timing=$(python3 - "$WORK/m0" <<'EOF'
import os, sys, time
d = os.path.join(sys.argv[1], "many")
os.mkdir(d)
t = time.perf_counter()
for i in range(2000):
    os.close(os.open(os.path.join(d, f"f{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
made = time.perf_counter() - t
t = time.perf_counter()
for i in range(2000):
    os.unlink(os.path.join(d, f"f{i}"))
removed = time.perf_counter() - t
print(f"{2000 / made:.0f} creates/s, {2000 / removed:.0f} unlinks/s")
EOF
)
  one=$(threads "$node")
  for i in $(seq 1 29); do mount_one "$i"; done
  for i in $(seq 0 29); do ls "$WORK/m$i" >/dev/null; done
  thirty=$(threads "$node")
  sleep 15
  idle=$(threads "$node")
  echo "$bin: $timing; node threads: 1 mount $one, 30 mounts $thirty, 30 idle mounts $idle"
  unmount_all
  kill "$node"
  wait "$node" 2>/dev/null || true
  node=
  rm -rf "$WORK"/m*
done
