//! Durable resume against the real binary: drain and crash interrupt turns, the next start
//! resumes them through the retry ledger, side effects are never re-run blindly, and a session
//! that keeps killing the process is suspended.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::marks::{self, marks, runs, slow_tools};
use common::stub::{Received, Reply, Stub};
use common::*;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);

fn messages(request: &Received) -> Vec<Value> {
    request.messages()
}

fn last_text(request: &Received) -> String {
    request.last_text()
}

/// The model: calls `tool` once, then answers once it sees a tool result or the resume note.
fn tool_then_answer(tool: &'static str) -> Stub {
    Stub::start(move |request, _| {
        let last = last_text(request);
        if request.json().to_string().contains("bystander") {
            Reply::answer("fine")
        } else if last.starts_with("[agentgate]") && last.contains("interrupted") {
            if last.contains("restored") {
                Reply::answer(
                    "The session was restored after an interruption. What should I do next?",
                )
            } else {
                Reply::answer("task finished")
            }
        } else if messages(request).iter().any(|m| m["role"] == "tool") {
            Reply::answer("task finished")
        } else {
            Reply::tool_call("call_1", tool, json!({}))
        }
    })
}

fn config(
    workspace: &Workspace,
    model: &Stub,
    receiver: &Stub,
    extra_route: &str,
    runtime: &str,
) -> String {
    // The tools' own directory: a writable path may not hold the state or the config.
    let marks = marks(workspace);
    let marks = marks.display();
    format!(
        r#"[runtime]
drain_timeout = "1s"
max_turn_steps = 8
{runtime}

{model}
{slow_tools}
[tools.flaky_lookup]
description = "Reads something; hangs on its first two runs"
command = ["/bin/sh", "-c", "echo ran >> {marks}/flaky.runs; [ $(wc -l < {marks}/flaky.runs) -ge 3 ] || sleep 30"]
writable = ["{marks}"]
timeout = "60s"
idempotent = true

[tools.keyed_write]
description = "Changes something, slowly, once per call key"
command = ["/bin/sh", "-c", "echo \"$AGENTGATE_TOOL_CALL_ID\" >> {marks}/keyed.runs; if [ $(grep -cx \"$AGENTGATE_TOOL_CALL_ID\" {marks}/keyed.runs) -gt 1 ]; then echo already done; else sleep 30; fi"]
writable = ["{marks}"]
timeout = "60s"
dedupes = true

[tools.report]
description = "Builds a report in the background"
command = ["/bin/sh", "-c", "sleep 1; echo report-ready"]
background = true

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
tools = ["slow_side_effect", "slow_lookup", "flaky_lookup", "keyed_write", "report"]
deliver = {{ kind = "http", url = "{receiver}/results" }}
{extra_route}
"#,
        model = model.model_section(),
        receiver = receiver.url(),
        slow_tools = slow_tools(workspace),
    )
}

fn receiver() -> Stub {
    Stub::start(|_, _| Reply::raw(204, ""))
}

fn post(daemon: &Daemon, session: &str) -> String {
    let response = daemon.post_json("/hook", &[], &json!({"session": session}).to_string());
    assert_eq!(response.status, 202, "{response:?}");
    response.event_id()
}

fn delivered(receiver: &Stub, event_id: &str) -> Value {
    let mut found = Value::Null;
    wait_until("the delivery", LIMIT, || {
        if let Some(request) = receiver
            .requests()
            .into_iter()
            .find(|r| r.header("webhook-id") == Some(event_id))
        {
            found = request.json();
        }
        !found.is_null()
    });
    found
}

fn wait_for_runs(workspace: &Workspace, name: &str, count: usize) {
    marks::wait_for_runs(workspace, name, count, LIMIT);
}

