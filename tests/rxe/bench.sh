#!/bin/bash
# The file system over verbs against tcp, measured inside the Soft-RoCE VM (see run.sh): fio
# through a real mount, 4 KiB random reads at queue depth 1 and 128 KiB sequential reads (both
# O_DIRECT, so every read crosses the transport), on each transport and for each completion
# polling mode, in BOOTS separate boots of the VM. Prints the medians over the boots, the spread
# (lowest-highest), and the verbs/tcp ratios; CPU per read counts all of the guest's CPUs
# (client, node, fio, kernel and rxe), from /proc/stat.
#
#   bash tests/rxe/bench.sh                     # 3 boots, release builds
#   BOOTS=1 SECS=5 MODES=polling=adaptive bash tests/rxe/bench.sh
#
# Results: tests/rxe/work/bench/results.tsv (every cell of every boot) and summary.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export WORK=$ROOT/tests/rxe/work
export SHARE=$WORK/bench
export TIMEOUT=${TIMEOUT:-1500}
BOOTS=${BOOTS:-3}
SECS=${SECS:-10}
# Mount options measured, one set per word: the three polling modes, and busy polling with one
# queue pair (so one poller thread spins instead of four).
MODES=${MODES:-"polling=adaptive polling=busy polling=event polling=busy,qps=1"}

bash tests/rxe/vm.sh ensure
cargo build -q --release -p mem-server -p fs-client -p rdmabox --bins --features rdmabox/bench
rm -rf "$SHARE" && mkdir -p "$SHARE/bin"
cp target/release/{mem-server,fs-client,rdmabox-bench} "$SHARE/bin/"
printf 'SECS=%s\nMODES="%s"\n' "$SECS" "$MODES" >"$SHARE/settings"
cat >"$SHARE/autorun.sh" <<'GUEST'
#!/bin/bash
# Runs in the guest: one boot's worth of cells, appended to results.tsv as
# "boot transport options test value unit cpu_us_per_op switches_per_op".
cd /mnt/host
. ./settings
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd   # the initramfs's devtmpfs lacks it
boot=$(cat boot)
cp -r bin /tmp/bin
mkdir -p /tmp/m
# Busy jiffies (user nice system irq softirq steal) and context switches, all CPUs.
counters() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9} /^ctxt/{print $2}' /proc/stat | paste -sd' '; }
hz=$(getconf CLK_TCK)
cell() { # transport options test block-size fio-args...
  local transport=$1 options=$2 test=$3 bs=$4; shift 4
  local c0 c1 ops value unit
  c0=$(counters)
  fio --name="$test" --filename=/tmp/m/data --direct=1 --ioengine=psync --runtime="$SECS" \
    --time_based --output-format=terse --terse-version=3 "$@" >/tmp/fio.out 2>/tmp/fio.err || {
    echo "fio $test failed on $transport/$options: $(tail -3 /tmp/fio.err)"; return; }
  c1=$(counters)
  cp /tmp/fio.out "fio-$transport-$options-$test.out"
  # The guest has no python: terse v3 gives read KiB (field 6), KiB/s (7) and IOPS (8).
  read -r ops value unit < <(awk -F';' -v bs="$bs" -v t="$test" '{
    if (t ~ /^randread/) print $6 * 1024 / bs, $8, "IOPS"
    else printf "%d %.1f MB/s\n", $6 * 1024 / bs, $7 * 1024 / 1e6 }' /tmp/fio.out)
  awk -v b="$boot" -v t="$transport" -v p="$options" -v n="$test" -v v="$value" -v u="$unit" \
    -v ops="$ops" -v hz="$hz" -v c0="$c0" -v c1="$c1" 'BEGIN {
      split(c0, a, " "); split(c1, z, " ")
      printf "%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t%.1f\n", b, t, p, n, v, u,
        (z[1] - a[1]) * 1e6 / hz / ops, (z[2] - a[2]) / ops }' | tee -a results.tsv
}
for transport in verbs tcp; do
  /tmp/bin/mem-server --listen 127.0.0.1:7470 --memory 512M --transport "$transport" \
    2>/tmp/server.log &
  server=$!
  for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/7470) 2>/dev/null && break; sleep 0.1; done
  for options in $MODES; do
    if ! /tmp/bin/fs-client 127.0.0.1:7470 /tmp/m --daemon -o "transport=$transport,$options" \
      2>/tmp/client.log; then
      echo "mount failed on $transport/$options: $(tail -3 /tmp/client.log)"; continue
    fi
    # The data file is written once per node and read by every mount after.
    [ -s /tmp/m/data ] || dd if=/dev/urandom of=/tmp/m/data bs=1M count=128 status=none
    cell "$transport" "$options" randread-4k-qd1 4096 --rw=randread --bs=4k
    cell "$transport" "$options" seqread-128k 131072 --rw=read --bs=128k
    fusermount3 -u /tmp/m
  done
  kill "$server"; wait "$server" 2>/dev/null || true
  # The rdmabox mechanisms alone, without FUSE: the polling table, once per transport.
  [ "$boot" = 1 ] && /tmp/bin/rdmabox-bench --transport "$transport" --only polling --secs 2 \
    >>rdmabox-polling.txt 2>&1
done
sync
GUEST
chmod +x "$SHARE/autorun.sh"

for boot in $(seq "$BOOTS"); do
  echo "$boot" >"$SHARE/boot"
  echo "== boot $boot of $BOOTS"
  bash tests/rxe/vm.sh test | tee "$SHARE/vm-$boot.log" | sed -u 's/^/[vm] /' |
    grep -E '^\[vm\] (fio|mount|[0-9]+\t)' || true
done

[ -s "$SHARE/results.tsv" ] || { echo "rxe bench: no results" >&2; exit 1; }
python3 - "$SHARE" <<'PY' | tee "$SHARE/summary.md"
import statistics, sys
from collections import defaultdict
cells = defaultdict(list)
for line in open(f"{sys.argv[1]}/results.tsv"):
    boot, transport, options, test, value, unit, cpu, ctxt = line.split("\t")
    cells[(test, options, transport)].append((float(value), unit, float(cpu), float(ctxt)))
def med(xs): return statistics.median(xs)
print("| test | options | transport | boots | median | spread | CPU us/read | switches/read |")
print("|---|---|---|---|---|---|---|---|")
for (test, options, transport), rows in sorted(cells.items()):
    v = [r[0] for r in rows]
    print(f"| {test} | {options} | {transport} | {len(rows)} | {med(v):g} {rows[0][1]} "
          f"| {min(v):g}-{max(v):g} | {med([r[2] for r in rows]):.0f} | {med([r[3] for r in rows]):.1f} |")
print()
print("| test | options | verbs/tcp (median of per-boot ratios) | spread |")
print("|---|---|---|---|")
boots = defaultdict(dict)
for line in open(f"{sys.argv[1]}/results.tsv"):
    boot, transport, options, test, value, *_ = line.split("\t")
    boots[(test, options, boot)][transport] = float(value)
ratios = defaultdict(list)
for (test, options, boot), t in boots.items():
    if t.get("tcp") and "verbs" in t:
        ratios[(test, options)].append(t["verbs"] / t["tcp"])
for (test, options), r in sorted(ratios.items()):
    print(f"| {test} | {options} | {med(r):.2f}x | {min(r):.2f}-{max(r):.2f}x |")
PY
