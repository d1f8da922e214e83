#!/usr/bin/env bash
# Long fuzz runs of every target (the test suite runs each for 10 s):
#
#   fuzz/run.sh [SECONDS_PER_TARGET]     # default 600
#
# Needs cargo-fuzz (`cargo install --locked cargo-fuzz`); crashes land in fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:-600}
# Fully optimised, for throughput (Cargo.toml's profile is the test suite's quick build).
export CARGO_PROFILE_RELEASE_OPT_LEVEL=3 CARGO_PROFILE_RELEASE_CODEGEN_UNITS=4
for target in $(RUSTC_BOOTSTRAP=1 cargo fuzz list); do
    RUSTC_BOOTSTRAP=1 cargo fuzz run -O "$target" -- -max_total_time="$seconds" 2>&1 \
        | grep -E '^Done|SUMMARY|panicked' || true
done
