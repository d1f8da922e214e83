//! Never a 2xx for what is not durable: a full disk and failing fsyncs answer 503 with
//! Retry-After, `/readyz` fails meanwhile, every 202-acknowledged event survives, and the daemon
//! recovers on its own once writes work again. A start on a full disk waits for space instead of
//! exiting.

mod common;

use std::path::Path;
use std::time::Duration;

use common::loopfs::{LoopFs, path_str, run};
use common::stub::{Reply, Stub};
use common::*;

const ROUTE: &str = "[routes.hook]\npath = \"/hook\"\nverify = { scheme = \"none\" }\n";

fn post(daemon: &Daemon, n: usize) -> HttpResponse {
    daemon.post_json(
        "/hook",
        &[],
        &format!("{{\"n\":{n},\"pad\":\"{}\"}}", "x".repeat(900)),
    )
}

/// Every event id answered 202 must be in the database (a refused one may be too: the sender
/// retries it and dedup answers, so only the other direction loses work).
fn assert_all_stored(state_dir: &Path, accepted: &[String]) {
    let database = state_dir.join("agentgate.db");
    let connection = rusqlite::Connection::open(&database).expect("open the database");
    for id in accepted {
        let count: i64 = connection
            .query_row("SELECT count(*) FROM events WHERE id = ?1", [id], |row| {
                row.get(0)
            })
            .expect("query");
        assert_eq!(count, 1, "acknowledged event {id} is missing");
    }
    let ok: String = connection
        .query_row("PRAGMA integrity_check", [], |row| row.get(0))
        .expect("integrity_check");
    assert_eq!(ok, "ok");
}

#[test]
fn full_disk_answers_503_never_2xx_and_recovers() {
    if !root_or_skip("full_disk_answers_503_never_2xx_and_recovers") {
        return;
    }
    let filesystem = LoopFs::new();
    let workspace = filesystem.workspace();
    // min_free_disk would refuse first (its own test is below); this is the last line of
    // defence, a store that cannot write.
    workspace.write_config(&format!("[runtime]\nmin_free_disk = \"0\"\n{ROUTE}"));
    let daemon = workspace.start();
    let mut accepted = Vec::new();
    for n in 0..5 {
        let response = post(&daemon, n);
        assert_eq!(response.status, 202, "{response:?}");
        accepted.push(response.event_id());
    }

    let fill = filesystem.fill();

    let mut refused = 0;
    for n in 5..400 {
        let response = post(&daemon, n);
        match response.status {
            202 => accepted.push(response.event_id()),
            503 => {
                assert_eq!(response.header("retry-after"), Some("1"));
                assert_eq!(response.json()["error"], "unavailable");
                refused += 1;
                if refused == 3 {
                    break;
                }
            }
            other => panic!("unexpected status {other}: {response:?}"),
        }
    }
    assert!(refused > 0, "a full disk never produced a 503");
    assert_eq!(daemon.request("GET", "/readyz", &[], b"").status, 503);
    assert_eq!(daemon.request("GET", "/healthz", &[], b"").status, 200);

    fill.free();
    wait_until("/readyz to recover", Duration::from_secs(10), || {
        daemon.request("GET", "/readyz", &[], b"").status == 200
    });
    let response = post(&daemon, 1000);
    assert_eq!(response.status, 202, "{response:?}");
    accepted.push(response.event_id());
    drop(daemon);
    assert_all_stored(&workspace.state_dir(), &accepted);
}

#[test]
fn failing_fsync_answers_503_and_recovers() {
    let workspace = Workspace::new();
    let shim = failsync_shim(workspace.path());
    let flag = workspace.path().join("fail-now");
    workspace.write_config(ROUTE);
    let daemon = workspace.start_with_env(&[
        ("LD_PRELOAD", path_str(&shim)),
        ("FAILSYNC_FLAG", path_str(&flag)),
    ]);
    let mut accepted = Vec::new();
    let response = post(&daemon, 0);
    assert_eq!(response.status, 202);
    accepted.push(response.event_id());

    std::fs::write(&flag, b"").expect("raise the flag");
    for n in 1..4 {
        let response = post(&daemon, n);
        assert_eq!(response.status, 503, "fsync fails, yet: {response:?}");
        assert_eq!(response.header("retry-after"), Some("1"));
    }
    assert_eq!(daemon.request("GET", "/readyz", &[], b"").status, 503);

    std::fs::remove_file(&flag).expect("lower the flag");
    wait_until("/readyz to recover", Duration::from_secs(10), || {
        daemon.request("GET", "/readyz", &[], b"").status == 200
    });
    let response = post(&daemon, 10);
    assert_eq!(response.status, 202);
    accepted.push(response.event_id());
    drop(daemon);
    assert_all_stored(&workspace.state_dir(), &accepted);
}

