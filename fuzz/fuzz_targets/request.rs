#![no_main]
//! Fuzz target: see agentgate::fuzzing::request.

libfuzzer_sys::fuzz_target!(|data: &[u8]| agentgate::fuzzing::request(data));
