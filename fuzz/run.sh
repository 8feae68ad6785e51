#!/bin/bash
# Runs every fuzz target for a bounded time (default 60 s each) from the seed corpora in
# fuzz/seeds; a crash, a panic or a leak past libFuzzer's limits fails the run and leaves the
# input under fuzz/artifacts/. Works on the stable toolchain (no sanitizer: the code under test
# is safe Rust, so libFuzzer's coverage and Rust's own checks find what there is to find).
#   bash fuzz/run.sh [SECONDS_PER_TARGET]
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
cargo fuzz build -s none
for target in $(cargo fuzz list); do
  scratch=$(mktemp -d)
  log="$scratch.log"
  echo "fuzz: $target for ${seconds}s"
  if ! cargo fuzz run -s none "$target" "$scratch" "seeds/$target" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "fuzz: $target FAILED (the input is under fuzz/artifacts/$target)" >&2
    rm -rf "$scratch" "$log"
    exit 1
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$log" || true
  rm -rf "$scratch" "$log"
done
echo "fuzz: every target ran ${seconds}s without a crash"
