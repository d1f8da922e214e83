//! The few helpers every harness file uses, with no other dependency, so that the store's
//! contract tests inside the library (`src/store/contract.rs`) can use the PostgreSQL harness
//! too.

use std::net::TcpListener;
use std::process::Command;
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

/// A free loopback port (bound and released; the daemon binds it again right after).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
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
