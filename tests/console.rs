//! The web console against the real binary, over HTTP as a browser sends it: every page
//! answers, with the headers that keep it to itself; a payload's, a header's and a session
//! key's markup reaches the page as text; an action needs this run's form token and the
//! console's own origin, and is recorded as "console"; the live transcript streams entries as
//! they are committed, and so does `sessions follow` through the daemon; `[console] listen`
//! serves only a browser logged in with the token; an event page lists each model request of a
//! turn with its model, tokens, cost and time.
//! (tests/browser.rs drives the same pages in Chromium.)

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::time::Duration;

use common::approving::{approval_config, deploying_model};
use common::stub::{Reply, Stub};
use common::*;
use serde_json::json;

const PLANTED: &str = "<script>alert('x')</script>";
/// The address a browser behind `ssh -L 8788:/run/agentgate/control.sock` uses.
const TUNNEL: &str = "localhost:8788";
const TURN_LIMIT: Duration = Duration::from_secs(30);

/// One request on the control socket as a browser behind the tunnel sends it.
fn exchange(
    workspace: &Workspace,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> HttpResponse {
    let mut stream = std::os::unix::net::UnixStream::connect(workspace.path().join("control.sock"))
        .expect("connect the control socket");
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        head.push_str(&format!("host: {TUNNEL}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    stream
        .write_all(format!("{head}\r\n{body}").as_bytes())
        .expect("write the request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read the answer");
    parse_response(&raw).expect("an HTTP answer")
}

fn get(workspace: &Workspace, target: &str) -> HttpResponse {
    exchange(workspace, "GET", target, &[], "")
}

/// A form `POST` from the console's own page (`Origin` is the tunnel's).
fn post_form(workspace: &Workspace, target: &str, fields: &[(&str, &str)]) -> HttpResponse {
    let origin = format!("http://{TUNNEL}");
    let headers = [
        ("origin", origin.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    exchange(workspace, "POST", target, &headers, &encoded(fields))
}

fn encoded(fields: &[(&str, &str)]) -> String {
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields)
        .finish()
}

/// The form token the page `body` carries.
fn form_token(body: &str) -> String {
    let marker = "name=\"csrf\" value=\"";
    let start = body.find(marker).expect("the page has a form") + marker.len();
    body[start..]
        .split('"')
        .next()
        .unwrap_or_default()
        .to_string()
}

fn header<'a>(response: &'a HttpResponse, name: &str) -> &'a str {
    response
        .headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map_or("", |(_, v)| v.as_str())
}

fn config(extra: &str) -> String {
    format!(
        "[routes.alerts]\npath = \"/hooks/alerts\"\nverify = {{ scheme = \"none\" }}\n\
         session = \"{{{{ payload.session }}}}\"\n{extra}"
    )
}

#[test]
fn every_page_shows_a_stranger_s_markup_as_text() {
    let workspace = Workspace::new();
    workspace.write_config(&config(""));
    let daemon = workspace.start();
    let session = format!("db-1 {PLANTED}");
    let response = daemon.post_json(
        "/hooks/alerts",
        &[("x-planted", PLANTED)],
        &json!({"session": session, "alert": PLANTED}).to_string(),
    );
    assert_eq!(response.status, 202, "{response:?}");
    let event_id = response.event_id();
    assert_eq!(
        workspace.wait_terminal(&event_id, std::time::Duration::from_secs(30)),
        "completed"
    );
    let encoded: String = session
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let pages = [
        "/console/".to_string(),
        "/console/sessions".to_string(),
        "/console/sessions?state=idle&route=alerts".to_string(),
        format!("/console/sessions/{encoded}"),
        format!("/console/events/{event_id}"),
        "/console/approvals".to_string(),
        "/console/routes".to_string(),
        "/console/routes/alerts".to_string(),
        format!("/console/sessions?key={}", encoded_text(PLANTED)),
        format!("/console/events?delivery_id={}", encoded_text(PLANTED)),
    ];
    for page in &pages {
        let answer = get(&workspace, page);
        assert_eq!(answer.status, 200, "{page}: {answer:?}");
        assert_eq!(header(&answer, "content-type"), "text/html; charset=utf-8");
        assert!(header(&answer, "content-security-policy").contains("default-src 'none'"));
        assert_eq!(header(&answer, "x-content-type-options"), "nosniff");
        assert!(
            !answer.body.contains("<script>"),
            "{page} holds markup it was sent: {}",
            answer.body
        );
    }
    let listed = get(&workspace, "/console/sessions?state=idle&route=alerts").body;
    assert!(
        listed.contains(&format!("/console/sessions/{encoded}")),
        "{listed}"
    );
    assert!(listed.contains("db-1 &lt;script&gt;"), "{listed}");
    let event = get(&workspace, &format!("/console/events/{event_id}")).body;
    assert!(event.contains("&lt;script&gt;alert("), "{event}");
    let overview = get(&workspace, "/console/").body;
    assert!(
        overview.contains("<th>webhooks accepted</th><td>1</td>"),
        "{overview}"
    );
    let events = get(&workspace, "/console/events?status=completed&route=alerts").body;
    assert!(events.contains(&event_id), "{events}");
    assert!(events.contains("db-1 &lt;script&gt;"), "{events}");
    let transcript = get(&workspace, &format!("/console/sessions/{encoded}")).body;
    assert!(transcript.contains("Transcript"), "{transcript}");
    assert!(transcript.contains("&lt;script&gt;"), "{transcript}");
    let style = get(&workspace, "/console/style.css");
    assert_eq!(header(&style, "content-type"), "text/css; charset=utf-8");
    assert_eq!(get(&workspace, "/console/events/no-such-event").status, 404);
    assert_eq!(get(&workspace, "/console/nothing-here").status, 404);
    drop(daemon);
}

/// `text` as a query parameter's value.
fn encoded_text(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

/// Finding things: sessions by text in the key (any case), route and state; events by delivery
/// id and the time they were received; a route's page with its settings, latest events and
/// spend. The console and `/v1` read the same filters, and a filter that names nothing there is
/// is said on the page (the console) or answered `400` (`/v1`).
#[test]
fn sessions_and_events_are_found_by_what_they_hold() {
    let workspace = Workspace::new();
    workspace.write_config(&config(
        "delivery_id = \"{{ payload.id }}\"\n\
         [routes.builds]\npath = \"/hooks/builds\"\nverify = { scheme = \"none\" }\n\
         session = \"{{ payload.session }}\"\ndelivery_id = \"{{ payload.id }}\"\n",
    ));
    let daemon = workspace.start();
    let mut ids = std::collections::BTreeMap::new();
    for (path, session, delivery) in [
        ("/hooks/alerts", "Web-1", "d-1"),
        ("/hooks/alerts", "web-2", "d-2"),
        ("/hooks/builds", "build-9", "d-3"),
    ] {
        let body = json!({"session": session, "id": delivery}).to_string();
        let response = daemon.post_json(path, &[], &body);
        assert_eq!(response.status, 202, "{response:?}");
        let id = response.event_id();
        assert_eq!(workspace.wait_terminal(&id, TURN_LIMIT), "completed");
        ids.insert(delivery, id);
    }
    let rows = |page: &str, marker: &str| -> Vec<String> {
        let body = get(&workspace, page).body;
        ["Web-1", "web-2", "build-9"]
            .into_iter()
            .chain(ids.values().map(String::as_str))
            .filter(|text| body.contains(&format!("{marker}{text}")))
            .map(str::to_string)
            .collect()
    };
    let sessions = |query: &str| rows(&format!("/console/sessions?{query}"), "/console/sessions/");
    assert_eq!(sessions("key=WEB"), ["Web-1", "web-2"]);
    assert_eq!(sessions("key=&route=builds&state="), ["build-9"]);
    assert_eq!(sessions("state=idle&key=web-"), ["Web-1", "web-2"]);
    assert!(sessions("state=suspended").is_empty());
    let bad = get(&workspace, "/console/sessions?state=lost").body;
    assert!(bad.contains("unknown session state"), "{bad}");

    let events = |query: &str| rows(&format!("/console/events?{query}"), "/console/events/");
    assert_eq!(events("delivery_id=d-2"), [ids["d-2"].clone()]);
    assert_eq!(
        events("since=2000-01-01T00:00&route=builds"),
        [ids["d-3"].clone()]
    );
    assert!(events("since=2999-01-01T00:00").is_empty());
    assert!(events("until=2000-01-01T00:00:30").is_empty());
    let bad = get(&workspace, "/console/events?since=yesterday").body;
    assert!(bad.contains("since must be a time"), "{bad}");

    let page = get(&workspace, "/v1/sessions?key=web&route=alerts").json();
    let keys: Vec<&str> = page["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|session| session["key"].as_str())
        .collect();
    assert_eq!(keys, ["Web-1", "web-2"]);
    let page = get(&workspace, "/v1/events?delivery_id=d-3").json();
    assert_eq!(page["events"][0]["id"], ids["d-3"].as_str(), "{page}");
    assert_eq!(page["events"].as_array().map(Vec::len), Some(1));
    for (target, code) in [
        ("/v1/sessions?state=lost", "bad_state"),
        ("/v1/events?until=soon", "bad_time"),
        ("/v1/events?status=lost", "bad_status"),
    ] {
        let answer = get(&workspace, target);
        assert_eq!(answer.status, 400, "{target}: {answer:?}");
        assert_eq!(answer.json()["error"], code, "{target}");
    }

    let routes = get(&workspace, "/console/routes").body;
    assert!(routes.contains("/console/routes/alerts"), "{routes}");
    assert!(routes.contains("/console/routes/builds"), "{routes}");
    let route = get(&workspace, "/console/routes/builds").body;
    assert!(
        route.contains("<code>&#x2f;hooks&#x2f;builds</code>"),
        "{route}"
    );
    assert!(route.contains(&ids["d-3"]), "{route}");
    assert!(!route.contains(&ids["d-1"]), "{route}");
    assert!(route.contains("Spent since"), "{route}");
    assert_eq!(get(&workspace, "/console/routes/nowhere").status, 404);
    drop(daemon);
}

/// `enabled = false` answers 404 on the console's paths and nowhere else; a reload turns it on
/// at once, while a new `listen` waits for a restart and the report says so.
#[test]
fn a_disabled_console_is_not_served_until_a_reload_turns_it_on() {
    let workspace = Workspace::new();
    workspace.write_config(&config("\n[console]\nenabled = false\n"));
    let _daemon = workspace.start();
    assert_eq!(get(&workspace, "/console/").status, 404);
    assert_eq!(get(&workspace, "/v1/status").status, 200);

    // Turned on by a reload, at once; a new listener waits for a restart, and says so.
    workspace.write_config(&config(&format!(
        "\n[console]\nenabled = true\nlisten = \"127.0.0.1:{}\"\ntoken = \"a-long-console-token-0123\"\n",
        free_port()
    )));
    let reload = workspace.cli(&["reload"]);
    let said = String::from_utf8_lossy(&reload.stdout);
    assert!(reload.status.success(), "{reload:?}");
    assert!(said.contains("console.enabled, console.token"), "{said}");
    assert!(
        said.contains("waiting for a restart: console.listen"),
        "{said}"
    );
    assert_eq!(get(&workspace, "/console/").status, 200);
}

fn session_state(workspace: &Workspace, key: &str) -> String {
    workspace.cli_json(&["sessions", "show", key, "--json"])["session"]["state"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn location(answer: &HttpResponse) -> &str {
    header(answer, "location")
}

fn refusals(workspace: &Workspace, reason: &str) -> f64 {
    let metrics = get(workspace, "/metrics").body;
    let prefix = format!("agentgate_console_refusals_total{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// A daemon whose session `db-1` finished a turn: the daemon, the turn's event, and the
/// session's page.
fn finished_session(workspace: &Workspace) -> (Daemon, String, HttpResponse) {
    workspace.write_config(&config(""));
    let daemon = workspace.start();
    let posted = daemon.post_json(
        "/hooks/alerts",
        &[],
        &json!({"session": "db-1"}).to_string(),
    );
    let event_id = posted.event_id();
    assert_eq!(workspace.wait_terminal(&event_id, TURN_LIMIT), "completed");
    let page = get(workspace, "/console/sessions/db-1");
    (daemon, event_id, page)
}

/// A form without this run's token, from another site, or addressed to a name that is not
/// loopback (DNS rebinding) changes nothing, and each refusal is counted and logged; the
/// console's own form acts, as "console", and answers with the page that shows it.
#[test]
fn an_action_needs_the_form_token_and_the_console_s_own_origin() {
    let workspace = Workspace::new();
    let (daemon, event_id, page) = finished_session(&workspace);
    let token = form_token(&page.body);
    assert_eq!(token.len(), 64, "{token}");

    let rebound = exchange(
        &workspace,
        "GET",
        "/console/sessions/db-1",
        &[("host", "evil.example:8788")],
        "",
    );
    assert_eq!(rebound.status, 403, "{rebound:?}");
    assert!(!rebound.body.contains("db-1"), "{}", rebound.body);

    let without_token = post_form(&workspace, "/console/sessions/db-1/suspend", &[]);
    assert_eq!(without_token.status, 403, "{without_token:?}");
    let forged = post_form(
        &workspace,
        "/console/sessions/db-1/suspend",
        &[("csrf", &"0".repeat(64))],
    );
    assert_eq!(forged.status, 403, "{forged:?}");
    let cross_site = exchange(
        &workspace,
        "POST",
        "/console/sessions/db-1/suspend",
        &[
            ("origin", "https://evil.example"),
            ("content-type", "application/x-www-form-urlencoded"),
        ],
        &encoded(&[("csrf", &token)]),
    );
    assert_eq!(cross_site.status, 403, "{cross_site:?}");
    assert_eq!(session_state(&workspace, "db-1"), "idle");
    assert_eq!(refusals(&workspace, "form_token"), 2.0);
    assert_eq!(refusals(&workspace, "cross_site"), 1.0);
    assert_eq!(refusals(&workspace, "host"), 1.0);
    daemon.wait_for_log("console request refused");

    let suspended = post_form(
        &workspace,
        "/console/sessions/db-1/suspend",
        &[("csrf", &token)],
    );
    assert_eq!(suspended.status, 303, "{suspended:?}");
    assert_eq!(location(&suspended), "/console/sessions/db-1");
    assert_eq!(session_state(&workspace, "db-1"), "suspended");
    daemon.wait_for_log("actor=console");
    let resumed = post_form(
        &workspace,
        "/console/sessions/db-1/resume",
        &[("csrf", &token)],
    );
    assert_eq!(resumed.status, 303, "{resumed:?}");
    assert_eq!(session_state(&workspace, "db-1"), "idle");
    let not_running = post_form(
        &workspace,
        "/console/sessions/db-1/cancel",
        &[("csrf", &token)],
    );
    assert_eq!(not_running.status, 409, "{not_running:?}");
    assert!(
        not_running.body.contains("has no turn running"),
        "{}",
        not_running.body
    );

    let replayed = post_form(
        &workspace,
        &format!("/console/events/{event_id}/replay"),
        &[("csrf", &token)],
    );
    assert_eq!(replayed.status, 303, "{replayed:?}");
    let copy = location(&replayed)
        .trim_start_matches("/console/events/")
        .to_string();
    assert_ne!(copy, event_id);
    assert_eq!(workspace.wait_terminal(&copy, TURN_LIMIT), "completed");
    let shown = workspace.cli_json(&["events", "show", &copy, "--json"]);
    assert_eq!(shown["replay_of"], event_id.as_str(), "{shown}");
    let unknown = post_form(
        &workspace,
        "/console/events/no-such-event/replay",
        &[("csrf", &token)],
    );
    assert_eq!(unknown.status, 404, "{unknown:?}");
}

/// Approved from the console, the call runs and the turn completes, decided by "console"; a
/// failed delivery is retried from the console and reaches the receiver again.
#[test]
fn an_approval_and_a_retry_from_the_console() {
    let model = deploying_model("deployed it");
    let receiver = Stub::start(|_, _| Reply::raw(204, ""));
    let workspace = Workspace::new();
    workspace.write_config(&approval_config(&model, &receiver, ""));
    let daemon = workspace.start();
    let event_id = daemon
        .post_json(
            "/hooks/ops",
            &[],
            &json!({"session": "deploy-1"}).to_string(),
        )
        .event_id();
    wait_until("the call to wait for approval", TURN_LIMIT, || {
        workspace.event_status(&event_id) == "awaiting_approval"
    });
    let page = get(&workspace, "/console/approvals");
    assert!(page.body.contains("deploy"), "{}", page.body);
    let pending = workspace.cli_json(&["approvals", "list", "--json"]);
    let approval = pending["approvals"][0]["id"]
        .as_str()
        .expect("a pending approval")
        .to_string();
    let approved = post_form(
        &workspace,
        &format!("/console/approvals/{approval}/approve"),
        &[("csrf", &form_token(&page.body)), ("note", "looks right")],
    );
    assert_eq!(approved.status, 303, "{approved:?}");
    assert_eq!(location(&approved), "/console/sessions/deploy-1");
    assert_eq!(workspace.wait_terminal(&event_id, TURN_LIMIT), "completed");
    let decided = workspace.cli_json(&["approvals", "show", &approval, "--json"]);
    assert_eq!(decided["decided_by"], "console", "{decided}");
    assert_eq!(decided["note"], "looks right", "{decided}");
    let again = post_form(
        &workspace,
        &format!("/console/approvals/{approval}/deny"),
        &[("csrf", &form_token(&page.body))],
    );
    assert_eq!(again.status, 409, "{again:?}");
    assert!(again.body.contains("already decided"), "{}", again.body);

    wait_until("the delivery", TURN_LIMIT, || {
        !receiver.requests().is_empty()
    });
    workspace.fail_delivery(&event_id);
    let deliveries = get(&workspace, "/console/deliveries");
    assert!(
        deliveries.body.contains("receiver down"),
        "{}",
        deliveries.body
    );
    let retried = post_form(
        &workspace,
        &format!("/console/deliveries/{event_id}/retry"),
        &[("csrf", &form_token(&deliveries.body))],
    );
    assert_eq!(retried.status, 303, "{retried:?}");
    wait_until("the retried delivery", TURN_LIMIT, || {
        receiver.requests().len() >= 2
    });
    let twice = post_form(
        &workspace,
        &format!("/console/deliveries/{event_id}/retry"),
        &[("csrf", &form_token(&deliveries.body))],
    );
    assert_eq!(twice.status, 409, "no longer failed: {twice:?}");
}

/// Reads server-sent events from `reader` until `done` says so.
fn read_events(
    reader: &mut BufReader<std::os::unix::net::UnixStream>,
    mut done: impl FnMut(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    let mut events = Vec::new();
    let (mut kind, mut data) = (String::new(), String::new());
    let mut line = String::new();
    while !done(&events) {
        line.clear();
        if reader.read_line(&mut line).expect("read the stream") == 0 {
            break;
        }
        match line.trim_end().split_once(": ") {
            Some(("event", value)) => kind = value.to_string(),
            Some(("data", value)) => data = value.to_string(),
            _ if line.trim_end().is_empty() && !kind.is_empty() => {
                events.push((std::mem::take(&mut kind), std::mem::take(&mut data)));
            }
            _ => {}
        }
    }
    events
}

/// A workspace whose route `alerts` is answered by `model`.
fn answered_by(model: &Stub) -> Workspace {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "[model]\nbackend = \"openai\"\nbase_url = \"{}/v1\"\nmodel = \"stub\"\n\n{}",
        model.url(),
        config("")
    ));
    workspace
}

/// The live transcript sends what is committed, as it is committed, from where the page left
/// off, rendered as the page renders it, every value escaped.
#[test]
fn the_live_transcript_streams_entries_as_they_are_committed() {
    let model = Stub::start(|_, n| Reply::answer(&format!("answer number {n} <b>bold</b>")));
    let workspace = answered_by(&model);
    let daemon = workspace.start();
    let first = daemon
        .post_json(
            "/hooks/alerts",
            &[],
            &json!({"session": "live-1"}).to_string(),
        )
        .event_id();
    assert_eq!(workspace.wait_terminal(&first, TURN_LIMIT), "completed");
    let mut reader = open_live(&workspace, "live-1");
    let answered = |events: &[(String, String)], text: &str| {
        events
            .iter()
            .any(|(kind, data)| kind == "entry" && data.contains(text))
    };
    let before = read_events(&mut reader, |events| {
        answered(events, "answer number") && events.iter().any(|(kind, _)| kind == "state")
    });
    assert!(
        before
            .iter()
            .any(|(kind, data)| kind == "state" && data.contains("idle")),
        "{before:?}"
    );

    let second = daemon
        .post_json(
            "/hooks/alerts",
            &[],
            &json!({"session": "live-1"}).to_string(),
        )
        .event_id();
    let after = read_events(&mut reader, |events| answered(events, "answer number 1"));
    let entry: serde_json::Value = after
        .iter()
        .rev()
        .find(|(kind, data)| kind == "entry" && data.contains("answer number 1"))
        .map(|(_, data)| serde_json::from_str(data).expect("an entry is JSON"))
        .expect("the second answer streamed");
    let html = entry["html"].as_str().unwrap_or_default();
    assert!(
        html.contains("answer number 1 &lt;b&gt;bold&lt;&#x2f;b&gt;") && !html.contains("<b>"),
        "{entry}"
    );
    assert!(html.contains("<details class=\"raw\">"), "{entry}");
    assert!(entry["seq"].as_i64().is_some(), "{entry}");
    assert_eq!(workspace.wait_terminal(&second, TURN_LIMIT), "completed");

    let missing = get(&workspace, "/console/sessions/no-such-session/live");
    assert_eq!(missing.status, 404, "{missing:?}");

    // At most 16 streams at once (one is open above): the control socket stays usable.
    let held: Vec<_> = (0..15).map(|_| open_live(&workspace, "live-1")).collect();
    let refused = get(&workspace, "/console/sessions/live-1/live");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(get(&workspace, "/v1/status").status, 200);
    drop(held);
    // A stream open at SIGTERM does not hold up the stop.
    assert!(daemon.terminate().success());
    drop(reader);
}

/// Posts an event of `session` and waits for its turn to complete.
fn post_completed(workspace: &Workspace, daemon: &Daemon, session: &str) {
    let body = json!({ "session": session }).to_string();
    let id = daemon.post_json("/hooks/alerts", &[], &body).event_id();
    assert_eq!(workspace.wait_terminal(&id, TURN_LIMIT), "completed");
}

/// `sessions follow KEY` running, and the lines it prints; the process is killed however the
/// test ends, so that it holds no pipe open.
fn follow(workspace: &Workspace, key: &str) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    let mut follow = KillOnDrop(
        std::process::Command::new(BIN)
            .args(["sessions", "follow", key, "--config"])
            .arg(workspace.config_path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("follow"),
    );
    let stdout = follow.0.stdout.take().expect("stdout");
    let (sender, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    (follow, lines)
}

/// The first line `follow` prints that contains `text`.
fn shown_until(lines: &std::sync::mpsc::Receiver<String>, text: &str) -> String {
    loop {
        let line = lines.recv_timeout(TURN_LIMIT).expect("follow prints");
        if line.contains(text) {
            return line;
        }
    }
}

/// `agentgate_follow_reads_total`.
fn follow_reads(workspace: &Workspace) -> f64 {
    let metrics = get(workspace, "/metrics").body;
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("agentgate_follow_reads_total "))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// `sessions follow` while the daemon runs: the daemon streams the entries as it commits them,
/// and reads the store for it only when its session commits, not when another one does.
#[test]
fn sessions_follow_streams_the_daemon_s_commits() {
    let model = Stub::start(|_, n| Reply::answer(&format!("answer number {n}")));
    let workspace = answered_by(&model);
    let daemon = workspace.start();
    post_completed(&workspace, &daemon, "followed");
    let (_follow, lines) = follow(&workspace, "followed");
    shown_until(&lines, "answer number 0");
    let opened = follow_reads(&workspace);
    assert!(opened >= 1.0, "the daemon streams the transcript");

    post_completed(&workspace, &daemon, "elsewhere");
    assert_eq!(
        follow_reads(&workspace),
        opened,
        "another session's commits read nothing"
    );

    post_completed(&workspace, &daemon, "followed");
    let shown = shown_until(&lines, "answer number 2");
    assert!(shown.contains("assistant: answer number 2"), "{shown}");
    assert!(
        follow_reads(&workspace) > opened,
        "its session's commits are read"
    );
}

/// `sessions follow` with no daemon reads the store itself, and turns to the daemon once one
/// runs.
#[test]
fn sessions_follow_without_a_daemon_reads_the_store_until_one_runs() {
    let model = Stub::start(|_, n| Reply::answer(&format!("answer number {n}")));
    let workspace = answered_by(&model);
    let daemon = workspace.start();
    post_completed(&workspace, &daemon, "followed");
    assert!(daemon.terminate().success());
    let (_follow, lines) = follow(&workspace, "followed");
    shown_until(&lines, "answer number 0");

    let daemon = workspace.start();
    post_completed(&workspace, &daemon, "followed");
    shown_until(&lines, "answer number 1");
    wait_until("follow asks the daemon", TURN_LIMIT, || {
        follow_reads(&workspace) >= 1.0
    });
}

/// A live transcript stream of `key`, its head read.
fn open_live(workspace: &Workspace, key: &str) -> BufReader<std::os::unix::net::UnixStream> {
    let stream = std::os::unix::net::UnixStream::connect(workspace.path().join("control.sock"))
        .expect("connect the control socket");
    stream.set_read_timeout(Some(TURN_LIMIT)).expect("timeout");
    (&stream)
        .write_all(
            format!("GET /console/sessions/{key}/live HTTP/1.1\r\nhost: {TUNNEL}\r\n\r\n")
                .as_bytes(),
        )
        .expect("write");
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    while reader.read_line(&mut head).expect("read the head") > 2 {}
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    reader
}

fn tcp(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    try_request(addr, method, path, headers, body).expect("an answer on the console listener")
}

/// On `[console] listen` the console needs the token: a browser without it is sent to the
/// login page, a wrong token is refused, the right one gives a cookie that opens the pages; the
/// control API is not served there.
#[test]
fn the_console_on_tcp_serves_only_a_browser_logged_in_with_the_token() {
    let workspace = Workspace::new();
    let port = workspace.console_addr().port();
    workspace.write_config(&config(&format!(
        "\n[console]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"correct horse battery staple\"\n"
    )));
    let _daemon = workspace.start();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let host = format!("127.0.0.1:{port}");
    let origin = format!("http://{host}");
    let fresh = tcp(addr, "GET", "/console/", &[], b"");
    assert_eq!(fresh.status, 303, "{fresh:?}");
    assert_eq!(location(&fresh), "/console/login");
    assert_eq!(tcp(addr, "GET", "/v1/status", &[], b"").status, 404);
    assert_eq!(
        tcp(
            addr,
            "GET",
            "/v1/status",
            &[("authorization", "Bearer correct horse battery staple")],
            b""
        )
        .status,
        404
    );
    let form = [
        ("content-type", "application/x-www-form-urlencoded"),
        ("origin", origin.as_str()),
    ];
    let wrong = tcp(
        addr,
        "POST",
        "/console/login",
        &form,
        encoded(&[("token", "guess")]).as_bytes(),
    );
    assert_eq!(wrong.status, 401, "{wrong:?}");
    assert!(header(&wrong, "set-cookie").is_empty(), "{wrong:?}");
    let right = tcp(
        addr,
        "POST",
        "/console/login",
        &form,
        encoded(&[("token", "correct horse battery staple")]).as_bytes(),
    );
    assert_eq!(right.status, 303, "{right:?}");
    let cookie = header(&right, "set-cookie").to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert!(
        !cookie.contains("correct horse"),
        "the cookie is not the token: {cookie}"
    );
    let pair = cookie.split(';').next().unwrap_or_default().to_string();
    let overview = tcp(addr, "GET", "/console/", &[("cookie", pair.as_str())], b"");
    assert_eq!(overview.status, 200, "{overview:?}");
    assert!(overview.body.contains("Log out"), "{}", overview.body);
    let bearer = tcp(
        addr,
        "GET",
        "/console/sessions",
        &[("authorization", "Bearer correct horse battery staple")],
        b"",
    );
    assert_eq!(bearer.status, 200, "{bearer:?}");
    let forged = tcp(
        addr,
        "GET",
        "/console/",
        &[("cookie", "agentgate_console=00")],
        b"",
    );
    assert_eq!(forged.status, 303, "{forged:?}");
    let unlogged_post = tcp(addr, "POST", "/console/sessions/x/suspend", &form, b"");
    assert_eq!(unlogged_post.status, 401, "{unlogged_post:?}");
    assert_eq!(refusals(&workspace, "wrong_token"), 1.0);
    assert_eq!(refusals(&workspace, "not_logged_in"), 1.0);
}

/// A long session's page shows its latest 500 entries, numbered as the session recorded them,
/// and says that it leaves earlier ones out.
#[test]
fn a_long_transcript_is_shown_from_its_latest_entries() {
    let workspace = Workspace::new();
    workspace.write_config(&config(""));
    let daemon = workspace.start();
    let id = daemon
        .post_json(
            "/hooks/alerts",
            &[],
            &json!({"session": "long"}).to_string(),
        )
        .event_id();
    assert_eq!(workspace.wait_terminal(&id, TURN_LIMIT), "completed");
    let database = rusqlite::Connection::open(workspace.state_dir().join("agentgate.db"))
        .expect("open the database");
    database.busy_timeout(TURN_LIMIT).expect("busy timeout");
    // Months of a busy session, as the store holds them.
    database
        .execute_batch(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 600)
             INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
             SELECT 'long', 1000 + i, 'old-turn', 'message',
                    json_object('kind', 'message', 'message', json_object('role', 'assistant', 'content', 'entry ' || i)),
                    0
             FROM n",
        )
        .expect("add entries");
    let page = get(&workspace, "/console/sessions/long").body;
    assert!(
        page.contains("Only the latest 500 entries are shown here"),
        "{page}"
    );
    assert!(
        page.contains("start=\"1101\""),
        "numbered from seq 1101: {page}"
    );
    assert_eq!(page.matches("<li class=\"entry").count(), 500);
    assert!(page.contains("entry 600"), "the latest is shown");
    assert!(!page.contains("\"entry 1\""), "the oldest is not");
}

/// With `[console] tls` the console on TCP speaks HTTPS alone: the login works over it, its
/// cookie is `Secure`, and a plain HTTP client gets no page.
#[test]
fn the_console_on_tcp_speaks_https_with_a_certificate() {
    let workspace = Workspace::new();
    self_signed(workspace.path(), "console");
    let (cert, key) = (
        workspace.path().join("cert.pem"),
        workspace.path().join("key.pem"),
    );
    let port = workspace.console_addr().port();
    workspace.write_config(&config(&format!(
        "\n[console]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"correct horse battery staple\"\n\
         tls = {{ cert = {{ file = {:?} }}, key = {{ file = {:?} }} }}\n",
        cert.display().to_string(),
        key.display().to_string(),
    )));
    let _daemon = workspace.start();
    let base = format!("https://127.0.0.1:{port}");
    let curl = |args: &[&str]| {
        let output = std::process::Command::new("curl")
            .args(["-s", "-i", "--max-time", "10", "--cacert"])
            .arg(&cert)
            .args(args)
            .output()
            .expect("run curl");
        String::from_utf8_lossy(&output.stdout).to_string()
    };
    let login_page = curl(&[&format!("{base}/console/login")]);
    assert!(login_page.starts_with("HTTP/1.1 200"), "{login_page}");
    let origin = format!("origin: {base}");
    let logged_in = curl(&[
        "-H",
        &origin,
        "--data-urlencode",
        "token=correct horse battery staple",
        &format!("{base}/console/login"),
    ]);
    assert!(logged_in.starts_with("HTTP/1.1 303"), "{logged_in}");
    let cookie = logged_in
        .lines()
        .find(|line| line.to_ascii_lowercase().starts_with("set-cookie:"))
        .unwrap_or_default();
    assert!(cookie.contains("; Secure"), "{cookie}");
    let plain = try_request(
        ([127, 0, 0, 1], port).into(),
        "GET",
        "/console/login",
        &[],
        b"",
    );
    assert!(
        !plain.as_ref().is_ok_and(|answer| answer.status == 200),
        "plain HTTP got a page: {plain:?}"
    );
    assert_eq!(refusals(&workspace, "tls"), 1.0);
}

/// `[console] listen` with the token `correct horse battery staple` and `header_timeout` at
/// `header_timeout`: the daemon and the listener's address.
fn console_on_tcp(workspace: &Workspace, header_timeout: &str) -> (Daemon, std::net::SocketAddr) {
    let port = workspace.console_addr().port();
    workspace.write_config(&config(&format!(
        "\n[console]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"correct horse battery staple\"\n"
    )));
    let path = workspace.config_path();
    let text = std::fs::read_to_string(&path).expect("config");
    let text = text.replace(
        "header_timeout = \"1s\"",
        &format!("header_timeout = \"{header_timeout}\""),
    );
    std::fs::write(&path, text).expect("config");
    let daemon = workspace.start();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    wait_until("the console listener", Duration::from_secs(10), || {
        std::net::TcpStream::connect(addr).is_ok()
    });
    (daemon, addr)
}

/// A logout ends its login (the cookie no longer opens a page), and an address that keeps
/// sending wrong tokens is made to wait: past five, `429` with `Retry-After`, the right token
/// too, counted as `throttled`.
#[test]
fn a_logout_ends_the_login_and_wrong_tokens_are_throttled() {
    let workspace = Workspace::new();
    let (_daemon, addr) = console_on_tcp(&workspace, "1s");
    let origin = format!("http://{addr}");
    let form = [
        ("content-type", "application/x-www-form-urlencoded"),
        ("origin", origin.as_str()),
    ];
    let login = |token: &str| {
        tcp(
            addr,
            "POST",
            "/console/login",
            &form,
            encoded(&[("token", token)]).as_bytes(),
        )
    };
    let right = login("correct horse battery staple");
    assert_eq!(right.status, 303, "{right:?}");
    let cookie = header(&right, "set-cookie");
    let pair = cookie.split(';').next().unwrap_or_default().to_string();
    let again = login("correct horse battery staple");
    let other = header(&again, "set-cookie")
        .split(';')
        .next()
        .unwrap_or_default();
    assert_ne!(other, pair, "each login has its own cookie");
    let page = |pair: &str| tcp(addr, "GET", "/console/", &[("cookie", pair)], b"").status;
    assert_eq!(page(&pair), 200);
    let mut logout_headers = form.to_vec();
    logout_headers.push(("cookie", pair.as_str()));
    let out = tcp(addr, "POST", "/console/logout", &logout_headers, b"");
    assert_eq!(out.status, 303, "{out:?}");
    assert_eq!(page(&pair), 303, "the logged-out cookie opens nothing");
    assert_eq!(page(other), 200, "another login goes on");

    for attempt in 1..=6 {
        assert_eq!(login("guess").status, 401, "wrong token {attempt}");
    }
    let throttled = login("correct horse battery staple");
    assert_eq!(throttled.status, 429, "{throttled:?}");
    let retry_after: u64 = header(&throttled, "retry-after").parse().unwrap_or(0);
    assert!(retry_after >= 1, "{throttled:?}");
    assert_eq!(refusals(&workspace, "throttled"), 1.0);
    assert_eq!(refusals(&workspace, "wrong_token"), 6.0);
}

/// A logged-in page on `addr`, whose slots are all held, is answered within 5 s, because a
/// connection in `state` (`idle`, `body`) was closed to make room for it.
fn a_page_makes_room(workspace: &Workspace, addr: std::net::SocketAddr, state: &str) {
    let started = std::time::Instant::now();
    let page = tcp(
        addr,
        "GET",
        "/console/sessions",
        &[("authorization", "Bearer correct horse battery staple")],
        b"",
    );
    let waited = started.elapsed();
    assert_eq!(page.status, 200, "{page:?}");
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    let metrics = get(workspace, "/metrics").body;
    let closed =
        format!(r#"agentgate_idle_connections_closed_total{{listener="console",state="{state}"}}"#);
    assert!(metrics.contains(&closed), "{metrics}");
}

/// 64 idle unauthenticated connections hold every slot of `[console] listen`: the one idle the
/// longest is closed for a new one, so a logged-in page is answered well before
/// `header_timeout` (10 s here) would close them.
#[test]
fn idle_connections_to_the_console_make_room_for_an_operator() {
    let workspace = Workspace::new();
    let (_daemon, addr) = console_on_tcp(&workspace, "10s");
    let idle: Vec<std::net::TcpStream> = (0..64)
        .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
        .collect();
    a_page_makes_room(&workspace, addr, "idle");
    drop(idle);
}

/// A login `POST` to `addr` whose body stops after its first bytes: the connection, held open.
fn stalled_login(addr: std::net::SocketAddr) -> std::net::TcpStream {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST /console/login HTTP/1.1\r\nhost: {addr}\r\norigin: http://{addr}\r\n\
         content-type: application/x-www-form-urlencoded\r\ncontent-length: 100\r\n\r\ntoken="
    );
    stream.write_all(head.as_bytes()).expect("the head");
    stream
}

/// 64 login forms whose bodies stall hold every slot of `[console] listen`: the one stalled
/// the longest is closed for a new connection, so a logged-in page is answered long before
/// their bodies' time (four times `header_timeout`, 40 s here) runs out.
#[test]
fn stalled_login_bodies_make_room_for_an_operator() {
    let workspace = Workspace::new();
    let (_daemon, addr) = console_on_tcp(&workspace, "10s");
    let stalled: Vec<std::net::TcpStream> = (0..64).map(|_| stalled_login(addr)).collect();
    a_page_makes_room(&workspace, addr, "body");
    drop(stalled);
}

/// A body that stops arriving gets `408` after four times `header_timeout` (1 s here), and
/// its connection is closed: a console login form on `[console] listen`, and a decision's
/// document on the control socket.
#[test]
fn a_stalled_body_is_answered_408_after_four_times_header_timeout() {
    let workspace = Workspace::new();
    let (_daemon, addr) = console_on_tcp(&workspace, "1s");
    let started = std::time::Instant::now();
    let console = std::thread::spawn(move || {
        let mut stream = stalled_login(addr);
        read_response(&mut stream).expect("an answer")
    });
    let control = {
        let socket = workspace.path().join("control.sock");
        std::thread::spawn(move || {
            let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
            stream
                .write_all(
                    b"POST /v1/approvals/none/approve HTTP/1.1\r\nhost: localhost\r\n\
                      content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"note\"",
                )
                .expect("the head");
            let mut raw = Vec::new();
            stream.read_to_end(&mut raw).expect("read the answer");
            parse_response(&raw).expect("an HTTP answer")
        })
    };
    for (name, answer) in [("console", console), ("control", control)] {
        let answer = answer.join().expect("answered");
        let waited = started.elapsed();
        assert_eq!(answer.status, 408, "{name}: {answer:?}");
        assert!(
            waited >= Duration::from_secs(4) && waited < Duration::from_secs(10),
            "{name}: answered after {waited:?}"
        );
    }
    assert_eq!(refusals(&workspace, "wrong_token"), 0.0, "no token came");
}

/// The session page offers a rewind and a fork on each event entry and assistant message; each
/// is a form `POST` guarded as every console action is, and the rerun's superseded entries are
/// shown as such.
#[test]
fn a_rewind_and_a_fork_from_the_session_page() {
    let workspace = Workspace::new();
    let (daemon, first, page) = finished_session(&workspace);
    assert!(
        page.body.contains("Rewind to #<span class=\"n\">2</span>"),
        "{}",
        page.body
    );
    assert!(
        page.body.contains("Fork at #<span class=\"n\">1</span>"),
        "{}",
        page.body
    );
    let token = form_token(&page.body);

    let forged = post_form(
        &workspace,
        "/console/sessions/db-1/rewind",
        &[("csrf", &"0".repeat(64)), ("to", "2")],
    );
    assert_eq!(forged.status, 403, "{forged:?}");
    let cross_site = exchange(
        &workspace,
        "POST",
        "/console/sessions/db-1/rewind",
        &[
            ("origin", "https://evil.example"),
            ("content-type", "application/x-www-form-urlencoded"),
        ],
        &encoded(&[("csrf", &token), ("to", "2")]),
    );
    assert_eq!(cross_site.status, 403, "{cross_site:?}");
    let not_rerunnable = post_form(
        &workspace,
        "/console/sessions/db-1/rewind",
        &[("csrf", &token), ("to", "9")],
    );
    assert_eq!(not_rerunnable.status, 422, "{not_rerunnable:?}");
    assert!(
        not_rerunnable.body.contains("no transcript entry 9"),
        "{}",
        not_rerunnable.body
    );
    let transcript = |key: &str| workspace.session_json(key)["transcript"].clone();
    assert!(
        transcript("db-1")[1].get("superseded_by").is_none(),
        "refused actions change nothing"
    );

    let rewound = post_form(
        &workspace,
        "/console/sessions/db-1/rewind",
        &[("csrf", &token), ("to", "2")],
    );
    assert_eq!(rewound.status, 303, "{rewound:?}");
    assert_eq!(location(&rewound), "/console/sessions/db-1");
    let turn_id = transcript("db-1")[1]["superseded_by"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!turn_id.is_empty(), "{}", transcript("db-1"));
    daemon.wait_for_log("action=\"rewind\"");
    let newest =
        |key: &str| workspace.cli_json(&["events", "list", "--session", key, "--json"])[0].clone();
    wait_until("the rerun to complete", TURN_LIMIT, || {
        let event = newest("db-1");
        event["id"] != first.as_str() && event["status"] == "completed"
    });
    let page = get(&workspace, "/console/sessions/db-1");
    assert!(
        page.body
            .contains(&format!("superseded by turn <code>{turn_id}</code>")),
        "{}",
        page.body
    );

    let forked = post_form(
        &workspace,
        "/console/sessions/db-1/fork",
        &[("csrf", &token), ("at", "1"), ("as", "db-2")],
    );
    assert_eq!(forked.status, 303, "{forked:?}");
    assert_eq!(location(&forked), "/console/sessions/db-2");
    wait_until("the fork's turn to complete", TURN_LIMIT, || {
        newest("db-2")["status"] == "completed"
    });
    let exists = post_form(
        &workspace,
        "/console/sessions/db-1/fork",
        &[("csrf", &token), ("at", "1"), ("as", "db-2")],
    );
    assert_eq!(exists.status, 409, "{exists:?}");
}

/// Markup that would close the blocks an entry is laid out in, run a script, or break out of
/// an attribute, were it not escaped.
const HOSTILE: &str = "</details></pre></section><script>alert(1)</script>\" onerror=\"alert(2)";

/// A session page reads as a conversation: the event with its route, sender and payload in a
/// `<details>`, each tool call as a card with its name, arguments and result (a command's
/// stdout and exit status), the model's answer as text, and each entry's raw JSON a click away.
/// A stranger's markup in the payload, a tool's name, its arguments and its output stays text,
/// on the page and in the live stream, which sends the same rendering.
#[test]
fn a_transcript_reads_as_a_conversation_with_a_stranger_s_markup_as_text() {
    let model = Stub::scripted(vec![
        Reply::tool_call("call-1", "echo", json!({"text": HOSTILE})),
        Reply::tool_call("call-2", HOSTILE, json!({HOSTILE: HOSTILE})),
        named_model(Reply::answer(&format!("all done {HOSTILE}")), HOSTILE),
    ]);
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "{}\n[tools.echo]\ndescription = \"Echoes its arguments\"\ncommand = [\"/bin/cat\"]\n\
         parameters = {{ type = \"object\" }}\nsandbox = \"none\"\n\n{}tools = [\"echo\"]\n",
        model.model_section(),
        config("")
    ));
    let daemon = workspace.start();
    let payload = json!({"session": "talk-1", "sender": {"login": HOSTILE}, "note": HOSTILE});
    let event = daemon
        .post_json("/hooks/alerts", &[], &payload.to_string())
        .event_id();
    assert_eq!(workspace.wait_terminal(&event, TURN_LIMIT), "completed");

    let page = get(&workspace, "/console/sessions/talk-1").body;
    let escaped = "&lt;&#x2f;details&gt;&lt;&#x2f;pre&gt;&lt;&#x2f;section&gt;&lt;script&gt;alert(1)\
                   &lt;&#x2f;script&gt;&quot; onerror=&quot;alert(2)";
    assert!(
        !page.contains("<script>") && !page.contains("\" onerror"),
        "{page}"
    );
    assert_eq!(
        page.matches("<details").count(),
        page.matches("</details>").count(),
        "{page}"
    );
    assert!(page.contains("<th>route</th><td>alerts</td>"), "{page}");
    assert!(
        page.contains(&format!("<th>sender</th><td>{escaped}</td>")),
        "{page}"
    );
    let payload = page
        .split("<details class=\"payload\"><summary>payload</summary><pre>")
        .nth(1)
        .and_then(|rest| rest.split("</pre></details>").next())
        .expect("the payload in a details block");
    assert!(
        payload.contains("&quot;note&quot;: &quot;&lt;&#x2f;details&gt;&lt;&#x2f;pre&gt;"),
        "pretty-printed, escaped: {payload}"
    );
    assert!(
        page.contains(
            "<section class=\"tool-call\"><h3>calls <code class=\"tool-name\">echo</code>"
        ),
        "{page}"
    );
    assert!(
        page.contains(&format!("<code class=\"tool-name\">{escaped}</code>")),
        "the hostile tool name is a card's name, as text: {page}"
    );
    let result = page
        .split("<section class=\"tool-call result\">")
        .nth(1)
        .expect("a result card");
    assert!(
        result.starts_with("<h3>result of <code class=\"tool-name\">echo</code>"),
        "{result}"
    );
    assert!(
        result.contains("exit status <span class=\"ok\">0</span>"),
        "{result}"
    );
    assert!(result.contains("<h4>stdout</h4>"), "{result}");
    assert!(result.contains("<pre class=\"output stdout\">"), "{result}");
    assert!(
        result.contains(escaped),
        "stdout echoes the arguments: {result}"
    );
    assert!(
        page.contains(&format!("<div class=\"text\">all done {escaped}</div>")),
        "{page}"
    );
    assert!(
        page.contains("<details class=\"raw\"><summary>raw JSON</summary>"),
        "{page}"
    );

    steps_show_names_as_text(&workspace, "talk-1", &event, escaped);

    let htmls = live_entries(&workspace, "talk-1", "all done");
    let live = htmls.concat();
    assert!(
        !live.contains("<script>") && !live.contains("\" onerror"),
        "{live}"
    );
    assert_eq!(
        live.matches("<details").count(),
        live.matches("</details>").count()
    );
    for shown in htmls {
        assert!(
            page.contains(&shown),
            "the live entry is the page's: {shown}"
        );
    }
    drop(daemon);
}

/// The event page's steps and timeline of `event` and its session `key`'s page show the model's
/// and the tool's names, which the model server chose, as the text `escaped`.
fn steps_show_names_as_text(workspace: &Workspace, key: &str, event: &str, escaped: &str) {
    let session = get(workspace, &format!("/console/sessions/{key}")).body;
    assert!(
        session.contains(&format!(
            "<span class=\"answered\">by <code>{escaped}</code> in "
        )),
        "the reply's entry names its model as text: {session}"
    );
    let steps = get(workspace, &format!("/console/events/{event}")).body;
    assert!(
        !steps.contains("<script>") && !steps.contains("\" onerror"),
        "{steps}"
    );
    assert!(
        steps.contains(&format!("<td><code>{escaped}</code>")),
        "the model that answered, as text: {steps}"
    );
    assert!(
        steps.contains(&format!("<span class=\"kind\">tool</span> {escaped}</td>")),
        "the tool's bar, as text: {steps}"
    );
    assert!(
        steps.contains(&format!("<span class=\"kind\">model</span> {escaped}</td>")),
        "the model's bar, as text: {steps}"
    );
}

/// `reply` as a server that names the model that answered `model`.
fn named_model(reply: Reply, model: &str) -> Reply {
    let mut body: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON");
    body["model"] = json!(model);
    Reply::json(reply.status, body)
}

/// The HTML of the entries the live stream of `key` sends from the start, until one says
/// `until`.
fn live_entries(workspace: &Workspace, key: &str, until: &str) -> Vec<String> {
    let mut reader = open_live(workspace, key);
    let streamed = read_events(&mut reader, |events| {
        events
            .iter()
            .any(|(kind, data)| kind == "entry" && data.contains(until))
    });
    streamed
        .iter()
        .filter(|(kind, _)| kind == "entry")
        .map(|(_, data)| {
            let entry: serde_json::Value = serde_json::from_str(data).expect("an entry is JSON");
            entry["html"].as_str().unwrap_or_default().to_string()
        })
        .collect()
}

/// A workspace whose route `alerts` is answered by `model` (with `fallback` behind it), priced,
/// and may call `echo`.
fn echoing(model: &Stub, fallback: &Stub) -> Workspace {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "{}fallback = [{{ base_url = \"{}/v1\", model = \"spare\" }}]\n\
         price = {{ input_per_mtok = 1.0, cached_input_per_mtok = 0.5, output_per_mtok = 2.0 }}\n\n\
         [tools.echo]\ndescription = \"Echoes its arguments\"\ncommand = [\"/bin/cat\"]\n\
         parameters = {{ type = \"object\" }}\nsandbox = \"none\"\n\n{}tools = [\"echo\"]\n",
        model.model_section(),
        fallback.url(),
        config("")
    ));
    workspace
}

/// The event page lists each model request of a turn with the model that answered (a fallback
/// marked as one), its tokens in, cached and out, its cost at the price and its time, and the
/// turn's totals.
#[test]
fn an_event_page_shows_each_step_s_model_tokens_cost_and_time() {
    let primary = Stub::start(|_, n| match n {
        0 => Reply::tool_call("call-1", "echo", json!({"text": "hi"})).with_usage(100, 40, 10),
        _ => Reply::json(503, json!({"error": "overloaded"})),
    });
    let fallback =
        Stub::start(|_, _| named_model(Reply::answer("done"), "spare-q4").with_usage(30, 0, 4));
    let workspace = echoing(&primary, &fallback);
    let daemon = workspace.start();
    let event = daemon
        .post_json(
            "/hooks/alerts",
            &[],
            &json!({"session": "steps-1"}).to_string(),
        )
        .event_id();
    assert_eq!(workspace.wait_terminal(&event, TURN_LIMIT), "completed");

    let page = get(&workspace, &format!("/console/events/{event}")).body;
    let steps: Vec<&str> = page.split("<tr class=\"step\">").skip(1).collect();
    assert_eq!(steps.len(), 2, "two model requests: {page}");
    assert!(steps[0].contains("<code>stub</code>"), "{}", steps[0]);
    assert!(!steps[0].contains("fallback"), "{}", steps[0]);
    assert!(
        steps[0].contains("<td>100</td><td>40</td><td>10</td>\n<td>$0.000100</td>"),
        "60 uncached at $1, 40 cached at $0.5, 10 out at $2 per million: {}",
        steps[0]
    );
    assert!(
        steps[1]
            .contains("<code>spare-q4</code> <strong class=\"mark fallback\">fallback</strong>"),
        "{}",
        steps[1]
    );
    assert!(
        steps[1].contains("(asked for <code>spare</code>)"),
        "{}",
        steps[1]
    );
    assert!(
        steps[1].contains("<td>30</td><td>0</td><td>4</td>\n<td>$0.000038</td>"),
        "{}",
        steps[1]
    );
    for step in &steps {
        let took = step.split("</td>\n<td>").last().unwrap_or_default();
        assert!(
            took.contains(" ms") || took.contains(" s"),
            "a time: {step}"
        );
    }
    let session = get(&workspace, "/console/sessions/steps-1").body;
    assert!(
        session.contains(
            "by <code>spare-q4</code> <strong class=\"mark fallback\">fallback</strong> in "
        ),
        "{session}"
    );
    assert!(
        session.contains(", 100 tokens in (40 cached), 10 out</span>"),
        "{session}"
    );
    assert!(
        page.contains(
            "<tr class=\"total\"><th>total</th><th>2 step(s)</th><th>130</th><th>40</th><th>14</th><th>$0.000138</th>"
        ),
        "{page}"
    );
    drop(daemon);
}

/// The webhooks the overview's last-hour chart counts as accepted.
fn charted_as_accepted(workspace: &Workspace) -> u64 {
    let overview = get(workspace, "/console/").body;
    let chart = overview
        .split("id=\"webhooks-hour\"")
        .nth(1)
        .and_then(|rest| rest.split("</figure>").next())
        .unwrap_or_default();
    chart
        .split("<circle class=\"accepted\"")
        .skip(1)
        .filter_map(|circle| circle.split("data-value=\"").nth(1)?.split('"').next())
        .map(|value| value.parse::<u64>().expect("a count"))
        .sum()
}

/// The overview's charts survive a restart: the daemon keeps the last day in its state
/// directory when it stops and reads it back when it starts. A file that cannot be read leaves
/// the charts empty, with a warning, and the daemon serving.
#[test]
fn the_charts_keep_the_last_day_across_a_restart() {
    let workspace = Workspace::new();
    workspace.write_config(&config(""));
    let daemon = workspace.start();
    for n in 0..3 {
        let body = json!({"session": format!("kept-{n}")}).to_string();
        let id = daemon.post_json("/hooks/alerts", &[], &body).event_id();
        assert_eq!(workspace.wait_terminal(&id, TURN_LIMIT), "completed");
    }
    assert_eq!(charted_as_accepted(&workspace), 3);
    assert!(daemon.terminate().success());
    let activity = workspace.state_dir().join("activity.json");
    assert!(activity.is_file(), "the stop kept the charts");

    let daemon = workspace.start();
    assert_eq!(charted_as_accepted(&workspace), 3, "after the restart");
    let body = json!({"session": "kept-3"}).to_string();
    let id = daemon.post_json("/hooks/alerts", &[], &body).event_id();
    assert_eq!(workspace.wait_terminal(&id, TURN_LIMIT), "completed");
    assert_eq!(charted_as_accepted(&workspace), 4);
    assert!(daemon.terminate().success());

    std::fs::write(&activity, b"{not json").expect("spoil the activity file");
    let daemon = workspace.start();
    assert_eq!(charted_as_accepted(&workspace), 0);
    assert!(
        daemon.log().contains(
            "the console's charts start empty: the last run's activity file cannot be read"
        ),
        "{}",
        daemon.log()
    );
    drop(daemon);
}
