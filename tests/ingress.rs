//! Webhook ingress against the real binary over loopback: status codes, signatures, limits,
//! dedup across restarts, slow clients, and configuration errors.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

const GITHUB_SECRET: &str = "It's a Secret to Everybody";

fn github_config(extra: &str) -> String {
    format!(
        r#"[routes.github]
path = "/hooks/github"
verify = {{ scheme = "github", secret = {{ env = "TEST_GITHUB_SECRET" }} }}
events = ["issues", "ping"]
session = "{{{{ payload.repository.full_name }}}}#{{{{ payload.issue.number }}}}"
{extra}
"#
    )
}

fn start_github(workspace: &Workspace, extra: &str) -> Daemon {
    workspace.write_config(&github_config(extra));
    workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)])
}

fn github_post(daemon: &Daemon, body: &str, delivery: &str) -> HttpResponse {
    let signature = format!(
        "sha256={}",
        hmac_sha256_hex(GITHUB_SECRET.as_bytes(), body.as_bytes())
    );
    daemon.post_json(
        "/hooks/github",
        &[
            ("x-hub-signature-256", &signature),
            ("x-github-event", "issues"),
            ("x-github-delivery", delivery),
        ],
        body,
    )
}

const ISSUE: &str =
    r#"{"action":"opened","repository":{"full_name":"acme/web"},"issue":{"number":7}}"#;

#[test]
fn verified_event_is_accepted_with_its_session_key_and_stored() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let response = github_post(&daemon, ISSUE, "d-1");
    assert_eq!(response.status, 202, "{response:?}");
    let body = response.json();
    assert_eq!(body["status"], "accepted");
    assert_eq!(body["session"], "acme/web#7");
    assert!(body["event_id"].as_str().is_some_and(|id| !id.is_empty()));
    assert_eq!(workspace.events_total(), 1);
    assert!(daemon.log().contains("event accepted"));
}

#[test]
fn bad_missing_and_stale_signatures_are_401_and_store_nothing() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let wrong = daemon.post_json(
        "/hooks/github",
        &[
            ("x-hub-signature-256", &format!("sha256={}", "0".repeat(64))),
            ("x-github-event", "issues"),
        ],
        ISSUE,
    );
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.json()["error"], "unauthorized");
    assert!(
        !wrong
            .body
            .contains(&hmac_sha256_hex(GITHUB_SECRET.as_bytes(), ISSUE.as_bytes())),
        "the expected signature must never be echoed"
    );
    let missing = daemon.post_json("/hooks/github", &[("x-github-event", "issues")], ISSUE);
    assert_eq!(missing.status, 401);
    // Each refusal is counted with the check that failed.
    let metrics = workspace.metrics();
    for reason in ["signature_mismatch", "signature_missing"] {
        assert!(
            metrics.contains(&format!(
                r#"agentgate_refusals_total{{route="github",code="401",reason="{reason}"}} 1"#
            )),
            "{reason}: {metrics}"
        );
    }

    // A timestamped scheme: a signature older than five minutes is refused.
    drop(daemon);
    let workspace = Workspace::new();
    workspace.write_config(
        "[routes.slack]\npath = \"/hooks/slack\"\nverify = { scheme = \"slack\", secret = \"k\" }\n",
    );
    let daemon = workspace.start();
    let stale_ts = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        - 600)
        .to_string();
    let body = r#"{"type":"event_callback"}"#;
    let signature = format!(
        "v0={}",
        hmac_sha256_hex(b"k", format!("v0:{stale_ts}:{body}").as_bytes())
    );
    let stale = daemon.post_json(
        "/hooks/slack",
        &[
            ("x-slack-request-timestamp", &stale_ts),
            ("x-slack-signature", &signature),
        ],
        body,
    );
    assert_eq!(stale.status, 401, "{stale:?}");
    assert!(
        stale.json()["message"]
            .as_str()
            .unwrap_or("")
            .contains("timestamp")
    );
    assert!(workspace.metrics().contains(
        r#"agentgate_refusals_total{route="slack",code="401",reason="timestamp_stale"} 1"#
    ));
    assert_eq!(workspace.events_total(), 0);
}

#[test]
fn unknown_route_wrong_method_non_json_and_malformed_json() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    assert_eq!(daemon.post_json("/hooks/nope", &[], "{}").status, 404);
    let get = daemon.request("GET", "/hooks/github", &[], b"");
    assert_eq!(get.status, 405);
    assert_eq!(get.header("allow"), Some("POST"));

    let signed = |body: &str, content_type: &str| {
        let signature = format!(
            "sha256={}",
            hmac_sha256_hex(GITHUB_SECRET.as_bytes(), body.as_bytes())
        );
        daemon.request(
            "POST",
            "/hooks/github",
            &[
                ("content-type", content_type),
                ("x-hub-signature-256", &signature),
                ("x-github-event", "issues"),
            ],
            body.as_bytes(),
        )
    };
    let text = signed("hello", "text/plain");
    assert_eq!(text.status, 415, "{text:?}");
    assert_eq!(text.json()["error"], "unsupported_media_type");
    let malformed = signed("{\"action\": ", "application/json");
    assert_eq!(malformed.status, 400, "{malformed:?}");
    assert_eq!(malformed.json()["error"], "malformed_json");

    // GitHub's form-encoded deliveries carry the JSON in `payload`.
    let form = format!(
        "payload={}",
        form_urlencoded::byte_serialize(ISSUE.as_bytes()).collect::<String>()
    );
    let accepted = signed(&form, "application/x-www-form-urlencoded");
    assert_eq!(accepted.status, 202, "{accepted:?}");
    assert_eq!(accepted.json()["session"], "acme/web#7");
    assert_eq!(workspace.events_total(), 1);
}

#[test]
fn event_type_filter_and_session_template_errors() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let body = r#"{"zen":"hi"}"#;
    let signature = format!(
        "sha256={}",
        hmac_sha256_hex(GITHUB_SECRET.as_bytes(), body.as_bytes())
    );
    let ignored = daemon.post_json(
        "/hooks/github",
        &[
            ("x-hub-signature-256", &signature),
            ("x-github-event", "push"),
        ],
        body,
    );
    assert_eq!(ignored.status, 200);
    assert_eq!(ignored.json()["status"], "ignored");

    // `ping` passes the filter but has no issue number: the session key cannot be rendered,
    // and the authentic event is accepted into a session of its own, with a warning and a count.
    let no_key = daemon.post_json(
        "/hooks/github",
        &[
            ("x-hub-signature-256", &signature),
            ("x-github-event", "ping"),
        ],
        body,
    );
    assert_eq!(no_key.status, 202, "{no_key:?}");
    assert_eq!(
        no_key.json()["session"],
        format!("github:{}", no_key.event_id())
    );
    assert_eq!(workspace.events_total(), 1);
    assert!(
        workspace
            .metrics()
            .contains(r#"agentgate_template_fallbacks_total{route="github",template="session"} 1"#),
        "{}",
        workspace.metrics()
    );
    daemon.wait_for_log("template cannot be evaluated for this payload");
}

#[test]
fn duplicate_delivery_id_returns_the_original_even_after_restart() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let first = github_post(&daemon, ISSUE, "same-delivery");
    assert_eq!(first.status, 202);
    let original = first.json()["event_id"].clone();
    let again = github_post(&daemon, ISSUE, "same-delivery");
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["status"], "duplicate");
    assert_eq!(again.json()["event_id"], original);

    assert!(daemon.terminate().success());
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let after_restart = github_post(&daemon, ISSUE, "same-delivery");
    assert_eq!(after_restart.status, 200);
    assert_eq!(after_restart.json()["event_id"], original);
    assert_eq!(workspace.events_total(), 1);
    // A new delivery id is a new event.
    assert_eq!(github_post(&daemon, ISSUE, "other-delivery").status, 202);
    assert_eq!(workspace.events_total(), 2);
}

