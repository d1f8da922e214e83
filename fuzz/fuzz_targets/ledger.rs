#![no_main]
//! Fuzz target: see agentgate::fuzzing::ledger.

libfuzzer_sys::fuzz_target!(|data: &[u8]| agentgate::fuzzing::ledger(data));
