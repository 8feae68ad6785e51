#!/bin/bash
# The main job, from a fresh machine: set up, build, start a storage node (which also runs the
# metadata service) and mount it with fs-client. Stays in the foreground; Ctrl-C (or
# `fusermount3 -u $RFS_MOUNT` from another shell) unmounts and stops the node.
#
#   RFS_MEMORY=4G RFS_MOUNT=/mnt/rfs RFS_PORT=7470 RFS_TRANSPORT=auto bash scripts/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MEMORY=${RFS_MEMORY:-1G}
MOUNT=${RFS_MOUNT:-/mnt/rfs}
PORT=${RFS_PORT:-7470}
TRANSPORT=${RFS_TRANSPORT:-auto}

bash scripts/setup.sh
cargo build --release --workspace --bins

mkdir -p "$MOUNT"
./target/release/mem-server --listen "127.0.0.1:$PORT" --memory "$MEMORY" --transport "$TRANSPORT" &
server=$!
cleanup() {
  fusermount3 -u "$MOUNT" 2>/dev/null || true
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "mem-server failed to start" >&2; exit 1; }
  sleep 0.1
done
echo "mounting on $MOUNT: try 'ls $MOUNT', 'fs-client stats $MOUNT' (target/release/fs-client); Ctrl-C to stop"
./target/release/fs-client "127.0.0.1:$PORT" "$MOUNT" -o "transport=$TRANSPORT"