#[test]
fn oversized_bodies_are_413_with_and_without_content_length() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    // Declared too large: refused from the headers alone.
    let big = "x".repeat(70 * 1024);
    let declared = daemon.post_json("/hooks/github", &[], &big);
    assert_eq!(declared.status, 413);
    assert_eq!(declared.json()["error"], "payload_too_large");

    // Chunked, no Content-Length, far larger than the limit: refused while streaming, and the
    // daemon never buffers it (its peak RSS grows by far less than the 64 MiB sent; the peak
    // before it varies from run to run, so the growth is what is checked). It carries a
    // signature header, so that only its body can decide it.
    let peak_before_kib = daemon.peak_rss_kib();
    let mut stream = TcpStream::connect(daemon.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream
        .write_all(
            b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-hub-signature-256: sha256=00\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
        )
        .expect("head");
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    for _ in 0..1024 {
        let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
        frame.extend_from_slice(&chunk);
        frame.extend_from_slice(b"\r\n");
        if stream.write_all(&frame).is_err() {
            break; // the server answered and closed: exactly what we want
        }
        sent += chunk.len();
    }
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let response = parse_response(&raw).expect("a response");
    assert_eq!(response.status, 413, "{response:?}");
    assert!(sent < 64 * 1024 * 1024, "server read the whole 64 MiB body");
    let grown_mib = daemon.peak_rss_kib().saturating_sub(peak_before_kib) / 1024;
    assert!(
        grown_mib < 16,
        "peak RSS grew by {grown_mib} MiB: the body was buffered"
    );
    assert_eq!(workspace.events_total(), 0);
}

/// On HTTP/2 a body refused from its headers alone (413 from `content-length`, 404 from the
/// path) is answered at once, and curl sees the answer, not a reset stream.
#[test]
fn http2_refusals_from_the_headers_reach_curl() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let body = workspace.path().join("three-mib.json");
    std::fs::write(&body, vec![b' '; 3 * 1024 * 1024]).expect("body");
    for (path, expected) in [("/hooks/github", "413"), ("/hooks/elsewhere", "404")] {
        let output = std::process::Command::new("curl")
            .args(["-s", "--max-time", "20", "--http2-prior-knowledge"])
            .args(["-H", "content-type: application/json"])
            .args(["-H", "x-hub-signature-256: sha256=00"])
            .arg("--data-binary")
            .arg(format!("@{}", body.display()))
            .args(["-o", "/dev/null", "-w", "%{http_version} %{http_code}"])
            .arg(format!("http://{}{path}", daemon.addr))
            .output()
            .expect("run curl");
        let answer = String::from_utf8_lossy(&output.stdout);
        assert_eq!(answer, format!("2 {expected}"), "{output:?}");
        assert!(output.status.success(), "{output:?}");
    }
    assert_eq!(workspace.events_total(), 0);
}

#[test]
fn slow_header_clients_are_disconnected_after_header_timeout() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    for partial in [&b""[..], &b"POST /hooks/github HTTP/1.1\r\nhost: x\r\n"[..]] {
        let mut stream = TcpStream::connect(daemon.addr).expect("connect");
        stream.write_all(partial).expect("partial head");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let started = Instant::now();
        let mut buffer = [0u8; 1024];
        // The server closes the connection (EOF or reset) once header_timeout (1 s) passed.
        let closed = loop {
            match stream.read(&mut buffer) {
                Ok(0) | Err(_) => break started.elapsed(),
                Ok(_) => continue,
            }
        };
        assert!(
            closed < Duration::from_secs(5),
            "a client that never finished its headers was kept {closed:?}"
        );
        assert!(
            closed >= Duration::from_millis(500),
            "closed too early: {closed:?}"
        );
    }
    // The daemon still serves others.
    assert_eq!(github_post(&daemon, ISSUE, "after-slow").status, 202);
    // The head that never ended is a refusal, counted and logged; a connection that sent
    // nothing (a load balancer's TCP check) is none.
    let metrics = workspace.metrics();
    let line = "agentgate_refusals_total{route=\"\",code=\"408\",reason=\"header_timeout\"} 1";
    assert!(metrics.contains(line), "{line} in:\n{metrics}");
    daemon.wait_for_log("webhook refused (408): the request's head did not come within");
}

#[test]
fn rate_limit_answers_429_with_retry_after() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "rate_limit = \"2/min\"");
    assert_eq!(github_post(&daemon, ISSUE, "r1").status, 202);
    assert_eq!(github_post(&daemon, ISSUE, "r2").status, 202);
    let limited = github_post(&daemon, ISSUE, "r3");
    assert_eq!(limited.status, 429);
    let retry_after: u64 = limited
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds");
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(workspace.events_total(), 2);
}

#[test]
fn health_and_readiness() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    assert_eq!(daemon.request("GET", "/healthz", &[], b"").status, 200);
    assert_eq!(daemon.request("GET", "/readyz", &[], b"").status, 200);
}

#[test]
fn a_second_daemon_on_the_same_state_directory_exits_73_naming_the_holder() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let output = std::process::Command::new(BIN)
        .args(["serve", "--config"])
        .arg(workspace.config_path())
        .env("TEST_GITHUB_SECRET", GITHUB_SECRET)
        .output()
        .expect("run second daemon");
    assert_eq!(output.status.code(), Some(73), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("pid {}", daemon.pid())),
        "stderr should name the holder: {stderr}"
    );
}

#[test]
fn invalid_config_exits_78_with_one_line_per_problem() {
    let workspace = Workspace::new();
    std::fs::write(
        workspace.config_path(),
        "[runtime]\ndrain_timeout = \"soon\"\nmax_concurrent_turns = 0\n\n[routes.a]\npath = \"a\"\nverify = { scheme = \"github\" }\n",
    )
    .expect("write config");
    for command in ["check-config", "serve"] {
        let output = workspace.cli(&[command]);
        assert_eq!(output.status.code(), Some(78), "{command}: {output:?}");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let config = workspace.config_path().display().to_string();
        for (key, line) in [
            ("runtime.drain_timeout", 2),
            ("runtime.max_concurrent_turns", 3),
            ("routes.a.path", 6),
            ("routes.a.verify.secret", 7),
        ] {
            let expected = format!("{config}:{line}: error: {key}:");
            assert!(
                text.lines().any(|l| l.starts_with(&expected)),
                "{command}: no line starting {expected:?} in:\n{text}"
            );
        }
    }
    // A syntax error names the line too.
    std::fs::write(workspace.config_path(), "[server]\nlisten = \n").expect("write");
    let output = workspace.cli(&["check-config"]);
    assert_eq!(output.status.code(), Some(78));
    assert!(
        String::from_utf8_lossy(&output.stdout).contains(":2: error"),
        "{output:?}"
    );
}

#[test]
fn check_config_passes_a_valid_file_with_warnings() {
    let workspace = Workspace::new();
    workspace.write_config(
        "[routes.a]\npath = \"/a\"\nverify = { scheme = \"bearer\", secret = \"literal\" }\n",
    );
    let output = workspace.cli(&["check-config"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("warning: routes.a.verify.secret"),
        "{stdout}"
    );
}

#[test]
fn send_signs_like_the_route_verifies() {
    let workspace = Workspace::new();
    workspace.write_config(
        "[routes.std]\npath = \"/hooks/std\"\nverify = { scheme = \"standard\", secret = \"whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD\" }\n",
    );
    let _daemon = workspace.start();
    let output = workspace.cli(&[
        "send",
        "std",
        "--data",
        "{\"type\":\"x\"}",
        "--delivery-id",
        "msg_1",
    ]);
    assert!(output.status.success(), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("202 "));
    let again = workspace.cli(&[
        "send",
        "std",
        "--data",
        "{\"type\":\"x\"}",
        "--delivery-id",
        "msg_1",
    ]);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("duplicate"),
        "{again:?}"
    );
}

