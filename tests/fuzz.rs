//! A short run of every fuzz target in `fuzz/` (cargo fuzz, libFuzzer): the ledger parser and
//! salvage, signature verification, config checking, cassette parsing, request parsing. Each runs
//! for AGENTGATE_FUZZ_SECONDS (default 10); `fuzz/run.sh` runs them for longer.

use std::process::Command;

const FUZZ_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz");
const TARGETS: [&str; 6] = [
    "ledger", "verify", "config", "cassette", "request", "markers",
];

fn cargo_fuzz_available() -> bool {
    Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn every_fuzz_target_survives_a_short_run() {
    if !cargo_fuzz_available() {
        let status = Command::new("cargo")
            .args(["install", "--locked", "cargo-fuzz"])
            .status()
            .expect("cargo install cargo-fuzz");
        assert!(status.success(), "cannot install cargo-fuzz");
    }
    let seconds = std::env::var("AGENTGATE_FUZZ_SECONDS").unwrap_or_else(|_| "10".to_string());
    for target in TARGETS {
        let output = Command::new("cargo")
            .current_dir(FUZZ_DIR)
            // cargo fuzz builds with sanitizer flags that stable rustc accepts only this way.
            .env("RUSTC_BOOTSTRAP", "1")
            .args([
                "fuzz",
                "run",
                "-O",
                target,
                "--",
                &format!("-max_total_time={seconds}"),
            ])
            .output()
            .expect("cargo fuzz run");
        let log = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "fuzz target {target} failed:\n{}",
            log.lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        );
        let runs = log
            .lines()
            .rev()
            .find_map(|l| {
                l.strip_prefix("Done ")
                    .and_then(|rest| rest.split_whitespace().next())
            })
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        assert!(runs > 1000, "fuzz target {target} ran only {runs} inputs");
        eprintln!("fuzz {target}: {runs} runs in {seconds} s");
    }
}
