#!/bin/bash
# Sets up a fresh machine and runs every test: formatting and lints, the unit, integration and
# end-to-end tests (the conformance suite on the tcp provider, real mounts), the same conformance
# suite and a file-system suite (real mounts) on the verbs provider over Soft-RoCE inside a QEMU
# VM, every fuzz target for 60 s, and the benchmark harness in quick mode.
set -euo pipefail
cd "$(dirname "$0")/.."
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
