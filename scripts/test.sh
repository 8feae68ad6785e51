#!/bin/bash
# Sets up a fresh machine and runs every test: formatting and lints, the unit and integration
# tests (the conformance suite on the tcp provider), and the same conformance suite on the verbs
# provider over Soft-RoCE inside a QEMU VM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
bash tests/rxe/run.sh
