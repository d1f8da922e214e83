#![no_main]
//! Fuzz target: see agentgate::fuzzing::cassette.

libfuzzer_sys::fuzz_target!(|data: &[u8]| agentgate::fuzzing::cassette(data));