fn ledger(workspace: &Workspace) -> Value {
    std::fs::read(workspace.state_dir().join("ledger.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or(Value::Null)
}

#[test]
fn sigterm_mid_turn_resumes_and_completes_without_rerunning_the_side_effect() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_side_effect"), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let daemon = workspace.start();
    let event_id = post(&daemon, "term");
    wait_for_runs(&workspace, "side_effect.runs", 1);
    let status = daemon.terminate();
    assert!(status.success(), "drain must exit 0, got {status}");
    let session: Vec<(String, Option<String>)> = workspace.query(
        "SELECT state, reason FROM sessions WHERE key = 'term'",
        |row| Ok((row.get(0)?, row.get(1)?)),
    );
    assert_eq!(
        session,
        [(
            "resume_pending".to_string(),
            Some("shutdown_timeout".to_string())
        )]
    );

    let daemon = workspace.start();
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    assert_eq!(delivered(&receiver, &event_id)["output"], "task finished");
    assert_eq!(
        runs(&workspace, "side_effect.runs"),
        1,
        "a non-idempotent tool ran again"
    );
    let resumed = model
        .requests()
        .last()
        .cloned()
        .expect("a request after the restart");
    let conversation = messages(&resumed);
    let tool_result = conversation
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("tool result");
    assert!(
        tool_result["content"]
            .as_str()
            .unwrap_or("")
            .contains("interrupted")
    );
    let note = last_text(&resumed);
    assert!(
        note.contains("Continue the interrupted task") && !note.contains("restored"),
        "{note}"
    );
    assert!(daemon.log().contains("interrupted session resumed"));
    // A completed resume clears the session's ledger entry.
    wait_until("the ledger entry to be cleared", LIMIT, || {
        ledger(&workspace)["sessions"].get("term").is_none()
    });
}

#[test]
fn interactive_route_reports_the_restoration() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_side_effect"), receiver());
    workspace.write_config(&config(
        &workspace,
        &model,
        &receiver,
        "interactive = true",
        "",
    ));
    let daemon = workspace.start();
    let event_id = post(&daemon, "chat");
    wait_for_runs(&workspace, "side_effect.runs", 1);
    assert!(daemon.terminate().success());
    let _daemon = workspace.start();
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    let output = delivered(&receiver, &event_id)["output"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(output.contains("restored"), "{output}");
    assert!(last_text(&model.requests().last().cloned().expect("request")).contains("restored"));
}

#[test]
fn sigkill_mid_turn_resumes_as_crashed_and_reruns_an_idempotent_tool() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_lookup"), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let daemon = workspace.start();
    let event_id = post(&daemon, "crash");
    wait_for_runs(&workspace, "lookup.runs", 1);
    daemon.kill9();
    let daemon = workspace.start();
    // The idempotent lookup runs again (quickly, this time) and the turn completes.
    wait_for_runs(&workspace, "lookup.runs", 2);
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    assert_eq!(delivered(&receiver, &event_id)["output"], "task finished");
    let turns: Vec<(String, Option<String>)> = workspace.query(
        "SELECT status, reason FROM turns WHERE session_key = 'crash' ORDER BY started_at",
        |row| Ok((row.get(0)?, row.get(1)?)),
    );
    assert_eq!(
        turns,
        [
            ("interrupted".to_string(), Some("crashed".to_string())),
            ("completed".to_string(), None)
        ]
    );
    assert!(daemon.log().contains("reason=crashed"), "{}", daemon.log());
    // The completed resume clears the ledger entry it had counted, once the completion is
    // committed (so just after the terminal status can be read).
    wait_until("the ledger entry to be cleared", LIMIT, || {
        ledger(&workspace)["sessions"].get("crash").is_none()
    });
}

/// An idempotent call cut off twice (by two crashes, in the original run and in its first
/// resume) is run a third time, not dropped: every call the model sees has exactly one result,
/// in every request, whatever crashed when.
#[test]
fn an_idempotent_call_cut_off_twice_runs_again_and_every_call_has_one_result() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("flaky_lookup"), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let mut daemon = workspace.start();
    let event_id = post(&daemon, "twice");
    for run in 1..=2 {
        wait_for_runs(&workspace, "flaky.runs", run);
        daemon.kill9();
        daemon = workspace.start();
    }
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    assert_eq!(runs(&workspace, "flaky.runs"), 3);
    for request in model.requests() {
        let messages = messages(&request);
        for call in messages
            .iter()
            .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default())
        {
            let answers = messages
                .iter()
                .filter(|m| m["role"] == "tool" && m["tool_call_id"] == call["id"])
                .count();
            assert_eq!(
                answers, 1,
                "call {call} has {answers} results in {messages:?}"
            );
        }
    }
    drop(daemon);
}

