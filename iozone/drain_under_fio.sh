#!/bin/bash
# How fast `rfs drain` empties a data node holding 1 GiB while fio writes and verifies on two
# mounts (issue 40's goal: at least 150 MiB/s, fio verify passing, no io_errors, nothing lost
# once the node is killed). Release builds, tcp on loopback.
#
#   bash iozone/drain_under_fio.sh [GIB]        (default 1)
#
# A metadata node that lends nothing (--memory 0, --manual-rebalance), data node A fills with
# GIB of files at one copy, data node B joins empty; then two mounts run fio (random 64K
# writes with crc32c verify, 3 passes over 128 MiB each) while A is drained to B. Prints the
# drain's time and rate, fio's verdicts and io_errors, then kills A and checks every file.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ]; then
  sed -n '2,11p' "$0"
  exit 0
fi
GIB=${1:-1}
BIN=target/release
PORT=${RFS_PORT:-7493}
WORK=$(mktemp -d /tmp/rfs-drain.XXXXXX)
pids=()
cleanup() {
  for m in "$WORK"/a "$WORK"/b "$WORK"/c; do
    [ -d "$m" ] && { fusermount3 -u "$m" 2>/dev/null || true; }
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

node() { # name args...
  local name=$1
  shift
  "${MEM_SERVER:-$BIN/mem-server}" --transport tcp "$@" >"$WORK/$name.log" 2>&1 &
  pids+=($!)
  eval "${name}_pid=$!"
}
wait_port() {
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2
  exit 1
}
joined() { # port: until the metadata node lists that data node up
  for _ in $(seq 600); do
    "$BIN/rfs" status "127.0.0.1:$PORT" --json --transport tcp 2>/dev/null |
      grep -q "\"address\":\"127.0.0.1:$1\",\"state\":\"up\"" && return 0
    sleep 0.1
  done
  echo "data node on $1 did not join" >&2
  exit 1
}
mount_at() {
  mkdir -p "$WORK/$1"
  "$BIN/fs-client" "127.0.0.1:$PORT" "$WORK/$1" -o transport=tcp >"$WORK/client-$1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do
    mountpoint -q "$WORK/$1" && return 0
    sleep 0.05
  done
  echo "mount $1 did not appear" >&2
  exit 1
}

# (Nodes from before --manual-rebalance never rebalanced by themselves.)
manual=$("${MEM_SERVER:-$BIN/mem-server}" --help | grep -q -- --manual-rebalance && echo --manual-rebalance || true)
node meta --listen "127.0.0.1:$PORT" --memory 0 $manual
wait_port "$PORT"
node a --listen 127.0.0.1:$((PORT + 1)) --memory $((GIB * 1024 + 512))M --join "127.0.0.1:$PORT"
joined $((PORT + 1))
mount_at a
mkdir "$WORK/a/data"
for i in $(seq 1 $((GIB * 16))); do
  head -c 64M /dev/urandom >"$WORK/a/data/f$i"
done
sync
(cd "$WORK/a/data" && md5sum f* >"$WORK/sums")
node b --listen 127.0.0.1:$((PORT + 2)) --memory $((GIB * 1024 + 1024))M --join "127.0.0.1:$PORT"
joined $((PORT + 2))
mount_at b
fio_on() { # mount: a file of its own (both mounts show one file system)
  fio --name="verify-$1" --directory="$WORK/$1" --size=128M --bs=64k --rw=randwrite \
    --verify=crc32c --do_verify=1 --verify_fatal=1 --loops=3 --ioengine=psync \
    --output="$WORK/fio-$1.out" >/dev/null 2>&1
}
fio_on a &
fa=$!
fio_on b &
fb=$!
sleep 1
start=$(date +%s.%N)
"$BIN/rfs" drain "127.0.0.1:$PORT" "127.0.0.1:$((PORT + 1))" --transport tcp --no-wait >"$WORK/drain.out"
# Looked at every 0.1 s (rfs drain itself looks once a second).
until "$BIN/rfs" status "127.0.0.1:$PORT" --json --transport tcp |
  grep -q "\"address\":\"127.0.0.1:$((PORT + 1))\",\"state\":\"draining\"[^}]*\"copies\":0,"; do
  sleep 0.1
done
end=$(date +%s.%N)
fio_a=0
fio_b=0
wait "$fa" || fio_a=$?
wait "$fb" || fio_b=$?
secs=$(echo "$end - $start" | bc -l)
printf 'drained %d GiB in %.1f s: %.0f MiB/s under fio on two mounts\n' "$GIB" "$secs" \
  "$(echo "$GIB * 1024 / $secs" | bc -l)"
echo "fio verify: mount a exit $fio_a, mount b exit $fio_b"
for m in a b; do
  if grep -qiE "err=|verify|bad" "$WORK/fio-$m.out" && [ "$([ $m = a ] && echo $fio_a || echo $fio_b)" != 0 ]; then
    grep -iE "err=|verify|bad|error" "$WORK/fio-$m.out" | head -20 | sed "s/^/fio $m: /"
    grep -hE "WARN|ERROR" "$WORK/client-$m.log" | tail -20 | sed "s/^/client $m: /"
  fi
done
for m in a b; do
  grep -h "^io_errors" "$WORK/$m/.rfs-stats" | sed "s/^/mount $m: /"
done
kill "$a_pid"
mount_at c
if (cd "$WORK/c/data" && md5sum --quiet -c "$WORK/sums"); then
  echo "after killing the drained node: all $((GIB * 16)) files whole"
else
  echo "after killing the drained node: files differ" >&2
  exit 1
fi