/// `send` without `--url` goes through the running daemon, which signs with the secret it
/// loaded (a systemd credential this command cannot read) and posts to its own listener; with no
/// daemon it fails and says to pass `--url`.
#[test]
fn send_without_url_asks_the_daemon_which_holds_the_secret() {
    let workspace = Workspace::new();
    let credentials = workspace.path().join("credentials");
    std::fs::create_dir(&credentials).expect("credentials dir");
    std::fs::write(credentials.join("gh"), GITHUB_SECRET).expect("secret");
    workspace.write_config(
        "[routes.gh]\npath = \"/hooks/gh\"\nverify = { scheme = \"github\", secret = { credential = \"gh\" } }\nevents = [\"issues\"]\n",
    );
    let no_daemon = workspace.cli(&["send", "gh"]);
    assert_eq!(no_daemon.status.code(), Some(69), "{no_daemon:?}");
    assert!(
        String::from_utf8_lossy(&no_daemon.stderr).contains("--url"),
        "{no_daemon:?}"
    );
    let credentials_env = credentials.display().to_string();
    let _daemon = workspace.start_with_env(&[("CREDENTIALS_DIRECTORY", credentials_env.as_str())]);
    let sent = workspace.cli(&["send", "gh", "--data", r#"{"action":"opened"}"#]);
    assert!(sent.status.success(), "{sent:?}");
    let answer = String::from_utf8_lossy(&sent.stdout);
    assert!(answer.starts_with("202 "), "{answer}");
    let unknown = workspace.cli(&["send", "nope"]);
    assert_eq!(unknown.status.code(), Some(78), "{unknown:?}");
}

/// The config of a github route with `server` keys, and `header_timeout` at `header_timeout`
/// (the workspace's 1 s would close stalled connections before the rule under test does).
fn github_with_server(workspace: &Workspace, server: &str, header_timeout: &str) -> Daemon {
    workspace.write_config(&format!("{server}\n{}", github_config("")));
    let path = workspace.config_path();
    let text = std::fs::read_to_string(&path).expect("config");
    let text = text.replace(
        "header_timeout = \"1s\"",
        &format!("header_timeout = \"{header_timeout}\""),
    );
    std::fs::write(&path, text).expect("config");
    workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)])
}

/// `agentgate_idle_connections_closed_total` of the webhook listener for connections that were
/// `state` when they were closed.
fn closed_to_make_room(workspace: &Workspace, state: &str) -> u64 {
    let series = format!(
        "agentgate_idle_connections_closed_total{{listener=\"webhook\",state=\"{state}\"}} "
    );
    workspace
        .metrics()
        .lines()
        .find_map(|line| line.strip_prefix(&series).map(str::to_string))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// The bound on a valid webhook's answer while others hold every connection slot: generous for
/// a loaded 2-core machine; holding on to the connections (as before) took 10 s and more here.
const ROOM_WITHIN: Duration = Duration::from_secs(5);

/// Every `max_connections` slot held by connections whose request head does not finish: the
/// head stalled the longest is closed for a new connection (counted, logged), so a valid
/// webhook is answered well before `header_timeout` (10 s here) would cut them off.
#[test]
fn heads_that_do_not_finish_make_room_at_max_connections() {
    let workspace = Workspace::new();
    let daemon = github_with_server(&workspace, "max_connections = 8", "10s");
    let stalled: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut stream = TcpStream::connect(daemon.addr).expect("connect");
            stream
                .write_all(b"POST /hooks/github HTTP/1.1\r\nhost: x\r\n")
                .expect("partial head");
            stream
        })
        .collect();
    let started = Instant::now();
    assert_eq!(github_post(&daemon, ISSUE, "past-the-limit").status, 202);
    let waited = started.elapsed();
    assert!(waited < ROOM_WITHIN, "waited {waited:?}");
    assert!(
        closed_to_make_room(&workspace, "head") >= 1,
        "{}",
        workspace.metrics()
    );
    daemon.wait_for_log("connection closed to make room for a new one");
    drop(stalled);
}

/// 300 HTTP/2 connections that sent only the preface, from 64 addresses, against
/// `max_connections = 256`: a valid webhook from another address, sent behind them, is
/// answered at once (each idle connection closed for a new one gives its slot back at once),
/// and each closing is counted.
#[test]
fn idle_http2_connections_from_many_addresses_make_room_for_a_webhook() {
    let workspace = Workspace::new();
    let daemon = github_with_server(&workspace, "max_connections = 256", "10s");
    let mut settings = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    settings.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let idle: Vec<TcpStream> = (0..300u16)
        .map(|n| {
            let address = std::net::Ipv4Addr::new(127, 0, 1, 1 + (n % 64) as u8);
            let mut stream = connect_from(address, daemon.addr).expect("connect");
            stream.write_all(&settings).expect("preface");
            stream
        })
        .collect();
    let started = Instant::now();
    let response = github_post(&daemon, ISSUE, "behind-idle-h2");
    let waited = started.elapsed();
    assert_eq!(response.status, 202, "{response:?}");
    assert!(
        waited < ROOM_WITHIN,
        "waited {waited:?} behind idle HTTP/2 connections"
    );
    assert!(
        closed_to_make_room(&workspace, "idle") >= 44,
        "{}",
        workspace.metrics()
    );
    drop(idle);
}

/// Every slot held by request bodies that stall (signed heads, one byte of a 1,000-byte body,
/// from 4 addresses): the body stalled the longest is closed for a new connection, so a valid
/// webhook is answered well before the body timeout (4 × `header_timeout`, 40 s here).
#[test]
fn stalled_bodies_from_a_few_addresses_make_room_for_a_webhook() {
    let workspace = Workspace::new();
    let daemon = github_with_server(&workspace, "max_connections = 64", "10s");
    let head = "POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                x-github-event: issues\r\nx-hub-signature-256: sha256=00\r\n\
                content-length: 1000\r\n\r\n{";
    let stalled: Vec<TcpStream> = (0..80u8)
        .map(|n| {
            let address = std::net::Ipv4Addr::new(127, 0, 2, 1 + n % 4);
            let mut stream = connect_from(address, daemon.addr).expect("connect");
            stream.write_all(head.as_bytes()).expect("head");
            stream
        })
        .collect();
    let started = Instant::now();
    let response = github_post(&daemon, ISSUE, "behind-stalled-bodies");
    let waited = started.elapsed();
    assert_eq!(response.status, 202, "{response:?}");
    assert!(
        waited < ROOM_WITHIN,
        "waited {waited:?} behind stalled bodies"
    );
    assert!(
        closed_to_make_room(&workspace, "body") >= 16,
        "{}",
        workspace.metrics()
    );
    drop(stalled);
}

const SLACK_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";

fn slack_post(
    daemon: &Daemon,
    content_type: &str,
    body: &str,
    extra: &[(&str, &str)],
) -> HttpResponse {
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        .to_string();
    slack_post_at(daemon, content_type, body, extra, &timestamp)
}

/// As [`slack_post`], signed at `timestamp` (so that a request can be sent again as it was).
fn slack_post_at(
    daemon: &Daemon,
    content_type: &str,
    body: &str,
    extra: &[(&str, &str)],
    timestamp: &str,
) -> HttpResponse {
    let signature = format!(
        "v0={}",
        hmac_sha256_hex(
            SLACK_SECRET.as_bytes(),
            format!("v0:{timestamp}:{body}").as_bytes()
        )
    );
    let mut headers = vec![
        ("content-type", content_type),
        ("x-slack-request-timestamp", timestamp),
        ("x-slack-signature", signature.as_str()),
    ];
    headers.extend_from_slice(extra);
    daemon.request("POST", "/hooks/slack", &headers, body.as_bytes())
}

