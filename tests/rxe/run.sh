#!/bin/bash
# Runs, over the verbs provider on Soft-RoCE (rdma_rxe), the rdmabox conformance suite and then
# the file-system suite: end-to-end tests with real mem-server processes and FUSE mounts.
#
# This host's kernel has no RDMA support, so the suites run inside a Debian bookworm kernel booted
# under QEMU (software emulation), with rxe on the guest's loopback. The test binaries are built on
# the host against Debian's libibverbs and run unchanged in the guest (same Debian release).
#
#   tests/rxe/run.sh            # build the VM if needed, build the suites, boot, run, report
#   RXE_TEST_ARGS='peer_killed --nocapture' tests/rxe/run.sh   # only the conformance suite, so
#   RXE_FS_TESTS='cluster:a_dead_storage' tests/rxe/run.sh     # only these file-system tests
#
# Exit status: non-zero if either suite failed. Output: tests/rxe/work/share/{conformance,fs}.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export WORK=$ROOT/tests/rxe/work
export SHARE=$WORK/share
export TIMEOUT=${TIMEOUT:-2400}
start=$(date +%s)

bash tests/rxe/vm.sh ensure

# The executables cargo builds for `$@`, one per line, as "target-name path".
executables() {
  cargo test "$@" --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])'
}

bin=$(executables -p rdmabox --test conformance | awk '$1 == "conformance" {print $2}')
[ -x "$bin" ] || { echo "could not build the conformance suite" >&2; exit 1; }
cargo build -q -p mem-server -p fs-client

