//! Crash soak: kill -9 at random moments during a mix of webhooks and multi-step turns (command
//! tools and an MCP tool), then check the invariants: every acknowledged event reaches exactly
//! one terminal status and is delivered, no non-idempotent tool call ran twice, command or MCP, SQLite's integrity check passes, the ledger
//! is valid, and no session was resumed more than `resume_max_attempts` times.
//!
//! `AGENTGATE_SOAK_KILLS` sets the number of kills (default 200 here; `tests/soak/run.sh` runs
//! 1,000).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::mcp::PythonServer;
use common::stub::{Reply, Stub};
use common::*;
use serde_json::json;

const MAX_ATTEMPTS: usize = 3;

/// The model: three tool calls per turn, each with a nonce unique to (event, step): a command
/// tool, an MCP tool (not idempotent: it has no annotations), the command tool again; then an
/// answer.
fn model() -> Stub {
    Stub::start(|request, _| {
        let body = request.json();
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let event = messages
            .iter()
            .filter_map(|m| m["content"].as_str())
            .find_map(|c| {
                c.split(" id=\"")
                    .nth(1)
                    .and_then(|rest| rest.split('"').next())
            })
            .unwrap_or("unknown")
            .to_string();
        let step = messages.iter().filter(|m| m["role"] == "assistant").count();
        if step == 1 {
            Reply::tool_call(
                &format!("call-{step}"),
                "web__shout",
                json!({"text": format!("{event}-{step}")}),
            )
        } else if step < 3 {
            Reply::tool_call(
                &format!("call-{step}"),
                "effect",
                json!({"nonce": format!("{event}-{step}")}),
            )
        } else {
            Reply::answer("done")
        }
    })
}