#[test]
fn sigkill_mid_call_reruns_a_tool_that_dedupes_with_the_same_call_key() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("keyed_write"), receiver());
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let daemon = workspace.start();
    let event_id = post(&daemon, "keyed");
    wait_for_runs(&workspace, "keyed.runs", 1);
    daemon.kill9();
    let _daemon = workspace.start();
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    // Run again, with the key of the run that was cut off: the tool saw it and did nothing.
    let keys = std::fs::read_to_string(marks(&workspace).join("keyed.runs")).expect("runs");
    let keys: Vec<&str> = keys.lines().collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(!keys[0].is_empty() && keys[0] == keys[1], "{keys:?}");
    let resumed = model.requests().last().cloned().expect("request");
    let result = messages(&resumed)
        .into_iter()
        .find(|m| m["role"] == "tool")
        .expect("tool result");
    assert!(
        result["content"]
            .as_str()
            .is_some_and(|c| c.contains("already done")),
        "{result}"
    );
}

/// How many model requests mention `text`.
fn calls_about(model: &Stub, text: &str) -> usize {
    model
        .requests()
        .iter()
        .filter(|r| r.json().to_string().contains(text))
        .count()
}

/// A slow, legitimate turn that runs whenever a poison session kills the process is not
/// suspended with it: the crash that cut both off counts against neither, each resumes alone,
/// and only the crashes of the poison session while it ran alone count.
#[test]
fn a_crash_loop_suspends_the_poison_session_and_not_the_turn_beside_it() {
    let workspace = Workspace::new();
    let model = Stub::start(|request, _| {
        let text = request.json().to_string();
        if text.contains("poison") {
            Reply::answer("never seen").after(Duration::from_secs(120))
        } else {
            // Slow on every run: whenever the poison session crashes, it is running.
            Reply::answer("looked into it").after(Duration::from_secs(3))
        }
    });
    let receiver = receiver();
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let mut daemon = workspace.start();
    let bystander = post(&daemon, "bystander");
    wait_until("the bystander to reach the model", LIMIT, || {
        calls_about(&model, "bystander") >= 1
    });
    let poison = post(&daemon, "poison");
    // The first run crashes beside the bystander (counted against neither); its resume runs
    // alone and crashes (counted: 1); three more counted crashes suspend it.
    for run in 1..=5 {
        wait_until(
            &format!("poison run {run} to reach the model"),
            LIMIT,
            || calls_about(&model, "poison") >= run,
        );
        if run == 2 {
            let log = daemon.log();
            assert!(log.contains("resumed alone"), "{log}");
        }
        daemon.kill9();
        daemon = workspace.start();
    }
    assert_eq!(workspace.wait_terminal(&poison, LIMIT), "suspended");
    assert_eq!(workspace.wait_terminal(&bystander, LIMIT), "completed");
    assert_eq!(delivered(&receiver, &bystander)["status"], "completed");
    assert_eq!(calls_about(&model, "poison"), 5);
    let ledger = ledger(&workspace);
    assert!(ledger["sessions"].get("bystander").is_none(), "{ledger}");
}

#[test]
fn a_session_that_kills_the_process_every_time_is_suspended_and_others_keep_working() {
    let workspace = Workspace::new();
    // The poison session's model call never returns; every other session is answered at once.
    let model = Stub::start(|request, _| {
        if request.json().to_string().contains("poison") {
            Reply::answer("never seen").after(Duration::from_secs(120))
        } else {
            Reply::answer("fine")
        }
    });
    let receiver = receiver();
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let poison_calls = |model: &Stub| {
        model
            .requests()
            .iter()
            .filter(|r| r.json().to_string().contains("poison"))
            .count()
    };
    let mut daemon = workspace.start();
    let poison = post(&daemon, "poison");
    // The first run and three resumes each get as far as the model, and each is killed there.
    // Others run beside its first run; each resume after a crash runs alone, so the events that
    // arrive meanwhile wait for it, and run once it is suspended.
    let mut healthy = Vec::new();
    for run in 1..=4 {
        wait_until(
            &format!("poison run {run} to reach the model"),
            LIMIT,
            || poison_calls(&model) >= run,
        );
        let event_id = post(&daemon, &format!("healthy-{run}"));
        if run == 1 {
            assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
        }
        healthy.push(event_id);
        daemon.kill9();
        daemon = workspace.start();
    }
    assert_eq!(workspace.wait_terminal(&poison, LIMIT), "suspended");
    for event_id in &healthy {
        assert_eq!(workspace.wait_terminal(event_id, LIMIT), "completed");
    }
    let body = delivered(&receiver, &poison);
    assert_eq!(body["status"], "suspended");
    assert_eq!(
        poison_calls(&model),
        4,
        "dispatched more than resume_max_attempts resumes"
    );
    assert!(daemon.log().contains("session suspended"));
    let state: Vec<String> = workspace
        .query("SELECT state FROM sessions WHERE key = 'poison'", |r| {
            r.get(0)
        });
    assert_eq!(state, ["suspended"]);
    // Its ledger entry went with the committed suspension; other sessions still work.
    wait_until("the ledger entry to be cleared", LIMIT, || {
        ledger(&workspace)["sessions"].get("poison").is_none()
    });
    let after = post(&daemon, "healthy-after");
    assert_eq!(workspace.wait_terminal(&after, LIMIT), "completed");
    // The operator can resume it, and the event it was suspended on runs again.
    let output = workspace.cli(&["sessions", "resume", "poison"]);
    assert!(output.status.success(), "{output:?}");
    let state: Vec<String> = workspace
        .query("SELECT state FROM sessions WHERE key = 'poison'", |r| {
            r.get(0)
        });
    assert_ne!(state, ["suspended"]);
    wait_until("the suspended event to run again", LIMIT, || {
        poison_calls(&model) == 5
    });
}

