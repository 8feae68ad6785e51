#!/bin/bash
# Sets up a fresh machine and runs every test: formatting and lints, the unit, integration and
# end-to-end tests (the conformance suite on the tcp provider, real mounts), the same conformance
# suite and a file-system suite (real mounts) on the verbs provider over Soft-RoCE inside a QEMU
# VM, every fuzz target for 60 s, and the benchmark harness in quick mode.
set -euo pipefail
cd "$(dirname "$0")/.."
# A fresh checkout gains nothing from incremental state, and line tables are all a failing
# test's backtrace needs: the debug build is then 1.3 GB instead of 3.3 GB (the whole run once
# filled a CI machine's disk, in the fuzz build that comes last but one).
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only
bash scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features -- -D warnings
# The end-to-end tests start the workspace's binaries and load rfs-io's C library (a cdylib,
# which `cargo test` alone does not build).
cargo build --workspace
cargo test --workspace
bash tests/rxe/run.sh
bash fuzz/run.sh 60
# The IOzone/fio harness end to end on small files: every step must produce numbers.
bash iozone/run.sh --quick