/// Slack as it really talks: the Events API's signed `url_verification` is answered with its
/// challenge and stores nothing; event types come from the inner event; retries of one
/// `event_id` are duplicates; slash commands (form fields, no `payload`) become JSON objects
/// whose type is the command.
#[test]
fn slack_url_verification_events_retries_and_slash_commands() {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        r#"[routes.slack]
path = "/hooks/slack"
verify = {{ scheme = "slack", secret = "{SLACK_SECRET}" }}
events = ["app_mention", "/deploy"]
"#
    ));
    let daemon = workspace.start();
    let challenge = slack_post(
        &daemon,
        "application/json",
        r#"{"token":"x","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#,
        &[],
    );
    assert_eq!(challenge.status, 200, "{challenge:?}");
    assert_eq!(
        challenge.json()["challenge"],
        "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"
    );
    assert_eq!(workspace.events_total(), 0, "a challenge is not an event");

    let mention = r#"{"type":"event_callback","event_id":"Ev0PV52K21","event":{"type":"app_mention","text":"<@U0LAN0Z89> is it up?"}}"#;
    let first = slack_post(&daemon, "application/json", mention, &[]);
    assert_eq!(first.status, 202, "{first:?}");
    let retry = slack_post(
        &daemon,
        "application/json",
        mention,
        &[
            ("x-slack-retry-num", "1"),
            ("x-slack-retry-reason", "http_timeout"),
        ],
    );
    assert_eq!(retry.status, 200, "{retry:?}");
    assert_eq!(retry.json()["status"], "duplicate");
    assert_eq!(retry.json()["event_id"], first.json()["event_id"]);

    let command = "token=gIkuvaNzQIHg97ATvDxqgjtO&team_id=T0001&channel_id=C2147483705&user_id=U2147483697&command=%2Fdeploy&text=web+to+prod&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2F1234%2F5678";
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        .to_string();
    let form = "application/x-www-form-urlencoded";
    let slash = slack_post_at(&daemon, form, command, &[], &now);
    // Answered as Slack asks: 200, with a line for the user who typed the command.
    assert_eq!(slash.status, 200, "{slash:?}");
    let id: String = workspace
        .query("SELECT id FROM events ORDER BY id DESC LIMIT 1", |row| {
            row.get(0)
        })
        .into_iter()
        .next()
        .expect("the command's event");
    assert!(slash.body.contains(&id), "{slash:?}");
    // The same signed request sent again (a replay within Slack's 5 minutes) runs nothing new.
    let replayed = slack_post_at(&daemon, form, command, &[], &now);
    assert_eq!(replayed.status, 200, "{replayed:?}");
    assert!(
        replayed.json()["text"]
            .as_str()
            .is_some_and(|text| text.starts_with("Already received") && text.contains(&id)),
        "{replayed:?}"
    );
    let stored: Vec<(String, Vec<u8>)> = workspace.query(
        &format!("SELECT event_type, payload FROM events WHERE id = '{id}'"),
        |row| Ok((row.get(0)?, row.get(1)?)),
    );
    assert_eq!(stored[0].0, "/deploy");
    let payload: serde_json::Value = serde_json::from_slice(&stored[0].1).expect("JSON payload");
    assert_eq!(payload["text"], "web to prod");
    assert_eq!(workspace.events_total(), 2);
}

/// Small things real senders do: `BEARER` in capitals, gzip bodies, delivery ids longer than 256
/// characters (deduplicated by their digest), and a wrong token said to be a wrong token.
#[test]
fn bearer_in_any_case_gzip_bodies_and_long_delivery_ids() {
    let workspace = Workspace::new();
    workspace.write_config(
        r#"[routes.alerts]
path = "/hooks/alerts"
verify = { scheme = "bearer", secret = "s3cret-token" }
"#,
    );
    let daemon = workspace.start();
    let post = |auth: &str, headers: &[(&str, &str)], body: &[u8]| {
        let mut all = vec![
            ("content-type", "application/json"),
            ("authorization", auth),
        ];
        all.extend_from_slice(headers);
        daemon.request("POST", "/hooks/alerts", &all, body)
    };
    assert_eq!(post("BEARER s3cret-token", &[], b"{}").status, 202);
    let wrong = post("Bearer nope", &[], b"{}");
    assert_eq!(wrong.status, 401);
    assert!(wrong.body.contains("token does not match"), "{wrong:?}");

    let mut gzip = std::process::Command::new("gzip")
        .arg("-c")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("gzip");
    gzip.stdin
        .take()
        .expect("stdin")
        .write_all(br#"{"status":"firing","alerts":[{"labels":{"alertname":"DiskFull"}}]}"#)
        .expect("write");
    let compressed = gzip.wait_with_output().expect("gzip output").stdout;
    let zipped = post(
        "Bearer s3cret-token",
        &[("content-encoding", "gzip")],
        &compressed,
    );
    assert_eq!(zipped.status, 202, "{zipped:?}");
    let id = zipped.event_id();
    let stored: Vec<Vec<u8>> = workspace.query(
        &format!("SELECT payload FROM events WHERE id = '{id}'"),
        |row| row.get(0),
    );
    assert!(String::from_utf8_lossy(&stored[0]).contains("DiskFull"));
    let broken = post(
        "Bearer s3cret-token",
        &[("content-encoding", "gzip")],
        b"not gzip",
    );
    assert_eq!(broken.status, 400, "{broken:?}");

    let long_id = "x".repeat(300);
    let first = post(
        "Bearer s3cret-token",
        &[("idempotency-key", &long_id)],
        b"{}",
    );
    assert_eq!(first.status, 202);
    let again = post(
        "Bearer s3cret-token",
        &[("idempotency-key", &long_id)],
        b"{}",
    );
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["status"], "duplicate");
}