fn crash_one_turn(workspace: &Workspace, model: &Stub, receiver: &Stub, runtime: &str) -> String {
    workspace.write_config(&config(workspace, model, receiver, "", runtime));
    let daemon = workspace.start();
    let event_id = post(&daemon, "victim");
    wait_for_runs(workspace, "side_effect.runs", 1);
    daemon.kill9();
    event_id
}

#[test]
fn a_malformed_ledger_dispatches_nothing_and_is_left_as_it_was() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_side_effect"), receiver());
    let event_id = crash_one_turn(&workspace, &model, &receiver, "");
    let ledger_path = workspace.state_dir().join("ledger.json");
    std::fs::write(&ledger_path, b"{\"version\": 1, \"sessions\": [oops").expect("corrupt");
    let requests_before = model.requests().len();
    let daemon = workspace.start();
    let other = post(&daemon, "bystander");
    assert_eq!(workspace.wait_terminal(&other, LIMIT), "completed");
    wait_until("the refusal in the log", LIMIT, || {
        daemon.log().contains("resume refused")
    });
    assert!(daemon.log().contains("ledger.json is malformed"));
    assert_eq!(workspace.event_status(&event_id), "running");
    assert_eq!(
        std::fs::read(&ledger_path).expect("ledger"),
        b"{\"version\": 1, \"sessions\": [oops"
    );
    let victim_requests = model.requests()[requests_before..]
        .iter()
        .filter(|r| r.json().to_string().contains("victim"))
        .count();
    assert_eq!(
        victim_requests, 0,
        "a resume was dispatched past a malformed ledger"
    );
}

#[test]
fn an_unwritable_ledger_dispatches_nothing_and_keeps_the_old_count() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_side_effect"), receiver());
    let event_id = crash_one_turn(&workspace, &model, &receiver, "");
    let ledger_path = workspace.state_dir().join("ledger.json");
    let existing = b"{\"version\": 1, \"sessions\": {\"victim\": {\"attempts\": 1, \"last_attempt\": \"2026-01-01T00:00:00Z\"}}}";
    std::fs::write(&ledger_path, existing).expect("ledger");
    let shim = failsync_shim(workspace.path());
    // Every fsync of the ledger's temporary file fails: the new count can never be made durable.
    let daemon = workspace.start_with_env(&[
        ("LD_PRELOAD", shim.to_str().expect("path")),
        ("FAILSYNC_MATCH", ".agentgate-ledger"),
    ]);
    wait_until("the refusal in the log", LIMIT, || {
        daemon.log().contains("resume refused")
    });
    assert_eq!(workspace.event_status(&event_id), "running");
    assert_eq!(std::fs::read(&ledger_path).expect("ledger"), existing);
    let other = post(&daemon, "bystander");
    assert_eq!(workspace.wait_terminal(&other, LIMIT), "completed");
}

#[test]
fn an_interruption_older_than_resume_window_is_abandoned_and_delivered() {
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_side_effect"), receiver());
    let event_id = crash_one_turn(&workspace, &model, &receiver, "resume_window = \"1s\"");
    // Until the interrupted turn started longer ago than resume_window, by the clock the daemon
    // compares with.
    wait_until("resume_window to pass", LIMIT, || {
        let started: Vec<i64> = workspace.query(
            &format!("SELECT started_at FROM turns WHERE event_id = '{event_id}'"),
            |row| row.get(0),
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        started.first().is_some_and(|at| now - at > 1_000)
    });
    let daemon = workspace.start();
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "abandoned");
    assert_eq!(delivered(&receiver, &event_id)["status"], "abandoned");
    assert!(daemon.log().contains("abandoned"));
}

