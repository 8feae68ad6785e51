#!/bin/bash
# Installs rfs on this machine, as root: the binaries (mem-server, fs-client, rfs), mount.rfs for
# mount(8) and /etc/fstab, the storage-node unit rfs-node.service with its settings in
# /etc/rfs/node.env (kept if there), and a mount unit example. Builds first (release).
#
#   bash scripts/install.sh
#   PREFIX=/opt/rfs bash scripts/install.sh        # binaries in /opt/rfs/bin
#   DESTDIR=/tmp/pkg bash scripts/install.sh       # stage the files under /tmp/pkg (packaging)
#   RFS_BIN_DIR=target/debug bash scripts/install.sh   # install binaries built already
#
# Then: `systemctl enable --now rfs-node`, and `mount -t rfs 127.0.0.1:7470 /mnt/rfs` or the
# fstab line the README shows.
set -euo pipefail
PREFIX=${PREFIX:-/usr/local}
# Relative paths are the caller's, not the repository's.
DESTDIR=${DESTDIR:+$(realpath -m "$DESTDIR")}
RFS_BIN_DIR=${RFS_BIN_DIR:+$(realpath -m "$RFS_BIN_DIR")}
cd "$(dirname "$0")/.."
log() { printf '[install] %s\n' "$*" >&2; }
# The unit names the binary by this path: absolute, and nothing systemd would split or sed read.
if [[ $PREFIX != /* || $PREFIX =~ [[:space:]\\\&\|] ]]; then
  echo "PREFIX must be an absolute path without spaces, \\, & or |: $PREFIX" >&2
  exit 2
fi

if [ -z "${RFS_BIN_DIR:-}" ]; then
  bash scripts/setup.sh --build
  cargo build --release -p mem-server -p fs-client -p rfs-admin
  RFS_BIN_DIR=target/release
fi
bin=$DESTDIR$PREFIX/bin
doc=$DESTDIR$PREFIX/share/doc/rfs
units=$DESTDIR/etc/systemd/system
install -d "$bin" "$doc/examples" "$units" "$DESTDIR/sbin"
# /etc/rfs holds the secret: made private, and left as it is when there.
[ -d "$DESTDIR/etc/rfs" ] || install -d -m 0700 "$DESTDIR/etc/rfs"
install -m 0755 "$RFS_BIN_DIR/mem-server" "$RFS_BIN_DIR/fs-client" "$RFS_BIN_DIR/rfs" "$bin/"
# mount(8) runs /sbin/mount.TYPE for `-t TYPE`; the client answers to that name.
ln -sfn "$PREFIX/bin/fs-client" "$DESTDIR/sbin/mount.rfs"
log "binaries in $bin, mount helper /sbin/mount.rfs"

for unit in rfs-node.service rfs-node@.service; do
  sed "s|/usr/local|$PREFIX|g" "dist/systemd/$unit" >"$units/$unit"
  chmod 0644 "$units/$unit"
done
if [ -f "$DESTDIR/etc/rfs/node.env" ]; then
  log "kept /etc/rfs/node.env (the new default is in $doc/examples/node.env)"
else
  install -m 0644 dist/systemd/node.env "$DESTDIR/etc/rfs/node.env"
fi
install -m 0644 dist/systemd/node.env dist/systemd/mnt-rfs.mount "$doc/examples/"
install -m 0644 README.md "$doc/"
install -d "$doc/docs"
install -m 0644 docs/*.md "$doc/docs/"
log "unit /etc/systemd/system/rfs-node.service (settings: /etc/rfs/node.env), and rfs-node@NAME for several nodes on one machine (settings: /etc/rfs/node-NAME.env); mount unit example in $doc/examples"

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  log "start the node with: systemctl enable --now rfs-node"
fi
log "mount with: mkdir -p /mnt/rfs && mount -t rfs 127.0.0.1:7470 /mnt/rfs -o allow_other"