/// Session keys take strings and numbers only: a null field, a boolean or an object cannot make
/// one, nor can bidirectional or zero-width characters, and such an event is accepted into a
/// session of its own; a key longer than 512 bytes becomes its readable beginning and a digest,
/// stable for the same key.
#[test]
fn session_keys_are_strict_and_long_ones_are_shortened_stably() {
    let workspace = Workspace::new();
    workspace.write_config(
        r#"[routes.alerts]
path = "/hooks/alerts"
verify = { scheme = "none" }
session = "{{ payload.group }}"
"#,
    );
    let daemon = workspace.start();
    for (body, what) in [
        (r#"{"group": null}"#, "null"),
        (r#"{"other": 1}"#, "undefined"),
        (r#"{"group": true}"#, "a boolean"),
        (r#"{"group": {"a": 1}}"#, "an object"),
        (r#"{"group": ["a"]}"#, "a list"),
        ("{\"group\": \"abc\u{202e}def\"}", "bidi"),
        ("{\"group\": \"a\u{200b}b\"}", "zero-width"),
    ] {
        let response = daemon.post_json("/hooks/alerts", &[], body);
        assert_eq!(response.status, 202, "{what}: {response:?}");
        assert_eq!(
            response.json()["session"],
            format!("alerts:{}", response.event_id()),
            "{what}"
        );
    }
    assert_eq!(
        daemon
            .post_json("/hooks/alerts", &[], r#"{"group": 42}"#)
            .json()["session"],
        "42"
    );
    let long = format!("{{\"group\": \"{}\"}}", "alertname=DiskFull,".repeat(40));
    let first = daemon.post_json("/hooks/alerts", &[], &long);
    assert_eq!(first.status, 202, "{first:?}");
    let key = first.json()["session"].as_str().expect("key").to_string();
    assert!(key.len() <= 512, "{} bytes", key.len());
    assert!(
        key.starts_with("alertname=DiskFull,alertname=DiskFull,"),
        "{key}"
    );
    assert!(key.contains("…#"), "{key}");
    let second = daemon.post_json("/hooks/alerts", &[], &long);
    assert_eq!(
        second.json()["session"],
        key.as_str(),
        "the same long key, the same session"
    );
}

/// Per-route `event_type` and `delivery_id` templates replace the scheme's: Alertmanager's
/// payload has no `type`, so `events = ["firing"]` needs `event_type = "{{ payload.status }}"`
/// (without it, check-config refuses the route); its group key deduplicates redeliveries.
#[test]
fn event_type_and_delivery_id_templates() {
    let workspace = Workspace::new();
    workspace.write_config(
        r#"[routes.alertmanager]
path = "/hooks/alertmanager"
verify = { scheme = "bearer", secret = "am-token" }
events = ["firing"]
"#,
    );
    let output = workspace.cli(&["check-config"]);
    assert_eq!(output.status.code(), Some(78), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("routes.alertmanager.events"),
        "{output:?}"
    );
    workspace.write_config(
        r#"[routes.alertmanager]
path = "/hooks/alertmanager"
verify = { scheme = "bearer", secret = "am-token" }
events = ["firing"]
event_type = "{{ payload.status }}"
delivery_id = "{{ payload.groupKey }}-{{ payload.status }}-{{ payload.alerts | length }}"
session = "{{ payload.groupKey }}"
"#,
    );
    let daemon = workspace.start();
    let post = |status: &str| {
        let body = format!(
            r#"{{"version":"4","groupKey":"{{}}:{{alertname=\"DiskFull\"}}","status":"{status}","receiver":"agentgate","alerts":[{{"status":"{status}","labels":{{"alertname":"DiskFull"}}}}]}}"#
        );
        daemon.post_json(
            "/hooks/alertmanager",
            &[("authorization", "Bearer am-token")],
            &body,
        )
    };
    let firing = post("firing");
    assert_eq!(firing.status, 202, "{firing:?}");
    let again = post("firing");
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.json()["status"], "duplicate");
    let resolved = post("resolved");
    assert_eq!(resolved.status, 200);
    assert_eq!(resolved.json()["status"], "ignored");
    let stored: Vec<String> = workspace.query("SELECT event_type FROM events", |row| row.get(0));
    assert_eq!(stored, ["firing"]);
}

/// `system` sits outside the event markers, so it may not use event data: check-config says so.
#[test]
fn a_system_text_that_uses_event_data_is_a_config_error() {
    let workspace = Workspace::new();
    workspace.write_config(
        r#"[routes.github]
path = "/hooks/github"
verify = { scheme = "github", secret = "s" }
system = "Triage {{ payload.repository.full_name }} for {{ route }}."
"#,
    );
    let output = workspace.cli(&["check-config"]);
    assert_eq!(output.status.code(), Some(78), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("routes.github.system") && stdout.contains("payload"),
        "{stdout}"
    );
}

/// HTTP/2 with prior knowledge (no upgrade, as h2c clients and proxies speak it) is served on the
/// same socket as HTTP/1.1.
#[test]
fn http2_prior_knowledge_is_served() {
    use http_body_util::{BodyExt, Full};
    let (_workspace, daemon) = alerts_route("");
    let runtime = client_runtime();
    let (status, version, body) = runtime.block_on(async {
        let stream = tokio::net::TcpStream::connect(daemon.addr)
            .await
            .expect("connect");
        let (mut sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .expect("h2 handshake");
        tokio::spawn(connection);
        let request = http::Request::post(format!("http://{}/hooks/alerts", daemon.addr))
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from_static(b"{\"via\":\"h2\"}")))
            .expect("request");
        let response = sender.send_request(request).await.expect("response");
        let (status, version) = (response.status().as_u16(), response.version());
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, version, body)
    });
    assert_eq!(version, http::Version::HTTP_2);
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
}

/// An idle keep-alive connection stays open past `header_timeout` (up to `keepalive_timeout`),
/// so a sender that reuses it after a pause is answered; a request head that starts and stalls is
/// still cut off after `header_timeout`.
#[test]
fn idle_keep_alive_connections_outlive_header_timeout_but_slow_heads_do_not() {
    let (_workspace, daemon) = alerts_route("keepalive_timeout = \"30s\"\n");
    let request = b"POST /hooks/alerts HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let mut stream = TcpStream::connect(daemon.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let read_answer = |stream: &mut TcpStream| -> String {
        let mut buffer = [0u8; 4096];
        let n = stream.read(&mut buffer).unwrap_or(0);
        String::from_utf8_lossy(&buffer[..n]).into_owned()
    };
    stream.write_all(request).expect("first request");
    assert!(read_answer(&mut stream).starts_with("HTTP/1.1 202"));
    // Idle for more than twice header_timeout (1 s): the connection must still be open.
    std::thread::sleep(Duration::from_millis(2500));
    stream
        .write_all(request)
        .expect("second request on the same connection");
    let second = read_answer(&mut stream);
    assert!(second.starts_with("HTTP/1.1 202"), "{second:?}");

    // A head that starts and stalls is cut off after header_timeout.
    stream
        .write_all(b"POST /hooks/alerts HTTP/1.1\r\nhost: x\r\n")
        .expect("partial head");
    let started = Instant::now();
    let rest = read_answer(&mut stream);
    let closed = started.elapsed();
    assert!(!rest.contains("202"), "{rest:?}");
    assert!(closed < Duration::from_secs(5), "kept {closed:?}");
}

/// Credential and signature headers are never stored or shown to templates (the built-in list,
/// the route's own `hidden_headers`), and `verify.secrets` accepts every secret of a rotation.
#[test]
fn credential_headers_are_not_stored_and_secrets_rotate() {
    let workspace = Workspace::new();
    workspace.write_config(
        r#"[routes.github]
path = "/hooks/github"
verify = { scheme = "github", secrets = ["new-secret", "old-secret"] }
hidden_headers = ["X-Internal-Token"]
"#,
    );
    let daemon = workspace.start();
    let post = |secret: &str, delivery: &str| {
        let signature = format!(
            "sha256={}",
            hmac_sha256_hex(secret.as_bytes(), ISSUE.as_bytes())
        );
        daemon.post_json(
            "/hooks/github",
            &[
                ("x-hub-signature-256", &signature),
                ("x-github-event", "issues"),
                ("x-github-delivery", delivery),
                ("x-api-key", "k-123"),
                ("x-internal-token", "t-456"),
                ("private-token", "gl-789"),
                ("x-vault-token", "hvs-012"),
                ("x-amz-security-token", "amz-345"),
                ("x-deploy-secret", "d-678"),
                ("x-request-id", "visible"),
            ],
            ISSUE,
        )
    };
    assert_eq!(post("new-secret", "d1").status, 202);
    assert_eq!(post("old-secret", "d2").status, 202);
    assert_eq!(post("other-secret", "d3").status, 401);
    let stored: Vec<String> = workspace.query("SELECT headers FROM events", |row| row.get(0));
    assert_eq!(stored.len(), 2);
    for headers in stored {
        for hidden in [
            "x-api-key",
            "x-internal-token",
            "x-hub-signature-256",
            "k-123",
            "t-456",
            "gl-789",
            "hvs-012",
            "amz-345",
            "d-678",
        ] {
            assert!(!headers.contains(hidden), "{hidden} stored: {headers}");
        }
        assert!(headers.contains("x-request-id"), "{headers}");
    }
}

/// POSTs `{}` to `url` with curl, trusting `ca`, and returns (HTTP version, status, curl's
/// verbose log).
fn curl_post(url: &str, ca: &std::path::Path, version: &str) -> (String, String, String) {
    let output = std::process::Command::new("curl")
        .args(["-sv", "--max-time", "10", version, "--cacert"])
        .arg(ca)
        .args(["-H", "content-type: application/json", "-d", "{}"])
        .args(["-o", "/dev/null", "-w", "%{http_version} %{http_code}", url])
        .output()
        .expect("run curl");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let (version, code) = stdout.split_once(' ').unwrap_or(("", ""));
    (
        version.to_string(),
        code.to_string(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

#[test]
fn https_on_an_inherited_socket_serves_http1_and_http2_and_a_sighup_takes_a_renewed_certificate() {
    let workspace = Workspace::new();
    self_signed(workspace.path(), "first");
    let (cert, key) = (
        workspace.path().join("cert.pem"),
        workspace.path().join("key.pem"),
    );
    workspace.write_config(&format!(
        "tls = {{ cert = {{ file = {:?} }}, key = {{ file = {:?} }} }}\n\n\
         [routes.hook]\npath = \"/hook\"\nverify = {{ scheme = \"none\" }}\n",
        cert.display().to_string(),
        key.display().to_string(),
    ));
    let url = format!("https://127.0.0.1:{}/hook", workspace.port);
    // On a socket passed as systemd passes it, as in production.
    let daemon = workspace.start_with(&[], || curl_post(&url, &cert, "--http1.1").1 == "202");
    let (version, code, log) = curl_post(&url, &cert, "--http2");
    assert_eq!((version.as_str(), code.as_str()), ("2", "202"), "{log}");
    assert!(log.contains("CN=first"), "{log}");
    let (version, code, _) = curl_post(&url, &cert, "--http1.1");
    assert_eq!((version.as_str(), code.as_str()), ("1.1", "202"));
    // `agentgate send` trusts the machine's trust store (here SSL_CERT_FILE, on Debian also
    // what update-ca-certificates installs), so a private CA's listener takes it.
    let base = format!("https://127.0.0.1:{}", workspace.port);
    let send = |trusted: Option<&std::path::Path>| {
        let mut command = std::process::Command::new(BIN);
        command
            .args(["send", "hook", "--url", &base, "--config"])
            .arg(workspace.config_path());
        if let Some(file) = trusted {
            command.env("SSL_CERT_FILE", file);
        }
        command.output().expect("send")
    };
    let trusted = send(Some(&cert));
    assert!(trusted.status.success(), "{trusted:?}");
    assert!(String::from_utf8_lossy(&trusted.stdout).starts_with("202"));
    let untrusted = send(None);
    assert!(!untrusted.status.success(), "{untrusted:?}");
    // The reason is said, not only "error sending request".
    assert!(
        String::from_utf8_lossy(&untrusted.stderr).contains("certificate"),
        "{untrusted:?}"
    );
    // Plain HTTP gets no answer on the HTTPS socket.
    assert!(
        try_request(daemon.addr, "POST", "/hook", &[], b"{}").is_err(),
        "plain HTTP was answered"
    );

    // A renewed certificate is served after a SIGHUP (certbot's deploy hook), without a restart.
    self_signed(workspace.path(), "second");
    signal(daemon.pid(), "HUP");
    wait_until("the reload", Duration::from_secs(10), || {
        daemon.log().contains("config reloaded")
    });
    let (_, code, log) = curl_post(&url, &cert, "--http2");
    assert_eq!(code, "202", "{log}");
    assert!(log.contains("CN=second"), "{log}");

    // A key that does not belong to the certificate is refused by check-config and by reload,
    // and the daemon goes on serving the certificate it has.
    let second = workspace.path().join("second.pem");
    std::fs::copy(&cert, &second).expect("copy");
    std::fs::copy(&key, workspace.path().join("second-key.pem")).expect("copy");
    self_signed(workspace.path(), "third");
    std::fs::copy(workspace.path().join("second-key.pem"), &key).expect("copy");
    let check = workspace.cli(&["check-config"]);
    assert_eq!(check.status.code(), Some(78), "{check:?}");
    assert!(
        String::from_utf8_lossy(&check.stdout).contains("server.tls"),
        "{check:?}"
    );
    signal(daemon.pid(), "HUP");
    wait_until("the refused reload", Duration::from_secs(10), || {
        daemon.log().contains("config reload refused")
    });
    let (_, code, log) = curl_post(&url, &second, "--http1.1");
    assert_eq!(code, "202", "{log}");
    assert!(log.contains("CN=second"), "{log}");
    drop(daemon);
}

/// A body's timeout in the tests' config: 4 × its `header_timeout` of 1 s. A request answered
/// sooner did not wait for a stalled body to time out; a tighter bound would measure the
/// machine's load, not the daemon.
const BODY_TIMEOUT: Duration = Duration::from_secs(4);

/// An attacker holds 1,099 connections open: half send a head with no signature and wait to send
/// a 60 kB body (under `max_body`), half send a head with a signature header and one byte of such
/// a body. The first are refused from their headers (401 before any body); the second wait for
/// their bodies until the body timeout. Meanwhile a valid webhook is answered at once, and a turn's model and
/// tool calls start.
#[test]
fn stalled_connections_neither_delay_a_valid_webhook_nor_a_running_turn() {
    use common::stub::{Reply, Stub};
    // This test holds 1,100 sockets of its own.
    if let Ok((_, hard)) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
    {
        let _ =
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard);
    }
    let workspace = Workspace::new();
    let model = Stub::start(|request, _| {
        let results = request.json()["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count());
        if results == 0 {
            Reply::tool_call("call_1", "marker", serde_json::json!({}))
        } else {
            Reply::answer("done")
        }
    });
    // The tool's own directory: a writable path may not hold the state or the config.
    let tool_dir = workspace.path().join("tool");
    std::fs::create_dir_all(&tool_dir).expect("the tool's directory");
    let marker = tool_dir.join("tool.ran");
    // In [server]: the attacker may take every max_connections slot (1,024), so that the
    // valid sender needs the slot of the connection idle the longest.
    workspace.write_config(&format!(
        "max_connections_per_peer = 2000\n{}\n[tools.marker]\ncommand = [\"/usr/bin/touch\", {:?}]\nwritable = [{:?}]\n\n{}",
        model.model_section(),
        marker.display().to_string(),
        tool_dir.display().to_string(),
        github_config("tools = [\"marker\"]"),
    ));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let head = |signed: bool| {
        format!(
            "POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             x-github-event: issues\r\n{}content-length: 60000\r\n\r\n{{",
            if signed {
                "x-hub-signature-256: sha256=00\r\n"
            } else {
                ""
            }
        )
    };
    // The attacker's connections come from an address of their own, as they would: the valid
    // sender (127.0.0.1) is not the attacker, whose address holds at most
    // max_connections_per_peer of them.
    let attacker = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let stalled: Vec<(TcpStream, bool)> = (0..1099)
        .map(|n| {
            let signed = n % 2 == 0;
            let mut stream = connect_from(attacker, daemon.addr).expect("connect");
            stream.write_all(head(signed).as_bytes()).expect("head");
            (stream, signed)
        })
        .collect();

    let started = Instant::now();
    let response = github_post(&daemon, ISSUE, "during-the-attack");
    let answered_in = started.elapsed();
    assert_eq!(response.status, 202, "{response:?}");
    // Answered while the stalled bodies still waited: not after their timeout freed a slot.
    assert!(answered_in < BODY_TIMEOUT, "answered after {answered_in:?}");
    let event_id = response.event_id();
    assert_eq!(
        workspace.wait_terminal(&event_id, Duration::from_secs(30)),
        "completed"
    );
    assert!(marker.exists(), "the turn's tool did not run");

    // Unsigned heads were answered 401 without their bodies.
    for (mut stream, _) in stalled.into_iter().filter(|(_, signed)| !signed).take(20) {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut raw = vec![0u8; 512];
        let read = stream.read(&mut raw).expect("an answer before the body");
        let response = parse_response(&raw[..read]).expect("response");
        assert_eq!(response.status, 401);
    }
}

/// Large bodies are read at most 64 at a time (docs/reference.md, "Threat model"). With 64
/// senders each holding 30 kB of a 60 kB body, a small webhook is answered at once, while a valid
/// large one waits, none of it read, until a stalled body times out (408, after the body
/// timeout: 4 × `header_timeout`) and frees its slot; then it is accepted.
#[test]
fn stalled_large_bodies_hold_only_their_slots() {
    let workspace = Workspace::new();
    let daemon = start_github(&workspace, "");
    let first_stalled = Instant::now();
    let head = "POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                x-github-event: issues\r\nx-hub-signature-256: sha256=00\r\n\
                content-length: 60000\r\n\r\n{";
    let stalled: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut stream = TcpStream::connect(daemon.addr).expect("connect");
            stream.write_all(head.as_bytes()).expect("head");
            stream.write_all(&[b' '; 30_000]).expect("part of the body");
            stream
        })
        .collect();
    wait_until(
        "the stalled bodies to hold every slot",
        Duration::from_secs(10),
        || {
            workspace
                .metrics()
                .contains("agentgate_large_body_slots_in_use 64")
        },
    );

    let started = Instant::now();
    let small = github_post(&daemon, ISSUE, "small-during-the-attack");
    assert_eq!(small.status, 202, "{small:?}");
    // Before a stalled body timed out: it did not wait for a large body's slot.
    assert!(started.elapsed() < BODY_TIMEOUT);

    let large = format!(
        r#"{{"action":"opened","repository":{{"full_name":"acme/web"}},"issue":{{"number":8}},"pad":"{}"}}"#,
        "x".repeat(30_000)
    );
    let response = github_post(&daemon, &large, "large-during-the-attack");
    let answered_after = first_stalled.elapsed();
    assert_eq!(response.status, 202, "{response:?}");
    assert!(
        answered_after >= BODY_TIMEOUT,
        "the large body was read after {answered_after:?}, while every slot was held"
    );
    for mut stream in stalled.into_iter().take(5) {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let response = read_response(&mut stream).expect("an answer");
        assert_eq!(response.status, 408, "{response:?}");
    }
}

/// Behind a trusted reverse proxy, refusals name the client from `X-Forwarded-For`; from anyone
/// else the header is ignored.
#[test]
fn refusals_name_the_client_behind_a_trusted_proxy() {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "trusted_proxies = [\"127.0.0.1\"]\n{}",
        github_config("")
    ));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let refused = daemon.post_json(
        "/hooks/github",
        &[("x-forwarded-for", "198.51.100.7, 203.0.113.9")],
        ISSUE,
    );
    assert_eq!(refused.status, 401);
    wait_until("the refusal's line", Duration::from_secs(10), || {
        daemon.log().contains("peer=203.0.113.9 (via 127.0.0.1:")
    });
}

/// The address the per-peer test's connections come from: not 127.0.0.1, whose connections of
/// the daemon's start (its readiness poll) may still be open, and counted, for a moment.
const PEER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(127, 0, 0, 3);

/// A connection to the daemon from `PEER`.
fn connect_from_peer(daemon: &Daemon) -> TcpStream {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("a socket");
    socket
        .bind(&std::net::SocketAddr::from((PEER, 0)).into())
        .expect("bind 127.0.0.3");
    socket.connect(&daemon.addr.into()).expect("connect");
    socket.into()
}

/// `count` connections from `PEER` that have begun a request head and stop there.
fn busy_connections(daemon: &Daemon, count: usize) -> Vec<TcpStream> {
    (0..count)
        .map(|_| {
            let mut stream = connect_from_peer(daemon);
            stream
                .write_all(b"POST /hooks/github HTTP/1.1\r\nhost: x\r\n")
                .expect("part of a head");
            stream
        })
        .collect()
}

/// `GET /healthz` on a new connection from `PEER`: the status line, "closed" when the
/// connection was closed without an answer, or what else went wrong.
fn health_from_peer(daemon: &Daemon) -> String {
    let mut stream = connect_from_peer(daemon);
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let mut answer = Vec::new();
    match stream.read_to_end(&mut answer) {
        Ok(_) if answer.is_empty() => "closed".to_string(),
        Ok(_) => String::from_utf8_lossy(&answer)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        // Closed with the request unread: the kernel resets the connection.
        Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => "closed".to_string(),
        Err(err) => format!("error: {err}"),
    }
}

/// One address cannot take every connection slot: past `max_connections_per_peer` busy
/// connections, its next one is closed at once (logged, counted), while another address is
/// served as usual; a trusted proxy, which carries everyone's connections, is not counted. A
/// reload applies both to the next connection.
#[test]
fn one_address_holds_at_most_max_connections_per_peer() {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "max_connections_per_peer = 4\n{}",
        github_config("")
    ));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let held = busy_connections(&daemon, 4);
    assert_eq!(health_from_peer(&daemon), "closed");
    let other = std::process::Command::new("curl")
        .args(["-s", "--max-time", "5", "--interface", "127.0.0.2"])
        .args(["-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("http://{}/healthz", daemon.addr))
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&other.stdout), "200", "{other:?}");
    // The probe above.
    let metrics = workspace.metrics();
    let refused: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("agentgate_peer_connections_refused_total "))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0);
    assert!(refused >= 1, "{metrics}");
    daemon.wait_for_log("its address holds server.max_connections_per_peer");
    drop(held);

    // A reload applies both to the next connection: a lower cap, then a trusted proxy.
    let reload = |server: &str| {
        workspace.write_config(&format!("{server}\n{}", github_config("")));
        let output = workspace.cli(&["reload"]);
        assert!(output.status.success(), "{output:?}");
    };
    reload("max_connections_per_peer = 2");
    let held = busy_connections(&daemon, 2);
    assert_eq!(health_from_peer(&daemon), "closed");
    drop(held);
    reload("max_connections_per_peer = 2\ntrusted_proxies = [\"127.0.0.3\"]");
    let _held = busy_connections(&daemon, 4);
    assert_eq!(health_from_peer(&daemon), "HTTP/1.1 200 OK");
}

