#!/bin/bash
# Runs the rdmabox conformance suite over the verbs provider on Soft-RoCE (rdma_rxe).
#
# This host's kernel has no RDMA support, so the suite runs inside a Debian bookworm kernel booted
# under QEMU (software emulation), with rxe on the guest's loopback. The test binary is built on the
# host against Debian's libibverbs and runs unchanged in the guest (same Debian release).
#
#   tests/rxe/run.sh            # build the VM if needed, build the suite, boot, run, report
#   RXE_TEST_ARGS='peer_killed --nocapture' tests/rxe/run.sh   # pass arguments to the suite
#
# Exit status: the suite's own. Its output is in tests/rxe/work/share/conformance.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export WORK=$ROOT/tests/rxe/work
export SHARE=$WORK/share
export TIMEOUT=${TIMEOUT:-1500}
start=$(date +%s)

if [ ! -f "$WORK/initrd.cpio" ] || [ ! -f "$WORK/vmlinuz" ]; then
  bash tests/rxe/vm.sh build
fi

bin=$(cargo test -p rdmabox --test conformance --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "conformance":
        print(m["executable"])')
[ -x "$bin" ] || { echo "could not build the conformance suite" >&2; exit 1; }

rm -rf "$SHARE" && mkdir -p "$SHARE"
cp "$bin" "$SHARE/conformance"
# By default two runs: the suite in parallel, then the tests that kill a peer, one at a time.
# Run beside other tests on rxe, a killed peer's QP number can be reused by a new QP of another
# test, whose answers keep the dead connection's retry counter from running out (seen with
# retry_cnt 7, which rxe retries forever: no completion in 30 s).
killers="peer_killed_mid_transfer_flushes_everything a_session_answers_every_request_in_time_when_the_peer_stops_or_dies"
if [ -n "${RXE_TEST_ARGS:-}" ]; then
  printf '%s\n' "$RXE_TEST_ARGS" > "$SHARE/test-args"
else
  skips=""; for t in $killers; do skips="$skips --skip $t"; done
  printf '%s\n' "--test-threads=2$skips" \
    "--test-threads=1 --exact $killers --nocapture" > "$SHARE/test-args"
fi
cat >"$SHARE/autorun.sh" <<'GUEST'
#!/bin/bash
# Runs in the guest: the same suite, forced onto the verbs provider.
cd /mnt/host
echo "== devices: $(ls /sys/class/infiniband)"
export RDMABOX_TEST_PROVIDER=verbs RUST_BACKTRACE=1
rc=0
while read -r args; do
  # shellcheck disable=SC2086
  ./conformance $args 2>&1 | tee -a conformance.log
  r=${PIPESTATUS[0]}; [ "$r" -ne 0 ] && rc=$r
done < test-args
echo "$rc" > result
sync
GUEST
chmod +x "$SHARE/autorun.sh"

bash tests/rxe/vm.sh test | sed -u 's/^/[vm] /' | grep -v '^\[vm\] *$' || true

end=$(date +%s)
if [ ! -f "$SHARE/result" ]; then
  echo "rxe harness: the guest produced no result (boot failure or timeout after ${TIMEOUT}s)" >&2
  exit 1
fi
rc=$(cat "$SHARE/result")
passed=0; failed=0
while read -r p f; do passed=$((passed + p)); failed=$((failed + f)); done < <(
  sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p' "$SHARE/conformance.log")
echo "rxe harness: conformance suite on the verbs provider (Soft-RoCE): $passed passed, $failed failed (exit $rc, $((end - start)) s wall)"
exit "$rc"
