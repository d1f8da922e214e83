#!/usr/bin/env bash
# The long crash soak: kill -9 at random moments, COUNT times (default 1,000), then check every
# invariant (tests/soak.rs). The test suite runs the same soak with 200 kills.
#
#   tests/soak/run.sh [COUNT]
set -euo pipefail
cd "$(dirname "$0")/../.."
AGENTGATE_SOAK_KILLS=${1:-1000} cargo test --locked --release --test soak -- --nocapture