#[test]
fn a_model_that_stops_replying_fails_at_turn_idle_timeout() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("too late").after(Duration::from_secs(60)));
    let receiver = receiver();
    workspace.write_config(&config(
        &workspace,
        &model,
        &receiver,
        "",
        "turn_idle_timeout = \"1s\"",
    ));
    let daemon = workspace.start();
    let event_id = post(&daemon, "idle");
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "failed");
    let body = delivered(&receiver, &event_id);
    assert!(
        body["error"]
            .as_str()
            .unwrap_or("")
            .contains("turn_idle_timeout"),
        "{body}"
    );
}

#[test]
fn a_background_job_completion_waits_for_the_running_turn_and_runs_next() {
    let workspace = Workspace::new();
    // Turn 1 starts the job, then its next model call is slow (the job finishes meanwhile);
    // the completion must not interrupt it, even with on_busy = "interrupt".
    let model = Stub::start(|request, _| {
        let body = request.json().to_string();
        if body.contains("report-ready") {
            Reply::answer("the report is ready")
        } else if body.contains("job_id") {
            Reply::answer("started the report").after(Duration::from_secs(3))
        } else {
            Reply::tool_call("bg_1", "report", json!({}))
        }
    });
    let receiver = receiver();
    workspace.write_config(&config(
        &workspace,
        &model,
        &receiver,
        "on_busy = \"interrupt\"",
        "",
    ));
    let daemon = workspace.start();
    let event_id = post(&daemon, "bg");
    assert_eq!(workspace.wait_terminal(&event_id, LIMIT), "completed");
    assert_eq!(
        delivered(&receiver, &event_id)["output"],
        "started the report"
    );
    let mut turns: Vec<(String, String, i64, i64)> = Vec::new();
    wait_until("the completion's turn", LIMIT, || {
        turns = workspace.query(
            "SELECT event_id, status, started_at, COALESCE(finished_at, 0) FROM turns
             WHERE session_key = 'bg' ORDER BY started_at",
            |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
        );
        turns.len() == 2 && turns[1].1 == "completed"
    });
    assert_eq!(turns[0].1, "completed", "the running turn was interrupted");
    assert!(
        turns[1].2 >= turns[0].3,
        "the completion ran before the turn ended: {turns:?}"
    );
    let completion = &turns[1].0;
    assert_eq!(
        delivered(&receiver, completion)["output"],
        "the report is ready"
    );
    // Internal events are not accepted webhooks.
    assert_eq!(workspace.events_total(), 1);
    drop(daemon);
}

#[test]
fn operator_commands_run_as_root_leave_the_state_to_the_daemon_user() {
    if !root_or_skip("operator_commands_run_as_root_leave_the_state_to_the_daemon_user") {
        return;
    }
    let workspace = Workspace::new();
    let (model, receiver) = (tool_then_answer("slow_side_effect"), receiver());
    let event_id = crash_one_turn(&workspace, &model, &receiver, "");
    assert_eq!(workspace.event_status(&event_id), "running");
    // The state belongs to an unprivileged user, as /var/lib/agentgate belongs to _agentgate.
    let nobody = "65534:65534";
    let status = std::process::Command::new("chown")
        .args(["-R", nobody])
        .arg(workspace.state_dir())
        .status()
        .expect("chown");
    assert!(status.success());
    let output = workspace.cli(&["sessions", "resume", "victim"]);
    assert!(output.status.success(), "{output:?}");
    let output = workspace.cli(&["status"]);
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("ledger:"),
        "{output:?}"
    );
    for entry in std::fs::read_dir(workspace.state_dir())
        .expect("state dir")
        .flatten()
    {
        use std::os::unix::fs::MetadataExt;
        let metadata = entry.metadata().expect("metadata");
        assert_eq!(
            metadata.uid(),
            65534,
            "{} is owned by uid {} after an operator command",
            entry.path().display(),
            metadata.uid()
        );
    }
}

fn post_numbered(daemon: &Daemon, session: &str, n: u32) -> String {
    let body = json!({"session": session, "label": format!("event-{n}")}).to_string();
    let response = daemon.post_json("/hook", &[], &body);
    assert_eq!(response.status, 202, "{response:?}");
    response.event_id()
}

