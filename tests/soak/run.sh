#!/usr/bin/env bash
# The long fault soak: COUNT rounds (default 1,000), each ending in a fault at a random moment
# (kill -9, SIGTERM, SIGSTOP, a full disk, failing fsync, a misbehaving model or delivery
# target), then check every invariant (tests/soak.rs). The test suite runs 100 rounds.
#
#   tests/soak/run.sh [COUNT]
set -euo pipefail
cd "$(dirname "$0")/../.."
AGENTGATE_SOAK_ROUNDS=${1:-1000} cargo test --locked --release --test soak -- --nocapture
