//! The web console against the real binary, over HTTP as a browser sends it: every page
//! answers, with the headers that keep it to itself; a payload's, a header's and a session
//! key's markup reaches the page as text; an action needs this run's form token and the
//! console's own origin, and is recorded as "console"; the live transcript streams entries as
//! they are committed; `[console] listen` serves only a browser logged in with the token.
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
    assert!(
        said.contains("console (enabled, token, trace_url)"),
        "{said}"
    );
    assert!(
        said.contains("waiting for a restart: console (listen, tls)"),
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

/// A form without this run's token, from another site, or addressed to a name that is not
/// loopback (DNS rebinding) changes nothing, and each refusal is counted and logged; the
/// console's own form acts, as "console", and answers with the page that shows it.
#[test]
fn an_action_needs_the_form_token_and_the_console_s_own_origin() {
    let workspace = Workspace::new();
    workspace.write_config(&config(""));
    let daemon = workspace.start();
    let posted = daemon.post_json(
        "/hooks/alerts",
        &[],
        &json!({"session": "db-1"}).to_string(),
    );
    let event_id = posted.event_id();
    assert_eq!(workspace.wait_terminal(&event_id, TURN_LIMIT), "completed");
    let page = get(&workspace, "/console/sessions/db-1");
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

/// The live transcript sends what is committed, as it is committed, from where the page left
/// off, as text for the page's script to add.
#[test]
fn the_live_transcript_streams_entries_as_they_are_committed() {
    let model = Stub::start(|_, n| Reply::answer(&format!("answer number {n} <b>bold</b>")));
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "[model]\nbackend = \"openai\"\nbase_url = \"{}/v1\"\nmodel = \"stub\"\n\n{}",
        model.url(),
        config("")
    ));
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
    assert!(
        entry["text"]
            .as_str()
            .unwrap_or_default()
            .contains("<b>bold</b>"),
        "{entry}"
    );
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
    let port = free_port();
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

/// A long session's page shows its latest 500 entries and says how many it leaves out.
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
    let recorded: i64 = database
        .query_row(
            "SELECT count(*) FROM transcript WHERE session_key = 'long'",
            [],
            |row| row.get(0),
        )
        .expect("count the entries");
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
    let left_out = recorded + 600 - 500;
    assert!(
        page.contains(&format!("{left_out} earlier entries are not shown")),
        "{page}"
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
    let port = free_port();
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
