//! `sessions rewind` and `sessions fork` against the real binary: a rerun from a transcript
//! entry runs no tool before it and supersedes (never deletes) the entries from it on; it is
//! refused while the session is busy and for an entry that cannot be rerun; a kill -9 in the
//! middle of it resumes and finishes once; a fork leaves the original as it was; and the same
//! on PostgreSQL.

mod common;

use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::marks::{self, marks, runs, slow_tools};
use common::postgres::Postgres;
use common::stub::{Received, Reply, Stub};
use common::*;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);

fn last_role(request: &Received) -> String {
    request
        .messages()
        .last()
        .and_then(|m| m["role"].as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Whether the request ends with the note of a resumed turn.
fn resumed(request: &Received) -> bool {
    let text = request.last_text();
    text.starts_with("[agentgate]") && text.contains("interrupted")
}

/// The model: calls `lookup` (or, for an event that says "slowplan", `slow_lookup`; for
/// "gateplan", the gated `deploy`), and once it sees the result answers "answer N", N counting
/// its answers. An event that says "directplan" is answered at once.
fn model() -> Stub {
    let answers = Arc::new(AtomicUsize::new(0));
    Stub::start(move |request, _| {
        let text = request.json().to_string();
        if last_role(request) == "tool" || text.contains("directplan") {
            let n = answers.fetch_add(1, Ordering::SeqCst) + 1;
            return Reply::answer(&format!("answer {n}"));
        }
        let tool = if text.contains("slowplan") {
            "slow_side_effect"
        } else if text.contains("gateplan") {
            "deploy"
        } else {
            "lookup"
        };
        Reply::tool_call("call_1", tool, json!({}))
    })
}

fn receiver() -> Stub {
    Stub::start(|_, _| Reply::raw(204, ""))
}

fn wait_for_runs(workspace: &Workspace, name: &str, count: usize) {
    marks::wait_for_runs(workspace, name, count, LIMIT);
}

fn config(workspace: &Workspace, model: &Stub, receiver: &Stub, store: &str) -> String {
    let marks = marks(workspace);
    let marks = marks.display();
    format!(
        r#"{store}
[runtime]
drain_timeout = "1s"
max_turn_steps = 8

{model}
[tools.lookup]
description = "Reads something"
command = ["/bin/sh", "-c", "echo ran >> {marks}/quick.runs; echo found"]
writable = ["{marks}"]

{slow_tools}
[tools.deploy]
description = "Deploys"
command = ["/bin/echo", "deployed"]
approval = true

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
tools = ["lookup", "slow_side_effect", "slow_lookup", "deploy"]
deliver = {{ kind = "http", url = "{receiver}/results" }}
"#,
        model = model.model_section(),
        receiver = receiver.url(),
        slow_tools = slow_tools(workspace),
    )
}

fn post(daemon: &Daemon, session: &str, plan: &str) -> String {
    let body = json!({"session": session, "plan": plan}).to_string();
    let response = daemon.post_json("/hook", &[], &body);
    assert_eq!(response.status, 202, "{response:?}");
    response.event_id()
}

/// The newest event of session `key`: its id and status.
fn newest_event(workspace: &Workspace, key: &str) -> (String, String) {
    let events = workspace.cli_json(&["events", "list", "--session", key, "--json"]);
    let newest = &events[0];
    (
        newest["id"].as_str().unwrap_or_default().to_string(),
        newest["status"].as_str().unwrap_or_default().to_string(),
    )
}

/// Waits until the newest event of `key` (one other than `before`) is completed; its id.
fn wait_rerun_completed(workspace: &Workspace, key: &str, before: &str) -> String {
    let mut found = String::new();
    wait_until("the rerun to complete", LIMIT, || {
        let (id, status) = newest_event(workspace, key);
        found = id;
        found != before && status == "completed"
    });
    found
}

fn wait_completed(workspace: &Workspace, key: &str, event_id: &str) {
    wait_until(&format!("event {event_id} to complete"), LIMIT, || {
        newest_event(workspace, key) == (event_id.to_string(), "completed".to_string())
    });
}

fn deliveries(receiver: &Stub, event_id: &str) -> Vec<Value> {
    receiver
        .requests()
        .into_iter()
        .filter(|r| r.header("webhook-id") == Some(event_id))
        .map(|r| r.json())
        .collect()
}

fn delivered(receiver: &Stub, event_id: &str) -> Value {
    wait_until("the delivery", LIMIT, || {
        !deliveries(receiver, event_id).is_empty()
    });
    deliveries(receiver, event_id).remove(0)
}

fn transcript(workspace: &Workspace, key: &str) -> Vec<Value> {
    workspace.session_json(key)["transcript"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// `sessions rewind KEY --to N`: the new turn's id, after checking that it succeeded.
fn rewind(workspace: &Workspace, key: &str, n: i64) -> String {
    let output = workspace.cli(&["sessions", "rewind", key, "--to", &n.to_string()]);
    assert!(output.status.success(), "rewind {key} to {n}: {output:?}");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// A refused command: exit 1 and one line that contains `why`.
fn assert_refused(output: &Output, why: &str) {
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(why), "{why:?} not in {stderr}");
    assert!(output.stdout.is_empty(), "{output:?}");
}

/// What a finished turn of the lookup plan recorded: the event, the model's call, its start,
/// its result and the answer, numbered 1 to 5.
fn assert_lookup_turn(entries: &[Value]) {
    let shape: Vec<(i64, &str, &str)> = entries
        .iter()
        .map(|e| {
            (
                e["n"].as_i64().unwrap_or(0),
                e["kind"].as_str().unwrap_or(""),
                e["body"]["message"]["role"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (1, "event", "user"),
            (2, "message", "assistant"),
            (3, "tool_start", ""),
            (4, "message", "tool"),
            (5, "message", "assistant"),
        ],
        "{entries:#?}"
    );
}

fn content(entry: &Value) -> &str {
    entry["body"]["message"]["content"].as_str().unwrap_or("")
}

#[test]
fn a_rewind_reruns_from_its_entry_runs_no_tool_before_it_and_keeps_what_it_superseded() {
    let workspace = Workspace::new();
    let (model, receiver) = (model(), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, ""));
    let daemon = workspace.start();
    let first = post(&daemon, "s", "lookplan");
    wait_completed(&workspace, "s", &first);
    assert_eq!(runs(&workspace, "quick.runs"), 1);
    let entries = transcript(&workspace, "s");
    assert_lookup_turn(&entries);
    assert_eq!(content(&entries[4]), "answer 1");

    // Entry 5, the answer: the model is asked again with the history before it.
    let asked = model.requests().len();
    let turn_id = rewind(&workspace, "s", 5);
    let rerun = wait_rerun_completed(&workspace, "s", &first);
    assert_eq!(
        runs(&workspace, "quick.runs"),
        1,
        "a tool before N ran again"
    );
    let result = delivered(&receiver, &rerun);
    assert_eq!(result["output"], "answer 2", "{result}");
    assert_eq!(result["turn_id"], turn_id.as_str(), "{result}");
    assert_eq!(result["rewind_of"], json!({"session": "s", "entry": 5}));
    let requests = model.requests();
    assert_eq!(requests.len(), asked + 1, "one model request reruns it");
    let seen = requests[asked].messages();
    assert_eq!(seen.last().map(|m| m["role"].clone()), Some(json!("tool")));
    assert!(
        !serde_json::to_string(&seen)
            .unwrap_or_default()
            .contains("answer 1"),
        "the superseded answer is not history: {seen:#?}"
    );
    let entries = transcript(&workspace, "s");
    assert_eq!(entries.len(), 6, "{entries:#?}");
    assert_eq!(entries[4]["superseded_by"], turn_id.as_str());
    assert_eq!(content(&entries[4]), "answer 1", "kept, not deleted");
    assert!(
        entries[..4]
            .iter()
            .all(|e| e.get("superseded_by").is_none())
    );
    assert_eq!(
        (entries[5]["n"].clone(), content(&entries[5])),
        (json!(6), "answer 2")
    );
    assert!(entries[5].get("superseded_by").is_none());

    // Entry 1, the event: its turn runs again from the event, and its tool calls as usual.
    let again = rewind(&workspace, "s", 1);
    let rerun_again = wait_rerun_completed(&workspace, "s", &rerun);
    assert_eq!(runs(&workspace, "quick.runs"), 2, "a call after N runs");
    let result = delivered(&receiver, &rerun_again);
    assert_eq!(result["rewind_of"], json!({"session": "s", "entry": 1}));
    assert_eq!(result["output"], "answer 3");
    let entries = transcript(&workspace, "s");
    assert_eq!(entries.len(), 11, "{entries:#?}");
    let superseded: Vec<&str> = entries
        .iter()
        .map(|e| e["superseded_by"].as_str().unwrap_or("-"))
        .collect();
    let (t1, t2) = (turn_id.as_str(), again.as_str());
    assert_eq!(
        superseded,
        [t2, t2, t2, t2, t1, t2, "-", "-", "-", "-", "-"],
        "an entry keeps the rewind that superseded it first"
    );
    assert_lookup_turn(
        &entries[6..]
            .iter()
            .zip(1..)
            .map(|(e, n)| {
                let mut e = e.clone();
                e["n"] = json!(n);
                e
            })
            .collect::<Vec<_>>(),
    );
    let last = model.requests().pop().expect("a request");
    let seen = serde_json::to_string(&last.messages()).unwrap_or_default();
    assert!(
        !seen.contains("answer 1") && !seen.contains("answer 2"),
        "{seen}"
    );

    assert_the_reruns_are_visible(&workspace, &daemon, t1);
}

/// `sessions show` numbers the entries and says what superseded them; the journal, the ledger
/// and the metrics have the two reruns of session `s`, the first by turn `t1`.
fn assert_the_reruns_are_visible(workspace: &Workspace, daemon: &Daemon, t1: &str) {
    let shown = workspace.cli(&["sessions", "show", "s"]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains(&format!(
            "   5 [superseded by turn {t1}] assistant: answer 1"
        )),
        "{shown}"
    );
    assert!(shown.contains("  11 assistant: answer 3"), "{shown}");
    let log = daemon.log();
    assert!(
        log.contains("session rerun by the operator") && log.contains("superseded=5"),
        "{log}"
    );
    // A rerun is a dispatch: no resume is counted for it.
    let ledger = workspace.cli_json(&["ledger", "show", "--json"]);
    assert!(ledger["sessions"].get("s").is_none(), "{ledger}");
    assert!(
        workspace
            .metrics()
            .contains("agentgate_operator_actions_total{action=\"rewind\"} 2"),
        "{}",
        workspace.metrics()
    );
}

#[test]
fn a_rewind_is_refused_while_the_session_is_busy_and_for_an_entry_it_cannot_rerun() {
    let workspace = Workspace::new();
    let (model, receiver) = (model(), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, ""));
    let daemon = workspace.start();

    post(&daemon, "busy", "slowplan");
    wait_for_runs(&workspace, "side_effect.runs", 1);
    let refused = workspace.cli(&["sessions", "rewind", "busy", "--to", "1"]);
    assert_refused(&refused, "running");

    post(&daemon, "gated", "gateplan");
    wait_until("the approval request", LIMIT, || {
        workspace.session_json("gated")["session"]["state"] == "awaiting_approval"
    });
    let refused = workspace.cli(&["sessions", "rewind", "gated", "--to", "1"]);
    assert_refused(&refused, "awaiting_approval");

    let done = post(&daemon, "done", "lookplan");
    wait_completed(&workspace, "done", &done);
    let before = workspace
        .cli(&["sessions", "show", "done", "--json"])
        .stdout;
    for (n, why) in [
        ("3", "entry of kind tool_start"),
        ("4", "a tool result"),
        ("6", "no transcript entry 6"),
        ("0", "numbered from 1"),
    ] {
        let refused = workspace.cli(&["sessions", "rewind", "done", "--to", n]);
        assert_refused(&refused, why);
    }
    let refused = workspace.cli(&["sessions", "rewind", "nobody", "--to", "1"]);
    assert_refused(&refused, "no session");
    assert_eq!(
        workspace
            .cli(&["sessions", "show", "done", "--json"])
            .stdout,
        before,
        "a refused rewind changes nothing"
    );
    assert_eq!(runs(&workspace, "quick.runs"), 1);
    assert!(daemon.log().contains("rerun of a session refused"));
}

#[test]
fn a_rewind_killed_in_the_middle_resumes_and_finishes_once() {
    let workspace = Workspace::new();
    let receiver = receiver();
    // Answers at once the first time; asked again, calls the slow idempotent lookup.
    let model = Stub::start(|request, index| {
        if index == 0 {
            Reply::answer("first")
        } else if last_role(request) == "tool" || resumed(request) {
            Reply::answer("finished")
        } else {
            Reply::tool_call("call_r", "slow_lookup", json!({}))
        }
    });
    workspace.write_config(&config(&workspace, &model, &receiver, ""));
    let daemon = workspace.start();
    let first = post(&daemon, "k", "directplan");
    wait_completed(&workspace, "k", &first);

    let turn_id = rewind(&workspace, "k", 2);
    wait_for_runs(&workspace, "lookup.runs", 1);
    daemon.kill9();
    let _daemon = workspace.start();
    let rerun = wait_rerun_completed(&workspace, "k", &first);
    assert_eq!(
        runs(&workspace, "lookup.runs"),
        2,
        "the idempotent call ran again"
    );
    let result = delivered(&receiver, &rerun);
    assert_eq!(result["output"], "finished", "{result}");
    assert_eq!(result["rewind_of"], json!({"session": "k", "entry": 2}));
    assert_eq!(deliveries(&receiver, &rerun).len(), 1, "delivered once");
    let detail = workspace.cli_json(&["events", "show", &rerun, "--json"]);
    assert_eq!(detail["rewind_of"], json!({"session": "k", "entry": 2}));
    let turns: Vec<(String, String)> = detail["turns"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|t| {
            (
                t["id"].as_str().unwrap_or("").to_string(),
                t["status"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(turns.len(), 2, "{detail:#}");
    assert_eq!(turns[0], (turn_id.clone(), "interrupted".to_string()));
    assert_eq!(turns[1].1, "completed");
    let entries = transcript(&workspace, "k");
    assert_eq!(entries[1]["superseded_by"], turn_id.as_str());
    let answers: Vec<&str> = entries
        .iter()
        .filter(|e| e.get("superseded_by").is_none() && e["body"]["message"]["role"] == "assistant")
        .map(content)
        .collect();
    assert_eq!(answers, ["", "finished"], "{entries:#?}");
}

#[test]
fn a_fork_copies_the_history_before_its_entry_and_leaves_the_original_as_it_was() {
    let workspace = Workspace::new();
    let (model, receiver) = (model(), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, ""));
    let daemon = workspace.start();
    let first = post(&daemon, "orig", "lookplan");
    wait_completed(&workspace, "orig", &first);
    let shown_before = workspace
        .cli(&["sessions", "show", "orig", "--json"])
        .stdout;
    let ledger_before = workspace.cli(&["ledger", "show", "--json"]).stdout;

    let output = workspace.cli(&["sessions", "fork", "orig", "--at", "5", "--as", "copy"]);
    assert!(output.status.success(), "{output:?}");
    let turn_id = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let rerun = wait_rerun_completed(&workspace, "copy", "");
    let result = delivered(&receiver, &rerun);
    assert_eq!(result["session"], "copy");
    assert_eq!(result["turn_id"], turn_id.as_str());
    assert_eq!(result["fork_of"], json!({"session": "orig", "entry": 5}));
    assert_eq!(result["output"], "answer 2");
    assert_eq!(
        runs(&workspace, "quick.runs"),
        1,
        "no tool before N ran again"
    );

    assert_eq!(
        workspace
            .cli(&["sessions", "show", "orig", "--json"])
            .stdout,
        shown_before,
        "the original is untouched"
    );
    assert_eq!(
        workspace.cli(&["ledger", "show", "--json"]).stdout,
        ledger_before
    );
    let original = transcript(&workspace, "orig");
    let copy = workspace.session_json("copy");
    assert_eq!(copy["session"]["route"], "hook");
    let copied = copy["transcript"].as_array().cloned().unwrap_or_default();
    assert_eq!(copied.len(), 5, "{copied:#?}");
    for (copied, original) in copied[..4].iter().zip(&original) {
        assert_eq!(
            (&copied["n"], &copied["kind"], &copied["body"]),
            (&original["n"], &original["kind"], &original["body"])
        );
    }
    assert_eq!(content(&copied[4]), "answer 2");
    assert!(copied.iter().all(|e| e.get("superseded_by").is_none()));

    for new_key in ["copy", "orig"] {
        let refused = workspace.cli(&["sessions", "fork", "orig", "--at", "5", "--as", new_key]);
        assert_refused(&refused, "exists already");
    }
    drop(daemon);
}

/// With no daemon running, the state is changed directly and the next start runs the rerun.
#[test]
fn a_rewind_without_a_daemon_runs_at_the_next_start() {
    let workspace = Workspace::new();
    let (model, receiver) = (model(), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, ""));
    let daemon = workspace.start();
    let first = post(&daemon, "offline", "lookplan");
    wait_completed(&workspace, "offline", &first);
    assert!(daemon.terminate().success());

    let turn_id = rewind(&workspace, "offline", 5);
    assert_eq!(
        transcript(&workspace, "offline")[4]["superseded_by"],
        turn_id.as_str()
    );
    let _daemon = workspace.start();
    let rerun = wait_rerun_completed(&workspace, "offline", &first);
    assert_eq!(delivered(&receiver, &rerun)["turn_id"], turn_id.as_str());
    assert_eq!(runs(&workspace, "quick.runs"), 1);
}

#[test]
fn rewind_and_fork_on_postgresql() {
    let Some(pg) = Postgres::start("rewind_and_fork_on_postgresql") else {
        return;
    };
    let workspace = Workspace::new();
    let url_file = pg.url_file(workspace.path());
    let store = format!(
        "[store]\nbackend = \"postgres\"\nurl = {{ file = \"{}\" }}\nnode = \"n1\"\n",
        url_file.display()
    );
    let (model, receiver) = (model(), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, &store));
    let daemon = workspace.start();
    let first = post(&daemon, "pg", "lookplan");
    wait_completed(&workspace, "pg", &first);

    let turn_id = rewind(&workspace, "pg", 5);
    let rerun = wait_rerun_completed(&workspace, "pg", &first);
    let result = delivered(&receiver, &rerun);
    assert_eq!(result["rewind_of"], json!({"session": "pg", "entry": 5}));
    assert_eq!(result["turn_id"], turn_id.as_str());
    assert_eq!(runs(&workspace, "quick.runs"), 1);
    let entries = transcript(&workspace, "pg");
    assert_eq!(entries[4]["superseded_by"], turn_id.as_str());
    assert_eq!(entries.len(), 6);
    assert_refused(
        &workspace.cli(&["sessions", "rewind", "pg", "--to", "4"]),
        "a tool result",
    );

    let shown_before = workspace.cli(&["sessions", "show", "pg", "--json"]).stdout;
    let output = workspace.cli(&["sessions", "fork", "pg", "--at", "1", "--as", "pg-copy"]);
    assert!(output.status.success(), "{output:?}");
    let forked = wait_rerun_completed(&workspace, "pg-copy", "");
    assert_eq!(
        delivered(&receiver, &forked)["fork_of"],
        json!({"session": "pg", "entry": 1})
    );
    assert_eq!(
        runs(&workspace, "quick.runs"),
        2,
        "the fork's turn ran from the event"
    );
    assert_eq!(
        workspace.cli(&["sessions", "show", "pg", "--json"]).stdout,
        shown_before
    );
    assert_refused(
        &workspace.cli(&["sessions", "fork", "pg", "--at", "1", "--as", "pg-copy"]),
        "exists already",
    );
}
