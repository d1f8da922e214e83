//! Approvals against the real binary: a tool with `approval = true` waits for an operator's
//! decision (taken with the CLI over the control socket, or on the state while the daemon is
//! stopped), and the turn continues with the decision: the call runs once, or the model is told
//! it was denied or expired.

mod common;

use std::path::Path;
use std::time::Duration;

use common::stub::{Reply, Stub};
use common::*;
use serde_json::json;

const TURN_LIMIT: Duration = Duration::from_secs(30);

/// A model that asks for `deploy` once, then answers with what the tool said.
fn deploying_model() -> Stub {
    Stub::start(|request, _| {
        let body = request.json();
        let last = body["messages"].as_array().and_then(|m| m.last()).cloned();
        match last {
            Some(message) if message["role"] == "tool" => Reply::answer(&format!(
                "result: {}",
                message["content"].as_str().unwrap_or("")
            )),
            _ => Reply::tool_call("call-1", "deploy", json!({"target": "prod"})),
        }
    })
}

struct Setup {
    workspace: Workspace,
    model: Stub,
    receiver: Stub,
}

impl Setup {
    fn new(runtime_extra: &str) -> Setup {
        Setup::asked_by(deploying_model(), runtime_extra)
    }

    /// As [`Setup::new`], with `model` asking.
    fn asked_by(model: Stub, runtime_extra: &str) -> Setup {
        let workspace = Workspace::new();
        let receiver = Stub::start(|_, _| Reply::raw(204, ""));
        let deliver = format!(
            "{{ kind = \"http\", url = \"{}/results\" }}",
            receiver.url()
        );
        Setup::configured(workspace, (model, receiver), ("", runtime_extra), &deliver)
    }

    /// With `public_url` on the listener, and `deliver` as the route's target.
    fn linked(workspace: Workspace, receiver: Stub, deliver: &str) -> Setup {
        let server = format!("public_url = \"http://{}/\"", workspace.addr());
        Setup::configured(
            workspace,
            (deploying_model(), receiver),
            (&server, ""),
            deliver,
        )
    }

    /// `stubs`: the model and the receiver of deliveries; `extra`: lines for `[server]` (the
    /// table the workspace's config starts with) and for `[runtime]`.
    fn configured(
        workspace: Workspace,
        stubs: (Stub, Stub),
        extra: (&str, &str),
        deliver: &str,
    ) -> Setup {
        let ((model, receiver), (server, runtime)) = (stubs, extra);
        let runs = workspace.path().join("runs.log");
        workspace.write_config(&format!(
            r#"{server}
[runtime]
max_turn_steps = 6
{runtime}

[model]
backend = "openai"
base_url = "{model}/v1"
model = "stub-model"
request_timeout = "5s"
max_retries = 1

[tools.deploy]
description = "Deploy to a target"
command = ["/bin/sh", "-c", "cat >> {runs}; echo; if [ -e {hold} ]; then sleep 60; fi; echo deployed"]
parameters = {{ type = "object", properties = {{ target = {{ type = "string", enum = ["prod", "staging"] }} }}, required = ["target"] }}
approval = true
sandbox = "none"

[routes.ops]
path = "/hooks/ops"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
system = "You run deployments."
tools = ["deploy"]
deliver = {deliver}
"#,
            model = model.url(),
            runs = runs.display(),
            hold = workspace.path().join("hold").display(),
        ));
        Setup {
            workspace,
            model,
            receiver,
        }
    }