/// Requests the HTTP layer answers itself, before any route sees them (a head that cannot be
/// parsed, one with too many header lines), are refusals like the rest: counted by reason and
/// logged.
#[test]
fn requests_the_http_layer_refuses_are_counted_and_logged() {
    let workspace = Workspace::new();
    workspace.write_config(&github_config(""));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let answer = |head: &[u8]| -> String {
        let mut stream = TcpStream::connect(daemon.addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        stream.write_all(head).expect("head");
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw);
        String::from_utf8_lossy(&raw)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(
        answer(b"NOT HTTP AT ALL\r\n\r\n"),
        "HTTP/1.1 400 Bad Request"
    );
    let many: String = (0..200).map(|n| format!("x-{n}: y\r\n")).collect();
    let head = format!("POST /hooks/github HTTP/1.1\r\nhost: x\r\n{many}\r\n");
    assert_eq!(
        answer(head.as_bytes()),
        "HTTP/1.1 431 Request Header Fields Too Large"
    );
    let metrics = workspace.metrics();
    for (code, reason) in [(400, "malformed_request"), (431, "head_too_large")] {
        let line =
            format!("agentgate_refusals_total{{route=\"\",code=\"{code}\",reason=\"{reason}\"}} 1");
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }
    daemon.wait_for_log("webhook refused (400): the request's head cannot be parsed");
    daemon.wait_for_log("webhook refused (431): the request's head is too large");
}

/// Memory a flood of connections took goes back to the system once they are gone: the
/// allocator's free memory is trimmed every few seconds (before, 800 closed keep-alive
/// connections left their ~12 MiB with the process for good).
#[test]
fn memory_a_flood_took_is_given_back_after_it() {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "max_connections_per_peer = 4096\n{}",
        github_config("")
    ));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let rss = || proc_status_kib(daemon.pid(), "VmRSS");
    let before = rss();
    let flood: Vec<TcpStream> = (0..800)
        .map(|_| {
            let mut stream = TcpStream::connect(daemon.addr).expect("connect");
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .expect("request");
            let mut answer = [0u8; 256];
            let read = stream.read(&mut answer).expect("answer");
            assert!(answer[..read].starts_with(b"HTTP/1.1 200"));
            stream
        })
        .collect();
    let during = rss();
    assert!(
        during > before + 6 * 1024,
        "the flood took {} KiB",
        during - before
    );
    drop(flood);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let after = rss();
        if after < before + 3 * 1024 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the flood's memory did not go back within 30 s: {before} KiB before it, {during} \
             KiB during it, {after} KiB now"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// When every `max_connections` slot is held by an idle keep-alive connection (one request