/// (started_at, finished_at) of each turn of `session`, in start order.
fn turn_times(workspace: &Workspace, session: &str) -> Vec<(i64, i64)> {
    workspace.query(
        &format!(
            "SELECT started_at, COALESCE(finished_at, 0) FROM turns WHERE session_key = '{session}' ORDER BY started_at"
        ),
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
}

/// Suspending a session while its turn runs and resuming it at once must not start its next
/// event beside the running turn: one turn per session, whatever the operator does.
#[test]
fn resuming_a_session_suspended_mid_turn_never_runs_two_turns_at_once() {
    let workspace = Workspace::new();
    let model = Stub::start(|request, _| {
        if request.json().to_string().contains("event-1") {
            Reply::answer("first done").after(Duration::from_secs(3))
        } else {
            Reply::answer("second done")
        }
    });
    let receiver = receiver();
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let daemon = workspace.start();
    let first = post_numbered(&daemon, "busy", 1);
    wait_until("the first turn to reach the model", LIMIT, || {
        !model.requests().is_empty()
    });
    let second = post_numbered(&daemon, "busy", 2);
    for action in ["suspend", "resume"] {
        let output = workspace.cli(&["sessions", action, "busy"]);
        assert!(output.status.success(), "{action}: {output:?}");
    }
    assert_eq!(workspace.wait_terminal(&first, LIMIT), "completed");
    assert_eq!(workspace.wait_terminal(&second, LIMIT), "completed");
    let turns = turn_times(&workspace, "busy");
    assert_eq!(turns.len(), 2, "{turns:?}");
    assert!(
        turns[1].0 >= turns[0].1,
        "the second turn started before the first ended: {turns:?}"
    );
}

/// A suspension is durable: a session suspended while its turn ran is not resumed at the next
/// start, although the process died mid-turn; its interrupted event waits, and runs (as a
/// resume) when the operator resumes the session.
#[test]
fn a_suspension_outlives_a_crash_and_its_interrupted_event_runs_on_resume() {
    suspension_outlives(Interruption::Crash);
}

/// As after a crash, so after a drain that cut the turn off.
#[test]
fn a_suspension_outlives_a_drain_and_its_interrupted_event_runs_on_resume() {
    suspension_outlives(Interruption::Drain);
}

enum Interruption {
    Crash,
    Drain,
}

/// A session suspended while its turn runs, then the turn cut off: the suspension holds across
/// the restart, the event waits queued, and `sessions resume` runs it from its transcript.
fn suspension_outlives(interruption: Interruption) {
    let workspace = Workspace::new();
    let held_calls = Arc::new(AtomicUsize::new(0));
    let counter = held_calls.clone();
    let model = Stub::start(move |request, _| {
        if request.json().to_string().contains("held") {
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                return Reply::answer("never seen").after(Duration::from_secs(120));
            }
            return Reply::answer("resumed and done");
        }
        Reply::answer("fine")
    });
    let receiver = receiver();
    workspace.write_config(&config(&workspace, &model, &receiver, "", ""));
    let daemon = workspace.start();
    let held = post(&daemon, "held");
    wait_until("the turn to reach the model", LIMIT, || {
        held_calls.load(Ordering::SeqCst) == 1
    });
    let output = workspace.cli(&["sessions", "suspend", "held"]);
    assert!(output.status.success(), "{output:?}");
    match interruption {
        Interruption::Crash => daemon.kill9(),
        Interruption::Drain => assert!(daemon.terminate().success()),
    }

    let daemon = workspace.start();
    let state = |workspace: &Workspace| -> Vec<String> {
        workspace.query("SELECT state FROM sessions WHERE key = 'held'", |r| {
            r.get(0)
        })
    };
    assert_eq!(state(&workspace), ["suspended"]);
    // Nothing runs it until the operator resumes the session: it waits, queued, not "running".
    assert_eq!(workspace.event_status(&held), "queued");
    let bystander = post(&daemon, "bystander");
    assert_eq!(workspace.wait_terminal(&bystander, LIMIT), "completed");
    assert_eq!(state(&workspace), ["suspended"]);
    assert_eq!(
        held_calls.load(Ordering::SeqCst),
        1,
        "resumed despite the suspension"
    );
    wait_until("the ledger entry to be cleared", LIMIT, || {
        ledger(&workspace)["sessions"].get("held").is_none()
    });

    let output = workspace.cli(&["sessions", "resume", "held"]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(workspace.wait_terminal(&held, LIMIT), "completed");
    assert_eq!(delivered(&receiver, &held)["output"], "resumed and done");
}