/// `min_free_disk` refuses new webhooks (503, `Retry-After`, `/readyz` fails) while the store can
/// still write, so SQLite never meets a full disk; redeliveries of accepted events still get
/// their 200, and accepting resumes once space is freed.
#[test]
fn a_filling_disk_gets_503_from_min_free_disk_before_the_store_fails() {
    if !root_or_skip("a_filling_disk_gets_503_from_min_free_disk_before_the_store_fails") {
        return;
    }
    let filesystem = LoopFs::new();
    let workspace = filesystem.workspace();
    workspace.write_config(&format!("[runtime]\nmin_free_disk = \"8MiB\"\n{ROUTE}"));
    let daemon = workspace.start();
    let first = daemon.post_json("/hook", &[("idempotency-key", "first")], "{}");
    assert_eq!(first.status, 202, "{first:?}");
    let first_id = first.event_id();

    let fill = filesystem.mount_point.join("fill");
    run(
        "dd",
        &[
            "if=/dev/zero",
            "bs=1M",
            "count=5",
            "status=none",
            &format!("of={}", fill.display()),
        ],
    );
    wait_until("readiness to fail", Duration::from_secs(10), || {
        daemon.request("GET", "/readyz", &[], b"").status == 503
    });
    let refusal = post(&daemon, 1);
    assert_eq!(refusal.status, 503, "{refusal:?}");
    assert_eq!(refusal.header("retry-after"), Some("30"), "{refusal:?}");
    assert!(
        refusal.json()["message"]
            .as_str()
            .unwrap_or("")
            .contains("min_free_disk"),
        "{refusal:?}"
    );
    let again = daemon.post_json("/hook", &[("idempotency-key", "first")], "{}");
    assert_eq!(
        again.status, 200,
        "a redelivery still gets its answer: {again:?}"
    );
    assert_eq!(again.json()["event_id"], first_id.as_str());
    wait_until("the backpressure log line", Duration::from_secs(10), || {
        daemon.log().contains("backpressure")
    });

    std::fs::remove_file(&fill).expect("free the space");
    wait_until(
        "webhooks to be accepted again",
        Duration::from_secs(10),
        || daemon.request("GET", "/readyz", &[], b"").status == 200,
    );
    assert_eq!(post(&daemon, 2).status, 202);
}

/// The last run was killed with a turn running, and the state file system is full when the next
/// one starts: marking that turn crashed cannot be written. The daemon waits (saying so) instead
/// of exiting, so that a disk that fills up and is freed does not become a restart loop, and
/// answers webhooks 503 meanwhile; once space is freed it marks the turn, resumes the session
/// and serves. A stop while it waits ends it at once with 0.
#[test]
fn a_start_on_a_full_disk_waits_for_space_then_resumes() {
    if !root_or_skip("a_start_on_a_full_disk_waits_for_space_then_resumes") {
        return;
    }
    let filesystem = LoopFs::new();
    let workspace = filesystem.workspace();
    // A metrics socket passed as systemd would pass one (`FileDescriptorName=metrics`).
    let metrics = workspace.metrics_addr();
    let model = Stub::start(|_, count| {
        // The first turn hangs until its daemon is killed; the resumed one answers.
        if count == 0 {
            Reply::answer("never seen").after(Duration::from_secs(120))
        } else {
            Reply::answer("done")
        }
    });
    workspace.write_config(&format!(
        "[runtime]\nmin_free_disk = \"0\"\n{}{ROUTE}",
        model.model_section()
    ));
    let daemon = workspace.start();
    let response = post(&daemon, 0);
    assert_eq!(response.status, 202, "{response:?}");
    let event_id = response.event_id();
    wait_until("the model request", Duration::from_secs(10), || {
        !model.requests().is_empty()
    });
    daemon.kill9();

    let fill = filesystem.fill();
    let waiting = |daemon: &Daemon| {
        daemon
            .log()
            .contains("waiting for the state to be writable")
    };
    let blocked = workspace.start_with(&[], || true);
    wait_until(
        "the start to wait for space",
        Duration::from_secs(10),
        || waiting(&blocked),
    );
    assert!(
        process_alive(blocked.pid()),
        "the daemon exited on a full disk:\n{}",
        blocked.log()
    );
    let status = blocked.terminate();
    assert!(status.success(), "a stop while waiting ended {status}");

    let daemon = workspace.start_with(&[], || true);
    wait_until(
        "the start to wait for space",
        Duration::from_secs(10),
        || waiting(&daemon),
    );
    // While it waits, senders are answered (503, try again later), not left without an answer.
    let answer = post(&daemon, 1);
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(answer.header("retry-after"), Some("30"), "{answer:?}");
    // So is a scraper on every other socket the daemon holds.
    let scrape = try_request(metrics, "GET", "/metrics", &[], b"").expect("an answer");
    assert_eq!(scrape.status, 503, "{scrape:?}");
    fill.free();
    wait_until(
        "/readyz once space is freed",
        Duration::from_secs(20),
        || try_request(daemon.addr, "GET", "/readyz", &[], b"").is_ok_and(|r| r.status == 200),
    );
    let scrape = try_request(metrics, "GET", "/metrics", &[], b"").expect("an answer");
    assert_eq!(scrape.status, 200, "{scrape:?}");
    wait_until(
        "the resumed turn to complete",
        Duration::from_secs(20),
        || workspace.event_status(&event_id) == "completed",
    );
    let log = daemon.log();
    assert!(log.contains("they are resumed as crashed"), "{log}");
    assert!(log.contains("interrupted session resumed"), "{log}");
}
