#![no_main]
//! Fuzz target: see agentgate::fuzzing::markers.

libfuzzer_sys::fuzz_target!(|data: &[u8]| agentgate::fuzzing::markers(data));