fn config(workspace: &Workspace, model: &Stub, receiver: &Stub, mcp: &PythonServer) -> String {
    format!(
        r#"[runtime]
drain_timeout = "1s"
resume_max_attempts = {MAX_ATTEMPTS}

[model]
backend = "openai"
base_url = "{model}/v1"
model = "soak"
request_timeout = "10s"
max_retries = 1

[tools.effect]
description = "A side effect that must never run twice for one call"
command = ["/bin/sh", "-c", "a=$(cat); printf '%s\n' \"$a\" >> {log}; sleep 0.03"]
parameters = {{ type = "object", properties = {{ nonce = {{ type = "string" }} }}, required = ["nonce"] }}

{mcp}
[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
tools = ["effect", "web.shout"]
deliver = {{ kind = "http", url = "{receiver}/results" }}
"#,
        mcp = mcp.config(workspace),
        model = model.url(),
        receiver = receiver.url(),
        log = workspace.path().join("effects.log").display(),
    )
}

#[test]
fn kill_dash_nine_at_random_moments_keeps_every_invariant() {
    let kills: usize = std::env::var("AGENTGATE_SOAK_KILLS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let workspace = Workspace::new();
    let (model, receiver) = (model(), Stub::start(|_, _| Reply::raw(204, "")));
    let mcp = PythonServer::start(&workspace);
    workspace.write_config(&config(&workspace, &model, &receiver, &mcp));
    let mut accepted: Vec<String> = Vec::new();
    let mut logs = String::new();
    for round in 0..kills {
        let daemon = workspace.start();
        for n in 0..2 {
            // A request cut off by the kill has no answer: it was not acknowledged.
            if let Ok(response) = try_request(
                daemon.addr,
                "POST",
                "/hook",
                &[("content-type", "application/json")],
                json!({"round": round, "n": n}).to_string().as_bytes(),
            ) && response.status == 202
            {
                accepted.push(response.event_id());
            }
        }
        std::thread::sleep(Duration::from_millis(fastrand::u64(0..250)));
        logs.push_str(&daemon.log());
        daemon.kill9();
    }

    // A last start settles everything that is still open.
    let daemon = workspace.start();
    let open = |workspace: &Workspace| -> i64 {
        workspace.query(
            "SELECT (SELECT count(*) FROM events WHERE status IN ('queued', 'running'))
                  + (SELECT count(*) FROM deliveries WHERE status = 'pending')",
            |row| row.get(0),
        )[0]
    };
    wait_until(
        "every event and delivery to settle",
        Duration::from_secs(180),
        || open(&workspace) == 0,
    );
    logs.push_str(&daemon.log());
    drop(daemon);

    // Every acknowledged event: exactly one terminal status, delivered.
    let statuses: BTreeMap<String, String> = workspace
        .query("SELECT id, status FROM events", |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .into_iter()
        .collect();
    let deliveries: BTreeMap<String, (String, String)> = workspace
        .query("SELECT event_id, status, body FROM deliveries", |row| {
            Ok((row.get(0)?, (row.get(1)?, row.get(2)?)))
        })
        .into_iter()
        .collect();
    let received: BTreeSet<String> = receiver
        .requests()
        .iter()
        .filter_map(|r| r.header("webhook-id").map(str::to_string))
        .collect();
    for id in &accepted {
        let status = statuses
            .get(id)
            .unwrap_or_else(|| panic!("acknowledged event {id} is missing"));
        assert!(
            matches!(
                status.as_str(),
                "completed" | "failed" | "abandoned" | "suspended"
            ),
            "event {id} ended {status}"
        );
        let (delivery, body) = deliveries
            .get(id)
            .unwrap_or_else(|| panic!("event {id} has no delivery"));
        assert_eq!(delivery, "delivered", "event {id}");
        let delivered: serde_json::Value = serde_json::from_str(body).expect("delivery body");
        assert_eq!(
            &delivered["status"],
            status.as_str(),
            "event {id}: delivered status differs"
        );
        assert!(
            received.contains(id),
            "event {id} never reached the receiver"
        );
    }

    // No non-idempotent call ran twice.
    let effects = std::fs::read_to_string(workspace.path().join("effects.log")).unwrap_or_default();
    let mut seen = BTreeSet::new();
    for line in effects.lines().filter(|l| !l.is_empty()) {
        assert!(seen.insert(line.to_string()), "the call {line} ran twice");
    }
    let mut mcp_seen = BTreeSet::new();
    for (key, text) in mcp.calls() {
        assert!(
            mcp_seen.insert(text.clone()),
            "the MCP call {text} (key {key}) ran twice"
        );
    }
    assert!(!mcp_seen.is_empty(), "no MCP call ran");

    // The database and the ledger are sound; no session was resumed past the limit.
    let integrity: Vec<String> = workspace.query("PRAGMA integrity_check", |row| row.get(0));
    assert_eq!(integrity, ["ok"]);
    let ledger: serde_json::Value = serde_json::from_slice(
        &std::fs::read(workspace.state_dir().join("ledger.json"))
            .unwrap_or_else(|_| b"{\"version\":1,\"sessions\":{}}".to_vec()),
    )
    .expect("ledger is JSON");
    assert_eq!(ledger["version"], 1);
    let mut resumes: BTreeMap<String, usize> = BTreeMap::new();
    for line in logs
        .lines()
        .filter(|l| l.contains("interrupted session resumed"))
    {
        if let Some(key) = line
            .split("session_key=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        {
            *resumes.entry(key.to_string()).or_default() += 1;
        }
    }
    for (session, count) in &resumes {
        assert!(
            *count <= MAX_ATTEMPTS,
            "session {session} was resumed {count} times"
        );
    }
    let outcome: BTreeMap<&str, usize> = statuses.values().fold(BTreeMap::new(), |mut m, s| {
        *m.entry(s.as_str()).or_default() += 1;
        m
    });
    eprintln!(
        "soak: kills={kills} acknowledged={} outcomes={outcome:?} tool_calls={} mcp_calls={} sessions_resumed={}",
        accepted.len(),
        seen.len(),
        mcp_seen.len(),
        resumes.len()
    );
}
