#!/bin/bash
# IOzone and fio against an rfs mount and against baselines (tmpfs, bindfs over tmpfs, GlusterFS
# with one brick on tmpfs: the paper's baseline), side by side, with the RDMABox ablation through
# the mount; tables, CSV and plots in iozone/results/.
#
#   bash iozone/run.sh                 # full run (2 GiB files): docs/performance.md, the harness's table
#   bash iozone/run.sh --quick         # seconds: proves every step produces numbers (CI)
#   bash iozone/run.sh --size 512M --skip-ablation
#   bash iozone/run.sh --mount /mnt/rfs  # measure an existing mount instead of starting one
#
# Everything after the script name goes to iozone/rfsbench.py (--help lists it all).
set -euo pipefail
cd "$(dirname "$0")/.."
# Help before any setup: asking how to run it installs nothing.
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      if [ -x /usr/bin/python3 ]; then exec /usr/bin/python3 iozone/rfsbench.py --help; fi
      sed -n '2,11s/^# \{0,1\}//p' iozone/run.sh
      exit 0
      ;;
  esac
done
export DEBIAN_FRONTEND=noninteractive
bash scripts/setup.sh
need=()
command -v iozone >/dev/null || need+=(iozone3)
command -v bindfs >/dev/null || need+=(bindfs)
command -v fio >/dev/null || need+=(fio)
command -v glusterd >/dev/null || need+=(glusterfs-server glusterfs-client)
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)
if ((${#need[@]})); then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
cargo build --release --workspace --bins
exec /usr/bin/python3 iozone/rfsbench.py "$@"