    /// The calls of `deploy` that ran (each appends its arguments to the log).
    fn runs(&self) -> usize {
        std::fs::read_to_string(self.workspace.path().join("runs.log"))
            .map(|text| text.matches(r#""target""#).count())
            .unwrap_or(0)
    }

    fn pending(&self) -> Vec<serde_json::Value> {
        self.workspace.cli_json(&["approvals", "list", "--json"])["approvals"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until event `id` awaits a decision, and returns the approval id.
    fn wait_awaiting(&self, id: &str) -> String {
        wait_until("the event to await approval", TURN_LIMIT, || {
            self.workspace.event_status(id) == "awaiting_approval"
        });
        let pending = self.pending();
        assert_eq!(pending.len(), 1, "{pending:?}");
        pending[0]["id"].as_str().unwrap_or_default().to_string()
    }

    fn delivered_output(&self, event_id: &str) -> serde_json::Value {
        let mut found = None;
        wait_until("the delivery", TURN_LIMIT, || {
            found = self
                .receiver
                .requests()
                .into_iter()
                .find(|r| r.header("webhook-id") == Some(event_id));
            found.is_some()
        });
        found
            .map(|r| r.json()["output"].clone())
            .unwrap_or_default()
    }
}

/// With `deliver = log`, the request goes to the journal without its links: whoever holds a
/// link decides with it, and the journal is read more widely than a route's target.
#[test]
fn a_request_delivered_to_the_journal_leaves_its_links_out() {
    let workspace = Workspace::new();
    let unused = Stub::start(|_, _| Reply::raw(204, ""));
    let setup = Setup::linked(workspace, unused, r#"{ kind = "log" }"#);
    let daemon = setup.workspace.start();
    let event = post(&daemon, "journal");
    let approval = setup.wait_awaiting(&event);
    daemon.wait_for_log(&approval);
    wait_until("the request in the journal", TURN_LIMIT, || {
        daemon
            .log()
            .lines()
            .any(|line| line.contains("approval_request") && line.contains("not logged"))
    });
    let log = daemon.log();
    assert!(!log.contains("/approvals/"), "{log}");
}

fn post(daemon: &Daemon, session: &str) -> String {
    let response = daemon.post_json(
        "/hooks/ops",
        &[],
        &json!({"session": session, "text": "ship it"}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    response.event_id()
}

fn decide(workspace: &Workspace, args: &[&str]) -> (bool, String) {
    let output = workspace.cli(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// The tool results the model was sent, in order.
fn tool_results(model: &Stub) -> Vec<String> {
    let mut results: Vec<String> = Vec::new();
    for request in model.requests() {
        for message in request.json()["messages"].as_array().into_iter().flatten() {
            if message["role"] == "tool" {
                let content = message["content"].as_str().unwrap_or("").to_string();
                if !results.contains(&content) {
                    results.push(content);
                }
            }
        }
    }
    results
}

fn user_name() -> String {
    let output = std::process::Command::new("id")
        .arg("-un")
        .output()
        .expect("id");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|line| line.starts_with(prefix))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// An approval request goes out as soon as it is committed: the deliverer is rung, as for a
/// turn's result. Its periodic read of the outbox is an hour apart here, so a request that
/// waited for it would not arrive.
#[test]
fn an_approval_request_is_delivered_without_waiting_for_the_outbox_poll() {
    let setup = Setup::new("");
    let daemon = setup
        .workspace
        .start_with_env(&[("AGENTGATE_OUTBOX_POLL", "1h")]);
    let event = post(&daemon, "deploy-at-once");
    let approval = setup.wait_awaiting(&event);
    wait_until("the approval request's delivery", TURN_LIMIT, || {
        setup.receiver.requests().iter().any(|request| {
            let body = request.json();
            body["kind"] == "approval_request" && body["approval_id"] == approval.as_str()
        })
    });
}

/// The gated call waits: nothing runs and the model is not asked again until a person decides;
/// approved, the call runs exactly once with the arguments shown, the turn completes, and a
/// second decision is refused.
#[test]
fn an_approved_call_runs_once_after_the_decision() {
    let setup = Setup::new("");
    let daemon = setup.workspace.start();
    let event = post(&daemon, "deploy-1");
    let approval = setup.wait_awaiting(&event);
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(shown["tool"], "deploy", "{shown}");
    assert_eq!(shown["arguments"], json!({"target": "prod"}), "{shown}");
    assert_eq!(shown["status"], "pending", "{shown}");
    assert_eq!(setup.runs(), 0, "nothing runs before the decision");
    assert_eq!(setup.model.requests().len(), 1);
    let status = setup.workspace.status();
    assert_eq!(status["approvals"]["pending"], 1, "{status}");
    assert_eq!(
        status["sessions"]["by_state"]["awaiting_approval"], 1,
        "{status}"
    );
    assert_eq!(
        metric(&setup.workspace.metrics(), "agentgate_approvals_pending "),
        1.0
    );

    let (ok, text) = decide(
        &setup.workspace,
        &["approvals", "approve", &approval, "--note", "looks right"],
    );
    assert!(ok, "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    assert_eq!(setup.runs(), 1, "the approved call ran once");
    let runs = std::fs::read_to_string(setup.workspace.path().join("runs.log")).unwrap_or_default();
    assert!(
        runs.contains(r#"{"target":"prod"}"#),
        "with the arguments shown: {runs}"
    );
    let output = setup.delivered_output(&event);
    assert!(
        output.as_str().is_some_and(|o| o.contains("deployed")),
        "{output}"
    );

    let (ok, text) = decide(&setup.workspace, &["approvals", "deny", &approval]);
    assert!(!ok && text.contains("already decided"), "{text}");
    let decided = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(decided["status"], "approved", "{decided}");
    assert_eq!(decided["decided_by"], user_name().as_str(), "{decided}");
    assert_eq!(decided["note"], "looks right", "{decided}");
    let transcript = setup.workspace.session_json("deploy-1")["transcript"].clone();
    let approvals: Vec<&str> = transcript
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["kind"] == "approval")
        .filter_map(|row| row["body"]["status"].as_str())
        .collect();
    assert_eq!(approvals, ["pending", "approved"], "{transcript}");
    let metrics = setup.workspace.metrics();
    assert_eq!(
        metric(
            &metrics,
            r#"agentgate_approvals_total{tool="deploy",decision="approved"}"#
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "agentgate_approvals_pending "), 0.0);
}

/// A model that asks for `deploy prod` under an id the turn already ran, in a later reply
/// beside a new call: the approval of the first call does not let the second one run. It asks
/// for a decision of its own, under an id of its own, once the call before it is decided.
#[test]
fn an_approval_does_not_run_a_later_call_that_reuses_its_id() {
    let model = Stub::start(|request, _| {
        let messages = request.messages();
        let asked_twice = messages.iter().any(|message| {
            message["tool_calls"]
                .as_array()
                .is_some_and(|calls| calls.len() == 2)
        });
        if messages.iter().all(|message| message["role"] != "tool") {
            return Reply::tool_call("call-1", "deploy", json!({"target": "prod"}));
        }
        if asked_twice {
            return Reply::answer("done");
        }
        Reply::completion(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call-2", "type": "function",
             "function": {"name": "deploy", "arguments": r#"{"target":"staging"}"#}},
            {"id": "call-1", "type": "function",
             "function": {"name": "deploy", "arguments": r#"{"target":"prod"}"#}}]}))
    });
    let setup = Setup::asked_by(model, "");
    let daemon = setup.workspace.start();
    let event = post(&daemon, "reused-id");
    let first = setup.wait_awaiting(&event);
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &first]);
    assert!(ok, "{text}");
    let staging = setup.wait_awaiting(&event);
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &staging, "--json"]);
    assert_eq!(shown["arguments"], json!({"target": "staging"}), "{shown}");
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &staging]);
    assert!(ok, "{text}");
    let mut status = String::new();
    wait_until("the turn to ask again or end", TURN_LIMIT, || {
        status = setup.workspace.event_status(&event);
        matches!(
            status.as_str(),
            "awaiting_approval" | "completed" | "failed"
        )
    });
    let runs = std::fs::read_to_string(setup.workspace.path().join("runs.log")).unwrap_or_default();
    assert_eq!(
        runs.matches("prod").count(),
        1,
        "one approval, one run of the call it was taken on: {runs}"
    );
    assert_eq!(status, "awaiting_approval", "{runs}");
    let again = setup.pending();
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(
        again[0]["arguments"],
        json!({"target": "prod"}),
        "{again:?}"
    );
    assert_eq!(again[0]["call_id"], "call-1-2", "{again:?}");
    let (ok, text) = decide(
        &setup.workspace,
        &[
            "approvals",
            "deny",
            again[0]["id"].as_str().unwrap_or_default(),
        ],
    );
    assert!(ok, "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    let runs = std::fs::read_to_string(setup.workspace.path().join("runs.log")).unwrap_or_default();
    assert_eq!(
        (
            runs.matches("prod").count(),
            runs.matches("staging").count()
        ),
        (1, 1),
        "{runs}"
    );
}

/// Denied: the call does not run and the model is told "denied by operator" with the reason.
/// Expired: the model is told the call expired and did not run.
#[test]
fn a_denied_or_expired_call_does_not_run_and_the_model_is_told() {
    let setup = Setup::new("approval_timeout = \"2s\"");
    let daemon = setup.workspace.start();
    let denied = post(&daemon, "deny-1");
    let approval = setup.wait_awaiting(&denied);
    let (ok, text) = decide(
        &setup.workspace,
        &[
            "approvals",
            "deny",
            &approval,
            "--reason",
            "not during the freeze",
        ],
    );
    assert!(ok, "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&denied, TURN_LIMIT),
        "completed"
    );
    let results = tool_results(&setup.model);
    assert!(
        results
            .iter()
            .any(|r| r.contains("denied by operator") && r.contains("not during the freeze")),
        "{results:?}"
    );

    let expired = post(&daemon, "expire-1");
    let approval = setup.wait_awaiting(&expired);
    assert_eq!(
        setup.workspace.wait_terminal(&expired, TURN_LIMIT),
        "completed"
    );
    let results = tool_results(&setup.model);
    assert!(
        results.iter().any(|r| r.starts_with("error: expired")),
        "{results:?}"
    );
    assert_eq!(setup.runs(), 0, "neither call ran");
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &approval]);
    assert!(!ok && text.contains("already decided: expired"), "{text}");
    assert!(
        daemon.log().contains("approval request expires soon"),
        "a warning comes before the expiry"
    );
}

/// A pending approval holds no turn: SIGTERM with 100 of them exits at once (not after
/// `drain_timeout`), the requests survive the restart, and a decision taken while the daemon is
/// stopped is carried out at the next start. Later events of the session wait behind the
/// decision and then run in order.
#[test]
fn a_pending_approval_survives_restarts_and_later_events_queue_behind_it() {
    let setup = Setup::new("drain_timeout = \"30s\"");
    let daemon = setup.workspace.start();
    let first = post(&daemon, "ordered");
    let approval = setup.wait_awaiting(&first);
    let second = post(&daemon, "ordered");
    for n in 0..99 {
        post(&daemon, &format!("other-{n}"));
    }
    wait_until("100 pending approvals", TURN_LIMIT, || {
        setup.pending().len() == 100
    });
    assert_eq!(setup.workspace.event_status(&second), "queued");
    assert_eq!(setup.model.requests().len(), 100, "the later event waits");
    let stopping = std::time::Instant::now();
    let status = daemon.terminate();
    assert!(status.success(), "{status:?}");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "the drain does not wait for pending approvals: {:?}",
        stopping.elapsed()
    );
    assert_eq!(setup.pending().len(), 100, "the requests survive the stop");
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &approval]);
    assert!(ok, "{text}");
    let daemon = setup.workspace.start();
    assert_eq!(
        setup.workspace.wait_terminal(&first, TURN_LIMIT),
        "completed"
    );
    // The second event asks for the tool again: a new request, with its own decision.
    wait_until("the second event to await approval", TURN_LIMIT, || {
        setup.workspace.event_status(&second) == "awaiting_approval"
    });
    let approval = setup
        .pending()
        .into_iter()
        .find(|row| row["event_id"] == second.as_str())
        .and_then(|row| row["id"].as_str().map(str::to_string))
        .unwrap_or_default();
    let (ok, text) = decide(&setup.workspace, &["approvals", "deny", &approval]);
    assert!(ok, "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&second, TURN_LIMIT),
        "completed"
    );
    assert_eq!(setup.runs(), 1);
    drop(daemon);
}

/// Suspending a session that awaits a decision denies its request ("session suspended by
/// operator"); resuming it lets the turn go on without the call.
#[test]
fn suspending_an_awaiting_session_denies_its_request() {
    let setup = Setup::new("");
    let daemon = setup.workspace.start();
    let event = post(&daemon, "suspended");
    let approval = setup.wait_awaiting(&event);
    let output = setup.workspace.cli(&["sessions", "suspend", "suspended"]);
    assert!(output.status.success(), "{output:?}");
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(shown["status"], "denied", "{shown}");
    assert_eq!(shown["note"], "session suspended by operator", "{shown}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        setup.model.requests().len(),
        1,
        "a suspended session runs nothing"
    );
    let output = setup.workspace.cli(&["sessions", "resume", "suspended"]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    assert_eq!(setup.runs(), 0);
    let results = tool_results(&setup.model);
    assert!(
        results
            .iter()
            .any(|r| r.contains("session suspended by operator")),
        "{results:?}"
    );
    drop(daemon);
}

/// The request is delivered to the route's target with approve and deny links on the public
/// URL. Fetching a link decides nothing; a tampered link is refused; the confirm button's POST
/// decides as "link", once: the link is gone after it, and so is the other one.
#[test]
fn a_link_shows_the_request_and_only_its_post_decides_once() {
    let workspace = Workspace::new();
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let deliver = format!(
        "{{ kind = \"http\", url = \"{}/results\" }}",
        receiver.url()
    );
    let setup = Setup::linked(workspace, receiver, &deliver);
    let public = format!("http://{}", setup.workspace.addr());
    let daemon = setup.workspace.start();
    let event = post(&daemon, "linked");
    let approval = setup.wait_awaiting(&event);
    let mut request = None;
    wait_until("the approval request delivery", TURN_LIMIT, || {
        request = setup
            .receiver
            .requests()
            .into_iter()
            .find(|r| r.header("webhook-id") == Some(approval.as_str()));
        request.is_some()
    });
    let body = request.map(|r| r.json()).unwrap_or_default();
    assert_eq!(body["kind"], "approval_request", "{body}");
    assert_eq!(body["approval_id"], approval.as_str(), "{body}");
    assert_eq!(body["event_id"], event.as_str(), "{body}");
    assert_eq!(body["session"], "linked", "{body}");
    assert_eq!(body["tool"], "deploy", "{body}");
    assert_eq!(body["arguments"], json!({"target": "prod"}), "{body}");
    assert!(
        body["expires_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{body}"
    );
    let approve = body["approve_url"].as_str().unwrap_or_default().to_string();
    let deny = body["deny_url"].as_str().unwrap_or_default().to_string();
    let prefix = format!("{public}/approvals/{approval}/approve?");
    assert!(approve.starts_with(&prefix), "{approve}");
    let target = |url: &str| url.trim_start_matches(&public).to_string();

    let shown = daemon.request("GET", &target(&approve), &[], b"");
    assert_eq!(shown.status, 200, "{shown:?}");
    let page = shown.body.clone();
    assert!(
        page.contains("deploy") && page.contains("&quot;target&quot;"),
        "{page}"
    );
    assert!(page.contains("<form method=\"post\">"), "{page}");
    assert_eq!(setup.pending().len(), 1, "a GET decides nothing");

    let tampered = target(&approve).replace("t=", "t=0");
    assert_eq!(daemon.request("POST", &tampered, &[], b"").status, 403);
    let swapped = target(&deny).replace("/deny?", "/approve?");
    assert_eq!(
        daemon.request("POST", &swapped, &[], b"").status,
        403,
        "a deny link's token does not approve"
    );
    assert_eq!(setup.pending().len(), 1);

    let decided = daemon.request("POST", &target(&approve), &[], b"");
    assert_eq!(decided.status, 200, "{decided:?}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    assert_eq!(setup.runs(), 1);
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(shown["decided_by"], "link", "{shown}");
    assert!(shown.get("link_secret").is_none(), "{shown}");
    assert_eq!(
        daemon.request("POST", &target(&approve), &[], b"").status,
        410
    );
    assert_eq!(daemon.request("GET", &target(&deny), &[], b"").status, 410);
    let metrics = setup.workspace.metrics();
    assert!(
        metrics.contains(r#"agentgate_refusals_total{route="",code="403",reason="bad_link"} 2"#),
        "{metrics}"
    );
}

/// The recipe of docs/tools.md, as written: agentgate delivers to the relay
/// (packaging/examples/approval-relay.py), which checks the signature and posts the request
/// with its links to a chat's incoming webhook; a person opens the approve link and confirms.
#[test]
fn the_chat_relay_recipe_brings_a_link_that_approves() {
    let chat = Stub::start(|_, _| Reply::raw(200, "ok"));
    let workspace = Workspace::new();
    let secret = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    let secret_file = workspace.path().join("deliver.secret");
    let chat_file = workspace.path().join("chat-url");
    std::fs::write(&secret_file, format!("{secret}\n")).expect("secret");
    std::fs::write(&chat_file, format!("{}/hooks/chat\n", chat.url())).expect("chat url");
    let relay_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/examples/approval-relay.py");
    let mut relay = std::process::Command::new("python3")
        .arg(&script)
        .env("RELAY_LISTEN", format!("127.0.0.1:{relay_port}"))
        .env("RELAY_SECRET_FILE", &secret_file)
        .env("CHAT_URL_FILE", &chat_file)
        .spawn()
        .expect("python3 runs the relay");
    wait_until("the relay to listen", TURN_LIMIT, || {
        std::net::TcpStream::connect(("127.0.0.1", relay_port)).is_ok()
    });
    let unused = Stub::start(|_, _| Reply::raw(204, ""));
    let deliver = format!(
        "{{ kind = \"http\", url = \"http://127.0.0.1:{relay_port}/\", secret = {{ file = {secret_file:?} }} }}"
    );
    let setup = Setup::linked(workspace, unused, &deliver);
    let daemon = setup.workspace.start();
    let public = format!("http://{}", setup.workspace.addr());
    let event = post(&daemon, "chat");
    setup.wait_awaiting(&event);
    let mut text = String::new();
    wait_until("the approval message in the chat", TURN_LIMIT, || {
        text = chat
            .requests()
            .iter()
            .map(|r| r.json()["text"].as_str().unwrap_or("").to_string())
            .find(|t| t.contains("Approval needed"))
            .unwrap_or_default();
        !text.is_empty()
    });
    assert!(
        text.contains("`deploy`") && text.contains("\"prod\""),
        "{text}"
    );
    let approve = text
        .split('<')
        .find_map(|part| part.strip_suffix("|Approve> · "))
        .unwrap_or_else(|| panic!("no approve link in {text}"))
        .trim_start_matches(&public)
        .to_string();
    assert_eq!(daemon.request("GET", &approve, &[], b"").status, 200);
    assert_eq!(daemon.request("POST", &approve, &[], b"").status, 200);
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    assert_eq!(setup.runs(), 1);
    wait_until("the result in the chat", TURN_LIMIT, || {
        chat.requests().iter().any(|r| {
            r.json()["text"]
                .as_str()
                .is_some_and(|t| t.starts_with("completed: session chat"))
        })
    });
    let _ = relay.kill();
    let _ = relay.wait();
}

/// kill -9 at each point: with the request committed (it survives, and is decided after the
/// restart), and with the approved call running (the resumed turn does not run it again: the
/// tool is not idempotent, so the model is told its outcome is unknown, and a call it asks for
/// anew needs a decision of its own). The call ran once.
#[test]
fn a_kill_at_any_point_never_runs_the_call_twice_nor_loses_the_request() {
    let setup = Setup::new("");
    let daemon = setup.workspace.start();
    let event = post(&daemon, "killed");
    let approval = setup.wait_awaiting(&event);
    daemon.kill9();
    let daemon = setup.workspace.start();
    assert_eq!(setup.pending().len(), 1, "the request survives kill -9");
    std::fs::write(setup.workspace.path().join("hold"), "").expect("hold");
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &approval]);
    assert!(ok, "{text}");
    wait_until("the approved call to start", TURN_LIMIT, || {
        setup.runs() == 1
    });
    daemon.kill9();
    let _ = std::fs::remove_file(setup.workspace.path().join("hold"));
    let _daemon = setup.workspace.start();
    // The resumed turn tells the model the call's outcome is unknown; this model asks for the
    // call again, which is a new request that needs its own decision.
    wait_until("the model to ask again", TURN_LIMIT, || {
        setup
            .pending()
            .first()
            .is_some_and(|row| row["id"] != approval.as_str())
    });
    assert_eq!(setup.runs(), 1, "the approved call is not run again");
    let again = setup.pending()[0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (ok, text) = decide(&setup.workspace, &["approvals", "deny", &again]);
    assert!(ok, "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    assert_eq!(setup.runs(), 1, "never run twice");
    let results = tool_results(&setup.model);
    assert!(
        results.iter().any(|r| r.starts_with("interrupted")),
        "{results:?}"
    );
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(shown["status"], "approved", "the decision is kept: {shown}");
}

/// A reload that removes the tool while a call of it waits: approving is refused with a clear
/// reason, the request is denied by agentgate, and the model is told the tool is gone.
/// Cancelling a session that waits denies its request and lets the turn go on.
#[test]
fn a_removed_tool_cannot_be_approved_and_cancel_denies() {
    let setup = Setup::new("");
    let daemon = setup.workspace.start();
    let event = post(&daemon, "reloaded");
    let approval = setup.wait_awaiting(&event);
    let config = std::fs::read_to_string(setup.workspace.config_path()).unwrap_or_default();
    std::fs::write(
        setup.workspace.config_path(),
        config.replace("tools = [\"deploy\"]", "tools = []"),
    )
    .expect("config");
    let output = setup.workspace.cli(&["reload"]);
    assert!(output.status.success(), "{output:?}");
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &approval]);
    assert!(!ok && text.contains("no longer offers"), "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    let results = tool_results(&setup.model);
    assert!(
        results
            .iter()
            .any(|r| r.contains("not available on this route")),
        "{results:?}"
    );
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(shown["status"], "denied", "{shown}");
    assert_eq!(shown["decided_by"], "agentgate", "{shown}");
    assert_eq!(setup.runs(), 0);

    std::fs::write(setup.workspace.config_path(), &config).expect("config");
    let output = setup.workspace.cli(&["reload"]);
    assert!(output.status.success(), "{output:?}");
    let cancelled = post(&daemon, "cancelled");
    let approval = setup.wait_awaiting(&cancelled);
    let output = setup.workspace.cli(&["sessions", "cancel", "cancelled"]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        setup.workspace.wait_terminal(&cancelled, TURN_LIMIT),
        "completed"
    );
    let shown = setup
        .workspace
        .cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(shown["note"], "session cancelled by operator", "{shown}");
    assert_eq!(setup.runs(), 0);
}

/// A background tool is gated the same way: nothing starts before the decision, and the
/// approved call starts its job once.
#[test]
fn a_gated_background_tool_starts_its_job_only_when_approved() {
    let setup = Setup::new("");
    let config = std::fs::read_to_string(setup.workspace.config_path()).unwrap_or_default();
    std::fs::write(
        setup.workspace.config_path(),
        config.replace("approval = true", "approval = true\nbackground = true"),
    )
    .expect("config");
    let daemon = setup.workspace.start();
    let event = post(&daemon, "jobs");
    let approval = setup.wait_awaiting(&event);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(setup.runs(), 0, "no job before the decision");
    let (ok, text) = decide(&setup.workspace, &["approvals", "approve", &approval]);
    assert!(ok, "{text}");
    assert_eq!(
        setup.workspace.wait_terminal(&event, TURN_LIMIT),
        "completed"
    );
    wait_until("the job to run", TURN_LIMIT, || setup.runs() == 1);
    let results = tool_results(&setup.model);
    assert!(
        results.iter().any(|r| r.contains("job_id")),
        "the model got the job id: {results:?}"
    );
}
