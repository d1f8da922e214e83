//! A short run of every fuzz target in `fuzz/` (cargo fuzz, libFuzzer): the ledger parser and
//! salvage, signature verification, config checking, cassette parsing, request parsing, the event
//! markers of the prompt. Each runs for AGENTGATE_FUZZ_SECONDS (default 10); `fuzz/run.sh` runs
//! them for longer.

#[path = "common/basics.rs"]
#[expect(
    dead_code,
    reason = "the harness's basics; this file uses the gating only"
)]
mod basics;

use std::process::Command;

use basics::{Need, as_from_a_shell, can_run};

const FUZZ_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz");

fn cargo_fuzz_available() -> bool {
    Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn every_fuzz_target_survives_a_short_run() {
    // `tests/setup` installs cargo-fuzz (pinned); a test never installs software.
    if !can_run(
        "every_fuzz_target_survives_a_short_run",
        Need::Fuzz,
        cargo_fuzz_available(),
    ) {
        return;
    }
    let seconds = std::env::var("AGENTGATE_FUZZ_SECONDS").unwrap_or_else(|_| "10".to_string());
    // Every target in fuzz/fuzz_targets, so a new one cannot be left out.
    let listed = as_from_a_shell(&mut Command::new("cargo"))
        .current_dir(FUZZ_DIR)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["fuzz", "list"])
        .output()
        .expect("cargo fuzz list");
    let targets = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(
        targets.lines().any(|t| t == "markers"),
        "cargo fuzz list: {targets}"
    );
    for target in targets.lines() {
        // From a shell's environment, so that it runs what `tests/run` built ahead of it.
        let output = as_from_a_shell(&mut Command::new("cargo"))
            .current_dir(FUZZ_DIR)
            // cargo fuzz builds with sanitizer flags that stable rustc accepts only this way.
            .env("RUSTC_BOOTSTRAP", "1")
            // Without AddressSanitizer: the targets are safe Rust, so ASan would watch only the
            // dependencies, and its instrumented build takes CI's two cores about 3 minutes
            // longer. `fuzz/run.sh`'s long runs keep it.
            .args([
                "fuzz",
                "run",
                "-O",
                "--sanitizer=none",
                // As fuzz/Cargo.toml's profile says; cargo fuzz passes 1 unless told.
                "--codegen-units",
                "16",
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
