//! The few helpers every harness file uses, with no other dependency, so that the store's
//! contract tests inside the library (`src/store/contract.rs`) can use the PostgreSQL harness
//! too.

use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// What a test needs beyond cargo: `tests/run` provides all of it (it runs `tests/setup`, which
/// installs the software, and the suite runs as root). A test whose need is missing fails and
/// names that command; a person who chooses to run without it lists the need in
/// `AGENTGATE_TEST_SKIP` (`root,postgres,browser,mcp,fuzz`), and then the test passes without
/// running and says so on stderr. Nothing is left out unless asked for by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Root: a real systemd in a namespace, loop-mounted file systems, other users.
    Root,
    /// Debian's PostgreSQL server binaries (postgresql-15).
    Postgres,
    /// Debian's Chromium and chromedriver (chromium, chromium-driver).
    Browser,
    /// The MCP servers under `tests/mcp/` (npm and PyPI, pinned).
    Mcp,
    /// cargo-fuzz (pinned).
    Fuzz,
}

/// Lists the needs a run may do without (comma-separated names of [`Need`]).
pub const SKIP_VARIABLE: &str = "AGENTGATE_TEST_SKIP";

impl Need {
    pub fn name(self) -> &'static str {
        match self {
            Need::Root => "root",
            Need::Postgres => "postgres",
            Need::Browser => "browser",
            Need::Mcp => "mcp",
            Need::Fuzz => "fuzz",
        }
    }

    /// What is missing and how to get it.
    fn remedy(self) -> &'static str {
        match self {
            Need::Root => {
                "root: run the tests as root (`tests/run` sets the machine up and runs them all)"
            }
            Need::Postgres => {
                "Debian's postgresql-15: `tests/setup` installs it (`tests/run` sets up and runs every test)"
            }
            Need::Browser => {
                "chromium and chromium-driver: `tests/setup` installs them (`tests/run` sets up and runs every test)"
            }
            Need::Mcp => {
                "the MCP servers under tests/mcp: `tests/setup` (or `tests/mcp/install`) installs them"
            }
            Need::Fuzz => {
                "cargo-fuzz: `tests/setup` installs it (`tests/run` sets up and runs every test)"
            }
        }
    }
}

/// Whether `test` can run, given whether what it needs is `present`. When it is not, the test
/// fails naming the command that provides it, unless `AGENTGATE_TEST_SKIP` lists the need: then
/// this says on stderr that the test did not run, and the test returns without running.
pub fn can_run(test: &str, need: Need, present: bool) -> bool {
    if present {
        return true;
    }
    let skipped = std::env::var(SKIP_VARIABLE).unwrap_or_default();
    let name = need.name();
    assert!(
        skipped.split(',').any(|listed| listed.trim() == name),
        "{test} needs {}; or set {SKIP_VARIABLE}={name} to leave out the tests that need it",
        need.remedy()
    );
    eprintln!("{test}: NOT RUN ({SKIP_VARIABLE} lists {name})");
    false
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A free loopback port for a daemon or a systemd socket to bind right after. It is taken from
/// below the kernel's ephemeral range (`ip_local_port_range`): a port that `bind(:0)` handed out
/// and released could go, before its owner binds it, to an outgoing connection of another test
/// running at the same time (seen in CI: a socket unit's start failed on it). Each test process
/// walks its own stretch of the range, starting from its pid, and checks every port with a bind.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let low = ephemeral_low.saturating_sub(16384).max(1024);
    let span = ephemeral_low.saturating_sub(low).max(1);
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let Ok(port) = u16::try_from(low + offset) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below the ephemeral range (from {ephemeral_low})");
}

/// Waits for `condition` up to `limit`, polling; panics with `what` if it never holds.
pub fn wait_until(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if condition() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out after {limit:?} waiting for {what}");
}

/// `command` without the variables `cargo test` gives a test process (`CARGO`,
/// `CARGO_MANIFEST_DIR`, `CARGO_PKG_*`...), for a build that a test runs. Some build scripts
/// (ring's) have cargo build again when one of these changes, so a build run from a test with
/// them set would not reuse what `tests/run` built ahead of it from a shell, and would build
/// again: ten minutes of the package test and four of the fuzz test on CI's two cores.
pub fn as_from_a_shell(command: &mut Command) -> &mut Command {
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .collect();
    for name in names {
        let given_by_cargo_test = name == "CARGO"
            || [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_BIN_",
                "CARGO_CRATE_",
            ]
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || matches!(
                name.as_str(),
                "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "CARGO_RUSTC_CURRENT_DIR"
            );
        if given_by_cargo_test {
            command.env_remove(&name);
        }
    }
    command
}