/// answered, nothing since), a new sender is not left in the backlog until `keepalive_timeout`:
/// the connection idle the longest is closed and the webhook answered at once.
#[test]
fn idle_connections_make_room_at_max_connections() {
    let workspace = Workspace::new();
    workspace.write_config(&format!("max_connections = 8\n{}", github_config("")));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let mut idle: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut stream = TcpStream::connect(daemon.addr).expect("connect");
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .expect("request");
            let mut answer = [0u8; 512];
            let read = stream.read(&mut answer).expect("answer");
            assert!(answer[..read].starts_with(b"HTTP/1.1 200"), "{answer:?}");
            stream
        })
        .collect();
    let started = Instant::now();
    assert_eq!(github_post(&daemon, ISSUE, "makes-room").status, 202);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?} behind idle connections",
        started.elapsed()
    );
    assert!(
        workspace.metrics().contains(
            r#"agentgate_idle_connections_closed_total{listener="webhook",state="idle"} 1"#
        ),
        "{}",
        workspace.metrics()
    );
    // One of the idle connections was closed (end of stream), the others are still open.
    let mut closed = 0;
    for stream in &mut idle {
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        if matches!(stream.read(&mut [0u8; 16]), Ok(0)) {
            closed += 1;
        }
    }
    assert_eq!(closed, 1);
}