# The file-system tests that run over verbs, as file:test (whole names): model-checked random
# I/O, fio verify, two data nodes, unlink-while-open, a node killed mid-I/O (EIO within
# io_timeout, a clean unmount), replicas with a node killed, and a metadata node restarted. Not
# the tests that stop a node (SIGSTOP) and expect its transfers to time out: over verbs the NIC
# serves one-sided transfers without the process, so a stopped node goes on serving (as it
# should); the verbs deadline is what a killed node exercises. Not the chaos test by default
# (RXE_FS_TESTS=chaos:... runs it): under emulation, with fio and five processes on two
# emulated CPUs, its metadata node takes over 11 s to start again, past the outage writes ride
# out (the lease plus io_timeout).
fs_tests=${RXE_FS_TESTS:-"
integrity:random_io_matches_the_model
integrity:fio_verifies_crc32c
cluster:two_mounts_see_each_others_closed_files
cluster:large_files_span_many_chunks_on_two_nodes
cluster:a_dead_storage_node_fails_io_with_eio_and_nothing_hangs
posix:files_directories_links_and_their_errors
posix:unlinked_open_files_keep_their_data_and_unmount_is_clean
replicas:with_two_replicas_a_killed_node_loses_nothing_and_its_copies_are_made_again
restart:a_restarted_metadata_node_comes_back_with_everything_it_answered
ring:reads_land_in_the_buffer_with_the_holes_zeroed
ring:the_ring_reads_and_writes_the_same_file_as_the_mount
xattrs:extended_attributes_keep_xattr7s_semantics"}

rm -rf "$SHARE" && mkdir -p "$SHARE/fs/deps"
cp "$bin" "$SHARE/conformance"
# The e2e harness finds mem-server and fs-client beside the directory of its test binary.
cp target/debug/mem-server target/debug/fs-client "$SHARE/fs/"
e2e=$(executables -p rfs-e2e --tests)
: >"$SHARE/fs-tests"
if [ -z "${RXE_TEST_ARGS:-}" ] || [ -n "${RXE_FS_TESTS:-}" ]; then
  for t in $fs_tests; do
    file=${t%%:*}
    path=$(awk -v f="$file" '$1 == f {print $2}' <<<"$e2e")
    [ -x "$path" ] || { echo "no e2e test binary for $file" >&2; exit 1; }
    cp -n "$path" "$SHARE/fs/deps/$file"
    echo "$file ${t#*:}" >>"$SHARE/fs-tests"
  done
fi

# By default two runs: the suite in parallel, then the tests that kill a peer, one at a time.
# Run beside other tests on rxe, a killed peer's QP number can be reused by a new QP of another
# test, whose answers keep the dead connection's retry counter from running out (seen with
# retry_cnt 7, which rxe retries forever: no completion in 30 s).
killers="peer_killed_mid_transfer_flushes_everything a_session_answers_every_request_in_time_when_the_peer_stops_or_dies"
if [ -n "${RXE_TEST_ARGS:-}" ]; then
  printf '%s\n' "$RXE_TEST_ARGS" > "$SHARE/test-args"
elif [ -n "${RXE_FS_TESTS:-}" ]; then
  : > "$SHARE/test-args"
else
  skips=""; for t in $killers; do skips="$skips --skip $t"; done
  printf '%s\n' "--test-threads=2$skips" \
    "--test-threads=1 --exact $killers --nocapture" > "$SHARE/test-args"
fi
cat >"$SHARE/autorun.sh" <<'GUEST'
#!/bin/bash
# Runs in the guest: the conformance suite forced onto the verbs provider, then the file-system
# tests one at a time (each starts its own nodes and mounts: the guest has two slow CPUs).
cd /mnt/host
echo "== devices: $(ls /sys/class/infiniband)"
export RDMABOX_TEST_PROVIDER=verbs RFS_E2E_TRANSPORT=verbs RUST_BACKTRACE=1
rc=0
while read -r args; do
  # shellcheck disable=SC2086
  ./conformance $args 2>&1 | tee -a conformance.log
  r=${PIPESTATUS[0]}; [ "$r" -ne 0 ] && rc=$r
done < test-args
echo "$rc" > result
fs_start=$(cut -d. -f1 /proc/uptime)
fs_rc=0
# Binaries run from memory: each exec over 9p reads a whole debug binary again.
[ -s fs-tests ] && cp -r fs /tmp/fs
while read -r file test; do
  echo "== $file::$test"
  t0=$(cut -d' ' -f1 /proc/uptime)
  /tmp/fs/deps/"$file" --exact "$test" --test-threads=1 --nocapture 2>&1 | tee -a fs.log
  r=${PIPESTATUS[0]}; [ "$r" -ne 0 ] && fs_rc=$r
  echo "== $file::$test: exit $r, $(awk -v a="$t0" '{printf "%.0f", $1 - a}' /proc/uptime) s"
done < fs-tests
echo "$fs_rc $(( $(cut -d. -f1 /proc/uptime) - fs_start ))" > fs-result
sync
GUEST
chmod +x "$SHARE/autorun.sh"

bash tests/rxe/vm.sh test | sed -u 's/^/[vm] /' | grep -v '^\[vm\] *$' || true
# The logs stay; the copies of the test binaries (hundreds of MB) go.
rm -rf "$SHARE/conformance" "$SHARE/fs"

end=$(date +%s)
if [ ! -f "$SHARE/result" ]; then
  echo "rxe harness: the guest produced no result (boot failure or timeout after ${TIMEOUT}s)" >&2
  exit 1
fi
# Sums the "test result" lines of a log: "passed failed".
tally() {
  local passed=0 failed=0 p f
  while read -r p f; do passed=$((passed + p)); failed=$((failed + f)); done < <(
    sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p' "$1" 2>/dev/null)
  echo "$passed $failed"
}
rc=$(cat "$SHARE/result")
read -r passed failed < <(tally "$SHARE/conformance.log")
echo "rxe harness: conformance suite on the verbs provider (Soft-RoCE): $passed passed, $failed failed (exit $rc, $((end - start)) s wall in all)"
if [ -s "$SHARE/fs-tests" ]; then
  if [ ! -f "$SHARE/fs-result" ]; then
    echo "rxe harness: file system over verbs: no result (the guest stopped or timed out after ${TIMEOUT}s)" >&2
    exit 1
  fi
  read -r fs_rc fs_secs < "$SHARE/fs-result"
  read -r passed failed < <(tally "$SHARE/fs.log")
  expected=$(wc -l < "$SHARE/fs-tests")
  # A test that never reported (the guest ran out of time or memory) fails the suite too.
  if [ $((passed + failed)) -ne "$expected" ]; then fs_rc=1; fi
  echo "rxe harness: file system over verbs: $passed passed, $failed failed of $expected ($fs_secs s wall)"
  [ "$rc" -eq 0 ] && rc=$fs_rc
fi
exit "$rc"
