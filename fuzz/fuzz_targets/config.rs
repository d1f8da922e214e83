#![no_main]
//! Fuzz target: see agentgate::fuzzing::config.

libfuzzer_sys::fuzz_target!(|data: &[u8]| agentgate::fuzzing::config(data));
