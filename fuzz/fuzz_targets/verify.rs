#![no_main]
//! Fuzz target: see agentgate::fuzzing::verify.

libfuzzer_sys::fuzz_target!(|data: &[u8]| agentgate::fuzzing::verify(data));