/// HTTP/2 connections do not stay open forever: one that never opens a stream is closed after
/// `header_timeout` (1 s in the tests), and one whose streams are done after `keepalive_timeout`.
#[test]
fn idle_http2_connections_are_closed() {
    use http_body_util::Full;
    let (_workspace, daemon) = alerts_route("keepalive_timeout = \"2s\"\n");
    let runtime = client_runtime();
    let open = |send: bool| {
        runtime.block_on(async {
            let stream = tokio::net::TcpStream::connect(daemon.addr)
                .await
                .expect("connect");
            let (mut sender, connection) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(stream),
            )
            .await
            .expect("h2 handshake");
            let connection = tokio::spawn(connection);
            let opened = Instant::now();
            if send {
                let request = http::Request::post(format!("http://{}/hooks/alerts", daemon.addr))
                    .body(Full::new(bytes::Bytes::from_static(b"{}")))
                    .expect("request");
                let response = sender.send_request(request).await.expect("response");
                assert_eq!(response.status().as_u16(), 202);
            }
            let idle = Instant::now();
            let closed = tokio::time::timeout(Duration::from_secs(20), connection).await;
            assert!(closed.is_ok(), "the idle connection stayed open");
            if send {
                idle.elapsed()
            } else {
                opened.elapsed()
            }
        })
    };
    let without_stream = open(false);
    assert!(
        without_stream < Duration::from_secs(5),
        "{without_stream:?}"
    );
    // A client that never answers the GOAWAY's PING (a flood's) is dropped all the same.
    let mut silent = TcpStream::connect(daemon.addr).expect("connect");
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .expect("preface");
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let opened = Instant::now();
    let mut seen = Vec::new();
    assert!(
        silent.read_to_end(&mut seen).is_ok(),
        "still open after {:?}",
        opened.elapsed()
    );
    let after_stream = open(true);
    assert!(
        after_stream >= Duration::from_millis(1500) && after_stream < Duration::from_secs(10),
        "{after_stream:?}"
    );
}

/// The metrics listener and the control socket bound their connections and close idle ones
/// (after `header_timeout`): a flood of idle connections to the metrics port neither keeps its
/// descriptors nor stops webhooks and the control socket from being served.
#[test]
fn idle_connections_to_the_metrics_listener_are_bounded_and_closed() {
    let workspace = Workspace::new();
    let metrics_port = workspace.metrics_addr().port();
    workspace.write_config(&format!(
        "metrics_listen = \"127.0.0.1:{metrics_port}\"\n{}",
        github_config("")
    ));
    let daemon = workspace.start_with_env(&[("TEST_GITHUB_SECRET", GITHUB_SECRET)]);
    let mut idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(("127.0.0.1", metrics_port)).expect("connect"))
        .collect();
    assert_eq!(github_post(&daemon, ISSUE, "beside-the-flood").status, 202);
    assert!(workspace.metrics().contains("agentgate_accepting 1"));
    // Every idle connection the daemon took is closed after header_timeout (1 s here).
    for stream in &mut idle {
        stream
            .set_read_timeout(Some(Duration::from_millis(20)))
            .expect("timeout");
    }
    let mut closed = vec![false; idle.len()];
    let pid = daemon.pid();
    let descriptors = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(Iterator::count)
            .unwrap_or(0)
    };
    wait_until(
        "the idle metrics connections to be closed",
        Duration::from_secs(20),
        || {
            for (stream, closed) in idle.iter_mut().zip(closed.iter_mut()) {
                *closed |= matches!(stream.read(&mut [0u8; 16]), Ok(0));
            }
            closed.iter().filter(|closed| **closed).count() >= 64
        },
    );
    assert!(
        descriptors() < 150,
        "{} descriptors open with 200 idle connections",
        descriptors()
    );
}

/// Under an open-file limit too low for `max_connections` (here 600 descriptors against the
/// default 4,096 connections), the daemon serves fewer connections and says so, keeping
/// descriptors for its store, tools and models instead of letting connections take them all.
#[test]
fn max_connections_is_lowered_to_what_the_open_file_limit_leaves() {
    let workspace = Workspace::new();
    workspace.write_config(
        "[routes.alerts]\npath = \"/hooks/alerts\"\nverify = { scheme = \"none\" }\n",
    );
    let daemon = workspace.start_wrapped(&["prlimit", "--nofile=600:600", "--"]);
    daemon.wait_for_log("server.max_connections lowered");
    let log = daemon.log();
    assert!(
        log.contains("server.max_connections lowered") && log.contains("used=88"),
        "{log}"
    );
}

/// An unauthenticated HTTP/2 client gets few streams and a small window: what one connection
/// can make the daemon hold stays small (docs/reference.md, "Threat model").
#[test]
fn http2_clients_get_few_streams() {
    let (_workspace, daemon) = alerts_route("");
    let runtime = client_runtime();
    let streams = runtime.block_on(async {
        let stream = tokio::net::TcpStream::connect(daemon.addr)
            .await
            .expect("connect");
        let (sender, connection) = h2::client::handshake(stream).await.expect("handshake");
        tokio::spawn(connection);
        // The server's SETTINGS have arrived once a request went through.
        let mut sender = sender.ready().await.expect("ready");
        let request = http::Request::get(format!("http://{}/healthz", daemon.addr))
            .body(())
            .expect("request");
        let (response, _) = sender.send_request(request, true).expect("send");
        assert_eq!(response.await.expect("response").status(), 200);
        sender.current_max_send_streams()
    });
    assert_eq!(streams, 16);
}

/// A runtime for the tests' own HTTP/2 clients.
fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A daemon with one unsigned route, `/hooks/alerts`, and `server` (lines of `[server]`).
fn alerts_route(server: &str) -> (Workspace, Daemon) {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "{server}[routes.alerts]\npath = \"/hooks/alerts\"\nverify = {{ scheme = \"none\" }}\n"
    ));
    let daemon = workspace.start();
    (workspace, daemon)
}

/// A flood on one route cannot take another route's capacity: each route may queue its share
/// of `max_queued_events` (here route `flooded` sets 2), past which it gets `503` while the
/// other route is still acknowledged.
#[test]
fn a_flooded_route_cannot_take_another_routes_queue() {
    use common::stub::{Reply, Stub};
    let model = Stub::start(|_, _| Reply::answer("slow").after(Duration::from_secs(60)));
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "{}\n[routes.flooded]\npath = \"/flooded\"\nverify = {{ scheme = \"none\" }}\nsession = \"one\"\nmax_queued_events = 2\n\n[routes.quiet]\npath = \"/quiet\"\nverify = {{ scheme = \"none\" }}\n",
        model.model_section()
    ));
    let daemon = workspace.start();
    let mut refused = None;
    for _ in 0..10 {
        let answer = daemon.post_json("/flooded", &[], "{}");
        if answer.status == 503 {
            refused = Some(answer);
            break;
        }
        assert_eq!(answer.status, 202, "{answer:?}");
    }
    let refused = refused.expect("the flooded route is refused past its share");
    assert!(refused.body.contains("route flooded"), "{refused:?}");
    assert_eq!(daemon.post_json("/quiet", &[], "{}").status, 202);
}
