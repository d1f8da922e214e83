//! The few helpers every harness file uses, with no other dependency, so that the store's
//! contract tests inside the library (`src/store/contract.rs`) can use the PostgreSQL harness
//! too.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

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
