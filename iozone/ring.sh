#!/bin/bash
# The ring (rfs-io) beside the mount, side by side with the mount itself and with bindfs over
# tmpfs, in one run: 4K random reads, 1 MiB sequential reads and writes; medians of ROUNDS.
#
#   sudo bash iozone/ring.sh [ROUNDS] [SECONDS]      (defaults: 3 rounds of 4 s each)
#
# Builds release binaries, starts a mem-server (1 GiB) and a mount on tcp over loopback, and
# removes everything at the end. Needs bindfs.
set -euo pipefail
ROUNDS=${1:-3}
SECS=${2:-4}
cd "$(dirname "$0")/.."
cargo build --release -q -p fs-client -p mem-server -p rfs-io
R=$PWD/target/release
W=$(mktemp -d /tmp/rfs-ring-bench.XXXXXX)
mkdir -p "$W/m" "$W/t" "$W/b"
MS=""
cleanup() {
  fusermount3 -u "$W/m" 2>/dev/null || true
  fusermount3 -u "$W/b" 2>/dev/null || true
  umount "$W/t" 2>/dev/null || true
  [ -n "$MS" ] && kill "$MS" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
mount -t tmpfs -o size=1200M tmpfs "$W/t"
bindfs "$W/t" "$W/b"
PORT=$((20000 + RANDOM % 10000))
"$R/mem-server" --listen 127.0.0.1:$PORT --memory 1G --transport tcp > "$W/ms.log" 2>&1 &
MS=$!
sleep 1
"$R/fs-client" 127.0.0.1:$PORT "$W/m" -o transport=tcp,ring="$W/ring.sock" > "$W/fc.log" 2>&1 &
for _ in $(seq 100); do mountpoint -q "$W/m" && break; sleep 0.1; done
sleep 0.5
dd if=/dev/urandom of="$W/m/f" bs=1M count=256 status=none
dd if="$W/m/f" of="$W/b/f" bs=1M status=none
run() { local label=$1 where=$2; shift 2
  echo "$label|$("$R/rfs-ring-bench" "$where" f "$@" --seconds "$SECS")"; }
for _ in $(seq "$ROUNDS"); do
  run "4K rand read 4 jobs: mount O_DIRECT" "$W/m" --via mount --direct on --jobs 4
  run "4K rand read 4 jobs: bindfs O_DIRECT" "$W/b" --via mount --direct on --jobs 4
  run "4K rand read: ring, depth 16 x 4 jobs" "$W/m" --via ring --depth 16 --jobs 4
  run "4K rand read: ring, depth 64 x 1 job" "$W/m" --via ring --depth 64 --jobs 1
  run "1M seq read: mount O_DIRECT" "$W/m" --via mount --direct on --bs 1M --pattern seq
  run "1M seq read: bindfs (tmpfs)" "$W/b" --via mount --bs 1M --pattern seq
  run "1M seq read: ring, depth 4" "$W/m" --via ring --bs 1M --pattern seq --depth 4
  run "1M seq write: mount O_DIRECT" "$W/m" --via mount --direct on --bs 1M --pattern seq --op write
  run "1M seq write: bindfs O_DIRECT" "$W/b" --via mount --direct on --bs 1M --pattern seq --op write
  run "1M seq write: ring, depth 4" "$W/m" --via ring --bs 1M --pattern seq --depth 4 --op write
done | python3 -c '
import re, statistics, sys
rows = {}
for line in sys.stdin:
    label, out = line.rstrip("\n").split("|", 1)
    m = re.search(r": ([\d.]+) MB/s, ([\d.]+) ops/s, ([\d.]+) us CPU/op", out)
    rows.setdefault(label, []).append(tuple(float(x) for x in m.groups()))
print("| what | MB/s (min-max) | ops/s | CPU us/op (host) |")
print("|---|---|---|---|")
for label, runs in rows.items():
    mb, ops, cpu = zip(*runs)
    print(f"| {label} | {statistics.median(mb):.0f} ({min(mb):.0f}-{max(mb):.0f}) | "
          f"{statistics.median(ops):.0f} | {statistics.median(cpu):.1f} |")
'
