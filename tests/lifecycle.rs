//! The daemon's life outside a full systemd: socket activation (systemd-socket-activate), the
//! sd_notify protocol (a fake NOTIFY_SOCKET), SIGHUP reload, and the control socket.

mod common;

use std::io::Read;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::stub::{Reply, Stub};
use common::*;

const ROUTE: &str = "[routes.hook]\npath = \"/hook\"\nverify = { scheme = \"none\" }\n";

/// Collects sd_notify datagrams sent to a socket in the workspace.
struct NotifySocket {
    socket: UnixDatagram,
    path: std::path::PathBuf,
    seen: Vec<String>,
}

impl NotifySocket {
    fn new(workspace: &Workspace) -> NotifySocket {
        let path = workspace.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind notify socket");
        socket
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        NotifySocket {
            socket,
            path,
            seen: Vec::new(),
        }
    }

    /// Waits for a message containing `needle`; returns it.
    fn expect(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        if let Some(found) = self.seen.iter().find(|m| m.contains(needle)) {
            return found.clone();
        }
        let mut buffer = [0u8; 4096];
        while Instant::now() < deadline {
            if let Ok(n) = self.socket.recv(&mut buffer) {
                let message = String::from_utf8_lossy(&buffer[..n]).into_owned();
                self.seen.push(message.clone());
                if message.contains(needle) {
                    return message;
                }
            }
        }
        panic!("no sd_notify message with {needle:?}; saw {:?}", self.seen);
    }
}

#[test]
fn notify_protocol_ready_status_watchdog_reload_stopping_and_extend() {
    let workspace = Workspace::new();
    workspace.write_config(ROUTE);
    let mut notify = NotifySocket::new(&workspace);
    let daemon = workspace.start_with_env(&[
        ("NOTIFY_SOCKET", notify.path.to_str().expect("path")),
        ("WATCHDOG_USEC", "600000"),
    ]);
    notify.expect("READY=1", Duration::from_secs(10));
    notify.expect(
        "STATUS=0 running, 0 queued, 0 resume-pending, 0 suspended",
        Duration::from_secs(10),
    );
    notify.expect("WATCHDOG=1", Duration::from_secs(5));

    signal(daemon.pid(), "HUP");
    notify.expect("RELOADING=1", Duration::from_secs(5));
    let after_reload = notify.expect("STATUS=reloaded", Duration::from_secs(5));
    assert!(after_reload.contains("READY=1"));

    // A daemon frozen in place stops pinging; systemd's watchdog would then kill it.
    signal(daemon.pid(), "STOP");
    notify.seen.clear();
    std::thread::sleep(Duration::from_millis(800));
    let mut buffer = [0u8; 512];
    let mut pinged = false;
    while let Ok(n) = notify.socket.recv(&mut buffer) {
        pinged |= String::from_utf8_lossy(&buffer[..n]).contains("WATCHDOG=1");
    }
    assert!(!pinged, "a stopped daemon cannot ping");
    signal(daemon.pid(), "CONT");

    let pid = daemon.pid();
    signal(pid, "TERM");
    notify.expect("STOPPING=1", Duration::from_secs(5));
    notify.expect("EXTEND_TIMEOUT_USEC=", Duration::from_secs(5));
    // The hand-over is a stage of the drain, inside the extension systemd is told about.
    notify.expect(
        "STATUS=stopping: handing the store's leases back",
        Duration::from_secs(30),
    );
    drop(daemon);
}

/// Low-disk refusals are visible: below `min_free_disk` every webhook gets 503, and `STATUS=`
/// (so `systemctl status`), `status --json` and `agentgate_accepting` say so.
#[test]
fn refusing_for_low_disk_shows_in_status_and_metrics() {
    let workspace = Workspace::new();
    workspace.write_config(&format!(
        "[runtime]\nmin_free_disk = \"1000000GB\"\n\n{ROUTE}"
    ));
    let mut notify = NotifySocket::new(&workspace);
    let daemon = workspace.start_with_env(&[
        ("NOTIFY_SOCKET", notify.path.to_str().expect("path")),
        ("WATCHDOG_USEC", "600000"),
    ]);
    let refused = daemon.post_json("/hook", &[], "{}");
    assert_eq!(refused.status, 503, "{refused:?}");
    let status = notify.expect("refusing webhooks (503)", Duration::from_secs(10));
    assert!(status.contains("min_free_disk"), "{status}");
    assert_eq!(workspace.status()["accepting"]["ok"], false);
    let metrics = workspace.metrics();
    assert!(metrics.contains("agentgate_accepting 0"), "{metrics}");
}

#[test]
fn reload_with_a_broken_config_keeps_serving_the_old_one() {
    let workspace = Workspace::new();
    workspace.write_config(ROUTE);
    let daemon = workspace.start();
    assert_eq!(daemon.post_json("/hook", &[], "{}").status, 202);

    std::fs::write(workspace.config_path(), "[routes.hook]\npath = 7\n").expect("break the config");
    signal(daemon.pid(), "HUP");
    wait_until("the refusal", Duration::from_secs(10), || {
        daemon.log().contains("reload refused")
    });
    assert_eq!(
        daemon.post_json("/hook", &[], "{}").status,
        202,
        "old route gone after a bad reload"
    );

    workspace.write_config(&format!(
        "{ROUTE}\n[routes.second]\npath = \"/second\"\nverify = {{ scheme = \"none\" }}\n"
    ));
    signal(daemon.pid(), "HUP");
    wait_until("the reload", Duration::from_secs(10), || {
        daemon.log().contains("config reloaded")
    });
    assert_eq!(daemon.post_json("/second", &[], "{}").status, 202);
}

#[test]
fn sessions_and_events_on_the_control_socket_come_in_pages() {
    let workspace = Workspace::new();
    let socket = workspace.path().join("control.sock");
    workspace.write_config(&format!(
        "[model]\nbackend = \"replay\"\n{ROUTE}session = \"{{{{ payload.s }}}}\"\n"
    ));
    let daemon = workspace.start();
    let mut ids = Vec::new();
    for key in ["e", "a", "d", "b", "c"] {
        let response = daemon.post_json("/hook", &[], &format!(r#"{{"s":"{key}"}}"#));
        assert_eq!(response.status, 202);
        ids.push(response.event_id());
    }
    // Sessions in key order, two at a time, each page naming the next.
    let mut keys = Vec::new();
    let mut pages = 0;
    let mut target = "/v1/sessions?limit=2".to_string();
    loop {
        let page = control_request(&socket, "GET", &target).json();
        pages += 1;
        for session in page["sessions"].as_array().expect("sessions") {
            keys.push(session["key"].as_str().expect("key").to_string());
        }
        match page["next"].as_str() {
            Some(next) => target = format!("/v1/sessions?limit=2&after={next}"),
            None => break,
        }
    }
    assert_eq!(keys, ["a", "b", "c", "d", "e"]);
    assert_eq!(pages, 3);
    // Events newest first, with the same kind of cursor.
    let first = control_request(&socket, "GET", "/v1/events?limit=3").json();
    let second = control_request(
        &socket,
        "GET",
        &format!(
            "/v1/events?limit=3&before={}",
            first["next"].as_str().expect("next")
        ),
    )
    .json();
    let listed: Vec<&str> = first["events"]
        .as_array()
        .into_iter()
        .chain(second["events"].as_array())
        .flatten()
        .filter_map(|event| event["id"].as_str())
        .collect();
    let newest_first: Vec<&str> = ids.iter().rev().map(String::as_str).collect();
    assert_eq!(listed, newest_first);
    assert!(second["next"].is_null());
    let by_session = control_request(&socket, "GET", "/v1/events?session=d").json();
    assert_eq!(by_session["events"][0]["id"], ids[2].as_str());
    // A page is bounded whatever the client asks.
    for bad in ["0", "1001", "many"] {
        let refused = control_request(&socket, "GET", &format!("/v1/sessions?limit={bad}"));
        assert_eq!(refused.status, 400, "limit={bad}");
    }
    // Each refusal is counted and logged, as on the webhook listener.
    let metrics = control_request(&socket, "GET", "/metrics").body;
    assert!(
        metrics.contains(
            "agentgate_control_refusals_total{listener=\"control\",code=\"400\",reason=\"bad_limit\"} 3"
        ),
        "{metrics}"
    );
    daemon.wait_for_log("control request refused (400)");
    assert_eq!(control_request(&socket, "GET", "/v1/nothing").status, 404);
    let metrics = control_request(&socket, "GET", "/metrics").body;
    assert!(
        metrics.contains(
            "agentgate_control_refusals_total{listener=\"control\",code=\"404\",reason=\"not_found\"} 1"
        ),
        "{metrics}"
    );
}

#[test]
fn control_socket_serves_status_metrics_and_overrides() {
    use std::os::unix::fs::PermissionsExt;
    let workspace = Workspace::new();
    // The daemon binds its sockets itself here, so that the control socket's mode is its own.
    workspace.release_port();
    let socket = workspace.path().join("control.sock");
    let text = format!(
        "state_dir = {:?}\n[server]\nlisten = \"127.0.0.1:{}\"\ncontrol_socket = {:?}\n[model]\nbackend = \"replay\"\n{ROUTE}session = \"{{{{ payload.s }}}}\"\n",
        workspace.state_dir().display(),
        workspace.port,
        socket.display()
    );
    std::fs::write(workspace.config_path(), text).expect("config");
    let daemon = workspace.start();
    assert_eq!(
        daemon
            .post_json("/hook", &[], r#"{"s":"acme/web#7"}"#)
            .status,
        202
    );
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o660);

    let status = control_request(&socket, "GET", "/v1/status");
    assert_eq!(status.status, 200);
    assert_eq!(status.json()["events"]["total"], 1);
    assert_eq!(status.json()["daemon"]["running"], true);
    let metrics = control_request(&socket, "GET", "/metrics");
    assert!(
        metrics.body.contains("agentgate_store_writable 1"),
        "{}",
        metrics.body
    );
    let sessions = control_request(&socket, "GET", "/v1/sessions");
    assert_eq!(sessions.json()["sessions"][0]["key"], "acme/web#7");

    let suspended = control_request(&socket, "POST", "/v1/sessions/acme%2Fweb%237/suspend");
    assert_eq!(suspended.status, 200, "{suspended:?}");
    let state: Vec<String> = workspace.query("SELECT state FROM sessions", |r| r.get(0));
    assert_eq!(state, ["suspended"]);
    let resumed = control_request(&socket, "POST", "/v1/sessions/acme%2Fweb%237/resume");
    assert_eq!(resumed.json()["previous_state"], "suspended");
    assert_eq!(
        control_request(&socket, "POST", "/v1/sessions/nope/resume").status,
        404
    );
    // The daemon's stderr is read by another thread: wait for the line rather than race it.
    wait_until(
        "the suspension's journal line",
        Duration::from_secs(10),
        || {
            daemon
                .log()
                .contains("session suspended by the operator; no turn of it starts")
        },
    );
    assert_eq!(
        daemon.post_json("/nowhere", &[], "{}").status,
        404,
        "an unknown path"
    );

    let metrics = control_request(&socket, "GET", "/metrics").body;
    for line in [
        "agentgate_http_requests_total{route=\"hook\",code=\"202\"} 1",
        "agentgate_http_requests_total{route=\"\",code=\"404\"} 1",
        "agentgate_accept_duration_seconds_count 1",
        "agentgate_operator_actions_total{action=\"suspend\"} 1",
        "agentgate_operator_actions_total{action=\"resume\"} 1",
        "agentgate_events{status=\"",
        "# TYPE agentgate_deliveries_total counter",
        "# TYPE agentgate_deliveries gauge",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    wait_until(
        "the refusal's log line, with its peer",
        Duration::from_secs(10),
        || daemon.log().contains("webhook refused") && daemon.log().contains("peer=127.0.0.1:"),
    );
}

/// `agentgate reload` waits for the daemon's verdict: 0 with what changed (and what waits for a
/// restart), 78 with the findings when the new config is refused, which leaves the old one in
/// effect. With no daemon there is nothing to reload (69).
#[test]
fn reload_reports_what_changed_and_refuses_a_bad_config_with_78() {
    let workspace = Workspace::new();
    let with_routes = |extra: &str| {
        workspace.write_config(&format!("[model]\nbackend = \"replay\"\n{ROUTE}\n{extra}"));
    };
    with_routes("");
    let output = workspace.cli(&["reload"]);
    assert_eq!(output.status.code(), Some(69), "{output:?}");

    let daemon = workspace.start();
    let output = workspace.cli(&["reload"]);
    assert!(output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("reloaded"),
        "{output:?}"
    );

    with_routes(
        "[routes.second]\npath = \"/second\"\nverify = { scheme = \"none\" }\n\n[runtime]\nmax_concurrent_turns = 3\n",
    );
    assert_eq!(daemon.post_json("/second", &[], "{}").status, 404);
    let output = workspace.cli(&["reload"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout.contains("changed runtime.max_concurrent_turns, routes.second"),
        "{stdout}"
    );
    assert!(!stdout.contains("waiting for a restart"), "{stdout}");
    assert_eq!(daemon.post_json("/second", &[], "{}").status, 202);

    // A delivery secret that is not a Standard Webhooks secret: refused, old config kept.
    with_routes(
        "deliver = { kind = \"http\", url = \"http://127.0.0.1:9/\", secret = \"plain\" }\n",
    );
    let output = workspace.cli(&["reload"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(78), "{output:?}");
    assert!(
        stdout.contains("routes.hook.deliver.secret") && stdout.contains("whsec_"),
        "{stdout}"
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("reload refused"),
        "{output:?}"
    );
    assert_eq!(
        daemon.post_json("/second", &[], "{}").status,
        202,
        "the previous config stays in effect"
    );
    wait_until("the refusal's log line", Duration::from_secs(10), || {
        daemon.log().contains("config reload refused")
    });
}

/// A model that calls the tool `slow` (30 s), then answers.
fn slow_tool_model() -> Stub {
    Stub::start(|request, _| {
        if request.json().to_string().contains("\"role\":\"tool\"") {
            Reply::answer("done")
        } else {
            Reply::tool_call("call_1", "slow", serde_json::json!({}))
        }
    })
}

/// A config whose route's turns run `slow`, with `runtime` in `[runtime]`.
fn write_slow_turn_config(workspace: &Workspace, model: &Stub, runtime: &str) {
    workspace.write_config(&format!(
        "[runtime]\n{runtime}\n\n{}\n[tools.slow]\ndescription = \"slow\"\ncommand = [\"/bin/sleep\", \"30\"]\ntimeout = \"60s\"\n\n{ROUTE}tools = [\"slow\"]\n",
        model.model_section()
    ));
}

/// Waits until `count` turns ran their `slow` tool.
fn wait_for_tool_starts(workspace: &Workspace, count: i64) {
    wait_until("the slow tool to start", Duration::from_secs(10), || {
        workspace
            .query(
                "SELECT count(*) FROM transcript WHERE kind = 'tool_start'",
                |row| row.get::<_, i64>(0),
            )
            .first()
            == Some(&count)
    });
}

/// A stopping daemon keeps accepting webhooks while its running turns finish: a sender is
/// acknowledged at once, durably, and its event runs in the next process; the listener closes
/// only after the turns' drain_timeout.
#[test]
fn a_draining_daemon_keeps_acknowledging_webhooks() {
    let workspace = Workspace::new();
    let model = slow_tool_model();
    write_slow_turn_config(&workspace, &model, "drain_timeout = \"3s\"");
    let daemon = workspace.start();
    daemon.post_json("/hook", &[], "{}").event_id();
    wait_for_tool_starts(&workspace, 1);
    signal(daemon.pid(), "TERM");
    daemon.wait_for_log("stopping: no new turns");
    let sent = Instant::now();
    let during = daemon.post_json("/hook", &[], "{}");
    assert_eq!(during.status, 202, "{during:?}");
    assert!(
        sent.elapsed() < Duration::from_secs(1),
        "the sender waited {:?} during the drain",
        sent.elapsed()
    );
    let queued = during.event_id();
    assert!(daemon.terminate().success());
    assert_eq!(workspace.event_status(&queued), "queued");
    // The next process runs it.
    let _daemon = workspace.start();
    wait_for_tool_starts(&workspace, 2);
}

/// Every `[runtime]` key, as docs/reference.md lists them.
const RUNTIME_KEYS: [(&str, &str); 17] = [
    ("max_concurrent_turns", "7"),
    ("max_turn_steps", "9"),
    ("drain_timeout", "\"1s\""),
    ("turn_idle_timeout", "\"4m\""),
    ("resume_max_attempts", "5"),
    ("resume_window", "\"5h\""),
    ("dedup_window", "\"6d\""),
    ("max_tool_calls_per_reply", "15"),
    ("max_repeated_tool_calls", "3"),
    ("approval_timeout", "\"2h\""),
    ("max_background_jobs", "15"),
    ("max_background_jobs_per_session", "3"),
    ("max_internal_turns", "7"),
    ("max_queued_events", "99999"),
    ("min_free_disk", "\"1000000GB\""),
    ("event_log_level", "\"debug\""),
    ("event_log_max_per_second", "299"),
];

/// A reload applies every `[runtime]` key at once, and its report says so for each: changed
/// now, none waiting for a restart. Checked against what the daemon then does: a new
/// `min_free_disk` refuses webhooks at once, and a new `drain_timeout` bounds the next drain
/// (the daemon started with one of 60 s).
#[test]
fn every_runtime_key_applies_at_once_and_the_reload_says_so() {
    let workspace = Workspace::new();
    let model = slow_tool_model();
    let write = |runtime: &str| write_slow_turn_config(&workspace, &model, runtime);
    write("drain_timeout = \"60s\"\nmin_free_disk = \"0\"");
    let daemon = workspace.start();
    let every: Vec<String> = RUNTIME_KEYS
        .iter()
        .map(|(key, value)| format!("{key} = {value}"))
        .collect();
    write(&every.join("\n"));
    let output = workspace.cli(&["reload"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    let changed = stdout
        .lines()
        .find_map(|line| line.strip_prefix("reloaded: changed "))
        .unwrap_or_else(|| panic!("no changed line: {stdout}"));
    for (key, _) in RUNTIME_KEYS {
        assert!(
            changed
                .split(", ")
                .any(|name| name == format!("runtime.{key}")),
            "runtime.{key} is not reported as applied: {stdout}"
        );
    }
    assert!(!stdout.contains("waiting for a restart"), "{stdout}");
    wait_until(
        "min_free_disk to refuse webhooks",
        Duration::from_secs(10),
        || daemon.request("GET", "/readyz", &[], b"").status == 503,
    );

    // Webhooks are taken again; the drain now has 1 s for the running turn, not 60.
    let mut relaxed = every.clone();
    relaxed.retain(|line| !line.starts_with("min_free_disk"));
    relaxed.push("min_free_disk = \"0\"".into());
    write(&relaxed.join("\n"));
    assert!(workspace.cli(&["reload"]).status.success());
    wait_until(
        "webhooks to be accepted again",
        Duration::from_secs(10),
        || daemon.request("GET", "/readyz", &[], b"").status == 200,
    );
    let event = daemon.post_json("/hook", &[], "{}").event_id();
    wait_until("the slow tool to start", Duration::from_secs(10), || {
        !model.requests().is_empty()
            && workspace
                .query(
                    "SELECT count(*) FROM transcript WHERE kind = 'tool_start'",
                    |row| row.get::<_, i64>(0),
                )
                .first()
                == Some(&1)
    });
    let stopping = Instant::now();
    assert!(daemon.terminate().success());
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "the drain took {:?}: the reloaded drain_timeout (1s) did not apply",
        stopping.elapsed()
    );
    assert_eq!(workspace.event_status(&event), "running");
    let reason: Vec<String> = workspace.query(
        "SELECT reason FROM sessions WHERE state = 'resume_pending'",
        |row| row.get(0),
    );
    assert_eq!(reason, ["shutdown_timeout"]);
}

/// Every key of every section (docs/reference.md) but `[runtime]`'s (`RUNTIME_KEYS`), the
/// PostgreSQL keys of `[store]` and the keys of `[model]`'s other backends (the report's unit
/// tests cover those): its value before a reload (`""`: not set), after it, and whether the
/// reload applies it at once. `{dir}` is the workspace, `{addr}` its webhook address, `{stub}`
/// the model's URL, `{port}` a free port, `{tls}` the certificate `self_signed` writes.
const EVERY_KEY: [(&str, &str, &str, bool); 39] = [
    ("state_dir", "\"{dir}/state\"", "\"{dir}/moved\"", false),
    ("server.listen", "\"{addr}\"", "\"127.0.0.1:{port}\"", false),
    (
        "server.control_socket",
        "\"{dir}/control.sock\"",
        "\"{dir}/other.sock\"",
        false,
    ),
    ("server.header_timeout", "\"1s\"", "\"2s\"", false),
    ("server.max_body", "\"64KiB\"", "\"32KiB\"", true),
    ("server.keepalive_timeout", "", "\"60s\"", false),
    ("server.max_connections", "", "100", false),
    ("server.max_connections_per_peer", "", "50", true),
    ("server.trusted_proxies", "", "[\"10.0.0.0/8\"]", true),
    ("server.metrics_listen", "", "\"127.0.0.1:{port}\"", false),
    ("server.public_url", "", "\"http://{addr}\"", true),
    ("model.backend", "\"openai\"", "\"openai\"", false),
    (
        "model.base_url",
        "\"{stub}/v1\"",
        "\"http://127.0.0.1:9/v1\"",
        false,
    ),
    ("model.model", "\"stub\"", "\"other\"", false),
    ("model.api_key", "", "\"sk-not-a-key\"", false),
    ("model.request_timeout", "\"60s\"", "\"30s\"", false),
    ("model.max_retries", "0", "2", false),
    ("model.outage_wait", "", "\"5s\"", false),
    ("model.params", "", "{ temperature = 0.5 }", false),
    ("model.tool_calls_in_content", "", "true", false),
    (
        "model.price",
        "",
        "{ input_per_mtok = 1.0, output_per_mtok = 2.0 }",
        true,
    ),
    (
        "model.fallback",
        "",
        "[{ base_url = \"http://127.0.0.1:9/v1\", model = \"m\" }]",
        false,
    ),
    ("model.max_concurrent_requests", "", "3", false),
    ("store.retention", "", "\"10d\"", true),
    ("budgets.turn_tokens", "", "100000", true),
    ("budgets.turn_usd", "", "10.0", true),
    ("budgets.session_tokens", "", "100000", true),
    ("budgets.session_usd", "", "10.0", true),
    ("budgets.daily_tokens", "", "500", true),
    ("budgets.daily_usd", "", "10.0", true),
    ("budgets.warn_at", "", "0.5", true),
    (
        "telemetry.otlp_endpoint",
        "",
        "\"http://127.0.0.1:9\"",
        false,
    ),
    ("telemetry.sample_ratio", "", "0.5", false),
    ("telemetry.capture_content", "", "true", false),
    ("console.enabled", "", "false", true),
    ("console.listen", "", "\"127.0.0.1:{port}\"", false),
    ("console.token", "", "\"a-long-console-token-0123\"", true),
    ("console.tls", "", "{tls}", false),
    (
        "console.trace_url",
        "",
        "\"http://127.0.0.1:16686/trace/{trace_id}\"",
        true,
    ),
];

/// One key of `EVERY_KEY` or `RUNTIME_KEYS`, its placeholders filled in.
struct Key {
    name: String,
    before: Option<String>,
    after: String,
    now: bool,
}

/// `EVERY_KEY` and `RUNTIME_KEYS` for `workspace` and `model`.
fn every_key(workspace: &Workspace, model: &Stub) -> Vec<Key> {
    let fill = |value: &str| {
        let mut value = value
            .replace("{dir}", &workspace.path().display().to_string())
            .replace("{addr}", &workspace.addr().to_string())
            .replace("{stub}", &model.url())
            .replace("{tls}", &tls_of(workspace));
        while value.contains("{port}") {
            value = value.replacen("{port}", &free_port().to_string(), 1);
        }
        value
    };
    let runtime = RUNTIME_KEYS.iter().map(|(name, value)| {
        // Webhooks must still be taken after the reload.
        let value = if *name == "min_free_disk" {
            "\"1KB\""
        } else {
            value
        };
        (format!("runtime.{name}"), "", value, true)
    });
    EVERY_KEY
        .iter()
        .map(|(name, before, after, now)| (name.to_string(), *before, *after, *now))
        .chain(runtime)
        .map(|(name, before, after, now)| Key {
            name,
            before: (!before.is_empty()).then(|| fill(before)),
            after: fill(after),
            now,
        })
        .collect()
}

/// The config with each of `keys` set to what `value` picks, in its section; then the route.
fn config_of(keys: &[Key], value: impl Fn(&Key) -> Option<String>) -> String {
    let mut sections: Vec<(&str, String)> = Vec::new();
    for key in keys {
        let (section, name) = key.name.split_once('.').unwrap_or(("", &key.name));
        let Some(value) = value(key) else { continue };
        let line = format!("{name} = {value}\n");
        match sections.iter_mut().find(|(known, _)| *known == section) {
            Some((_, lines)) => lines.push_str(&line),
            None => sections.push((section, line)),
        }
    }
    let tables: String = sections
        .iter()
        .map(|(section, lines)| match *section {
            "" => lines.clone(),
            section => format!("\n[{section}]\n{lines}"),
        })
        .collect();
    format!("{tables}\n{ROUTE}")
}

/// `tls = …` with the certificate and key `self_signed` writes in the workspace.
fn tls_of(workspace: &Workspace) -> String {
    let path = |name: &str| workspace.path().join(name).display().to_string();
    format!(
        "{{ cert = {{ file = {:?} }}, key = {{ file = {:?} }} }}",
        path("cert.pem"),
        path("key.pem")
    )
}

/// The report of a reload through the control socket at `socket`: what changed now and what
/// waits for a restart, each sorted.
fn reload_report(socket: &std::path::Path) -> (Vec<String>, Vec<String>) {
    let answer = control_request(socket, "POST", "/v1/reload");
    assert_eq!(answer.status, 200, "{answer:?}");
    let report = answer.json();
    let list = |name: &str| {
        let mut keys: Vec<String> = report[name]
            .as_array()
            .unwrap_or_else(|| panic!("no {name} in {report}"))
            .iter()
            .filter_map(|key| key.as_str().map(str::to_string))
            .collect();
        keys.sort();
        keys
    };
    (list("changed"), list("at_restart"))
}

/// Changing every key of every section in one reload: the report names each key, as applied
/// now or at the next restart, and the daemon then does what it says: the new `max_body`,
/// `public_url`, `[budgets]`, `model.price` and `console.enabled` apply to the next request and
/// turn, while the old listeners, state directory and model endpoint keep serving. A second
/// reload that turns on `server.tls` serves HTTPS at once.
#[test]
fn every_key_of_every_section_is_reported_as_it_applies() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::answer("done").with_usage(1000, 0, 20));
    let keys = every_key(&workspace, &model);
    std::fs::write(
        workspace.config_path(),
        config_of(&keys, |key| key.before.clone()),
    )
    .expect("config");
    let daemon = workspace.start();
    let socket = workspace.path().join("control.sock");
    self_signed(workspace.path(), "reloaded");
    let after = config_of(&keys, |key| Some(key.after.clone()));
    std::fs::write(workspace.config_path(), &after).expect("config");
    let (changed, at_restart) = reload_report(&socket);

    let named = |now: bool| {
        let mut names: Vec<String> = keys
            .iter()
            .filter(|key| key.now == now && key.before.as_ref() != Some(&key.after))
            .map(|key| key.name.clone())
            .collect();
        // `server.max_body` is the route's default: the route changed too.
        if now {
            names.push("routes.hook".into());
        }
        names.sort();
        names
    };
    assert_eq!(changed, named(true), "applied now");
    assert_eq!(at_restart, named(false), "waiting for a restart");

    // Applied now: the smaller body limit, the approval links, the disabled console.
    let body = format!("{{\"pad\":\"{}\"}}", "x".repeat(40 * 1024));
    assert_eq!(daemon.post_json("/hook", &[], &body).status, 413);
    let link = daemon.request("GET", "/approvals/none/approve", &[], b"");
    assert!(link.body.contains("no_approval"), "{link:?}");
    assert_eq!(control_request(&socket, "GET", "/console/").status, 404);
    // The model endpoint, state directory and listeners of the start still serve; the price and
    // the daily budget of the reload count what it spends.
    let first = daemon.post_json("/hook", &[], "{}").event_id();
    assert_eq!(
        workspace.wait_terminal(&first, Duration::from_secs(30)),
        "completed"
    );
    assert_eq!(model.requests().len(), 1);
    let metrics = workspace.metrics();
    let cost: f64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("agentgate_model_cost_usd_total{route=\"hook\"} "))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0);
    assert!((cost - 0.00104).abs() < 1e-9, "{metrics}");
    let second = daemon.post_json("/hook", &[], "{}").event_id();
    assert_eq!(
        workspace.wait_terminal(&second, Duration::from_secs(30)),
        "failed"
    );
    let errors: Vec<String> = workspace.query(
        &format!("SELECT error FROM turns WHERE event_id = '{second}'"),
        |row| row.get(0),
    );
    assert!(
        errors
            .iter()
            .any(|error| error.starts_with("budget exceeded: budgets.daily_tokens")),
        "{errors:?}"
    );
    for key in keys.iter().filter(|key| key.name.ends_with("listen")) {
        let addr = key.after.trim_matches('"');
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "{} is bound before a restart",
            key.name
        );
    }

    // TLS on the webhook listener is taken by the next connection.
    let with_tls = after.replace(
        "\n[server]\n",
        &format!("\n[server]\ntls = {}\n", tls_of(&workspace)),
    );
    std::fs::write(workspace.config_path(), with_tls).expect("config");
    assert_eq!(
        reload_report(&socket),
        (vec!["server.tls".to_string()], vec![])
    );
    let https = Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg(format!("https://{}/healthz", workspace.addr()))
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&https.stdout), "200", "{https:?}");
}

#[test]
fn socket_activation_takes_the_named_socket_and_refuses_unknown_names() {
    let workspace = Workspace::new();
    workspace.write_config(ROUTE);
    // systemd-socket-activate binds the port itself.
    workspace.release_port();
    let address = format!("127.0.0.1:{}", workspace.port);
    let mut activator = Command::new("systemd-socket-activate")
        .args([
            "-l",
            &address,
            "--fdname=webhook",
            "-E",
            "AGENTGATE_LOG=info",
        ])
        .arg(BIN)
        .args(["serve", "--config"])
        .arg(workspace.config_path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("systemd-socket-activate (package systemd)");
    // The socket is bound by the activator before the daemon exists: the first POST starts it.
    wait_until("the activator to listen", Duration::from_secs(10), || {
        std::net::TcpStream::connect(&address).is_ok()
    });
    let response = try_request(
        workspace.addr(),
        "POST",
        "/hook",
        &[("content-type", "application/json")],
        b"{}",
    )
    .expect("first request");
    assert_eq!(response.status, 202, "{response:?}");
    let _ = activator.kill();
    let _ = activator.wait();

    let workspace = Workspace::new();
    workspace.write_config(ROUTE);
    workspace.release_port();
    let address = format!("127.0.0.1:{}", workspace.port);
    let mut wrong = Command::new("systemd-socket-activate")
        .args(["-l", &address, "--fdname=http"])
        .arg(BIN)
        .args(["serve", "--config"])
        .arg(workspace.config_path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("systemd-socket-activate");
    wait_until("the activator to listen", Duration::from_secs(10), || {
        std::net::TcpStream::connect(&address).is_ok()
    });
    let status = wrong.wait().expect("daemon exit");
    assert_eq!(status.code(), Some(78));
    let mut stderr = String::new();
    if let Some(mut pipe) = wrong.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    assert!(stderr.contains("unknown name \"http\""), "{stderr}");
}

/// Out of file descriptors, `accept` fails at once for as long as a connection waits in the
/// backlog. Both listeners back off and log a summary line at most once a second instead of
/// spinning (which wrote a million journal lines in five seconds).
#[test]
fn accept_failures_back_off_instead_of_spinning() {
    let workspace = Workspace::new();
    let socket = workspace.path().join("control.sock");
    let text = format!(
        "state_dir = {:?}\n[server]\nlisten = \"127.0.0.1:{}\"\ncontrol_socket = {:?}\n[model]\nbackend = \"replay\"\n{ROUTE}",
        workspace.state_dir().display(),
        workspace.port,
        socket.display()
    );
    std::fs::write(workspace.config_path(), text).expect("config");
    let daemon = workspace.start();
    let open_fds = std::fs::read_dir(format!("/proc/{}/fd", daemon.pid()))
        .expect("the daemon's fds")
        .count();
    let limit = open_fds + 2;
    // Only the soft limit is lowered, so that raising it again below needs no privilege.
    let hard = std::fs::read_to_string(format!("/proc/{}/limits", daemon.pid()))
        .expect("the daemon's limits")
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .and_then(|line| line.split_whitespace().nth(4).map(str::to_string))
        .expect("the hard limit on open files");
    let status = Command::new("prlimit")
        .arg(format!("--pid={}", daemon.pid()))
        .arg(format!("--nofile={limit}:{hard}"))
        .status()
        .expect("prlimit (util-linux)");
    assert!(status.success());

    // Use up the daemon's last descriptors (more connections than it can have left, whatever
    // it opened meanwhile), then leave one connection waiting on each listener.
    let mut held: Vec<std::net::TcpStream> = Vec::new();
    for _ in 0..64 {
        held.extend(std::net::TcpStream::connect(daemon.addr).ok());
    }
    let _waiting_control = UnixStream::connect(&socket).expect("queued in the control backlog");
    wait_until("an accept failure", Duration::from_secs(10), || {
        daemon.log().contains("accept failed")
    });
    let failures_at = |log: &str| log.matches("accept failed").count();
    let before = failures_at(&daemon.log());
    std::thread::sleep(Duration::from_secs(3));
    let during = failures_at(&daemon.log()) - before;
    assert!(
        during <= 10,
        "{during} accept-failure lines in 3 s: the listeners spin"
    );
    assert!(daemon.log().contains("backing off"), "{}", daemon.log());

    // Once descriptors are free again, the daemon serves as before.
    drop(held);
    let raised = Command::new("prlimit")
        .arg(format!("--pid={}", daemon.pid()))
        .arg(format!("--nofile={hard}:{hard}"))
        .status()
        .expect("prlimit");
    assert!(raised.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = try_request(daemon.addr, "GET", "/healthz", &[], b"");
        if answer.as_ref().is_ok_and(|r| r.status == 200) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the webhook listener did not recover ({answer:?}); the daemon said:\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A reader that stops early (`agentgate sessions list | head`) ends the command quietly.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let workspace = Workspace::new();
    workspace.write_config(&format!("[model]\nbackend = \"replay\"\n{ROUTE}"));
    let daemon = workspace.start();
    post_many(daemon.addr, "/hook", 1000, |n| format!(r#"{{"n":{n}}}"#));
    for args in [
        &["sessions", "list"][..],
        &["sessions", "list", "--json"][..],
    ] {
        let mut child = Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(workspace.config_path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut first = [0u8; 16];
        child
            .stdout
            .take()
            .expect("stdout")
            .read_exact(&mut first)
            .expect("the first bytes");
        // The pipe is closed now: the rest of the output has nowhere to go.
        let output = child.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(output.status.success(), "{args:?}: {output:?}");
    }
}

/// A reload runs every start-time check: with the webhook listener on a non-loopback address
/// (a private network namespace with 10.9.8.7 on its loopback device), a reload that adds an
/// unsigned route is refused (exit 78) and the route never answers.
#[test]
fn a_reload_cannot_add_an_unsigned_route_off_loopback() {
    if !root_or_skip("a_reload_cannot_add_an_unsigned_route_off_loopback") {
        return;
    }
    let workspace = Workspace::new();
    let config = workspace.config_path();
    let signed = format!(
        "state_dir = {:?}\n[server]\nlisten = \"10.9.8.7:8787\"\ncontrol_socket = {:?}\n[model]\nbackend = \"replay\"\n[routes.signed]\npath = \"/signed\"\nverify = {{ scheme = \"bearer\", secret = \"t0ken\" }}\n",
        workspace.state_dir().display(),
        workspace.path().join("control.sock").display()
    );
    std::fs::write(&config, &signed).expect("config");
    let unsigned =
        format!("{signed}[routes.open]\npath = \"/open\"\nverify = {{ scheme = \"none\" }}\n");
    let unsigned_file = workspace.path().join("unsigned.toml");
    std::fs::write(&unsigned_file, unsigned).expect("unsigned config");
    let script = format!(
        r#"set -u
ip link set lo up
ip addr add 10.9.8.7/32 dev lo
AGENTGATE_LOG=info {bin} serve --config {config} 2>{log} &
daemon=$!
for _ in $(seq 200); do
    {bin} send signed --config {config} --url http://10.9.8.7:8787 >/dev/null 2>&1 && break
    sleep 0.05
done
echo "signed: $({bin} send signed --config {config} --url http://10.9.8.7:8787 2>&1 | head -c 3)"
cp {unsigned} {config}
{bin} reload --config {config} >/dev/null 2>{reload_err}
echo "reload exit: $?"
echo "open: $({bin} send open --config {config} --url http://10.9.8.7:8787 2>&1 | head -c 3)"
kill -TERM $daemon
wait $daemon
"#,
        bin = BIN,
        config = config.display(),
        unsigned = unsigned_file.display(),
        log = workspace.path().join("daemon.log").display(),
        reload_err = workspace.path().join("reload.err").display(),
    );
    let output = Command::new("unshare")
        .args(["-n", "sh", "-c", &script])
        .output()
        .expect("unshare -n");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let log = std::fs::read_to_string(workspace.path().join("daemon.log")).unwrap_or_default();
    let reload_err =
        std::fs::read_to_string(workspace.path().join("reload.err")).unwrap_or_default();
    assert!(stdout.contains("signed: 202"), "{stdout}\n{log}");
    assert!(
        stdout.contains("reload exit: 78"),
        "{stdout}\n{reload_err}\n{log}"
    );
    assert!(reload_err.contains("loopback"), "{reload_err}");
    assert!(stdout.contains("open: 404"), "{stdout}\n{log}");
}

/// `[server] metrics_listen` serves `GET /metrics` alone, for Prometheus; the packaged alert
/// rules pass `promtool check rules` and their unit tests, and every metric the rules and the
/// Grafana dashboard use is one the daemon exports.
#[test]
fn metrics_listen_serves_what_the_packaged_rules_and_dashboard_use() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/examples");
    for args in [
        vec!["check", "rules", "prometheus-rules.yml"],
        vec!["test", "rules", "prometheus-rules.test.yml"],
    ] {
        let checked = std::process::Command::new("promtool")
            .args(&args)
            .current_dir(&examples)
            .output()
            .expect("promtool (`tests/setup` installs prometheus)");
        assert!(checked.status.success(), "promtool {args:?}: {checked:?}");
    }

    // A turn that calls a tool and delivers its result, so that every family has a series.
    let workspace = Workspace::new();
    let model = common::stub::Stub::start(|request, _| {
        if request.json().to_string().contains("\"role\":\"tool\"") {
            common::stub::Reply::answer("done")
        } else {
            common::stub::Reply::tool_call("call_1", "noop", serde_json::json!({}))
        }
    });
    let metrics_port = workspace.metrics_addr().port();
    workspace.write_config(&format!(
        "metrics_listen = \"127.0.0.1:{metrics_port}\"\n\n{}\n[tools.noop]\ncommand = [\"/bin/true\"]\n\n{ROUTE}tools = [\"noop\"]\n",
        model.model_section()
    ));
    let daemon = workspace.start();
    let accepted = daemon.post_json("/hook", &[], "{}");
    assert_eq!(accepted.status, 202);
    let event_id = accepted.event_id();
    assert_eq!(
        workspace.wait_terminal(&event_id, Duration::from_secs(30)),
        "completed"
    );
    let metrics_addr = std::net::SocketAddr::from(([127, 0, 0, 1], metrics_port));
    let exposition = try_request(metrics_addr, "GET", "/metrics", &[], b"").expect("metrics");
    assert_eq!(exposition.status, 200);
    // Only the metrics: the operator endpoints stay on the control socket.
    let status = try_request(metrics_addr, "GET", "/v1/status", &[], b"").expect("status");
    assert_eq!(status.status, 404);
    let reload = try_request(metrics_addr, "POST", "/v1/reload", &[], b"").expect("reload");
    assert_eq!(reload.status, 404);

    let exported: std::collections::BTreeSet<String> = exposition
        .body
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let used = |text: &str| -> std::collections::BTreeSet<String> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|word| word.starts_with("agentgate_"))
            .map(|word| {
                ["_bucket", "_count", "_sum"]
                    .iter()
                    .find_map(|suffix| word.strip_suffix(suffix))
                    .unwrap_or(word)
                    .to_string()
            })
            .collect()
    };
    let rules = std::fs::read_to_string(examples.join("prometheus-rules.yml")).expect("rules");
    let dashboard =
        std::fs::read_to_string(examples.join("grafana-dashboard.json")).expect("dashboard");
    let dashboard_json: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert!(
        dashboard_json["panels"]
            .as_array()
            .is_some_and(|p| p.len() >= 10)
    );
    let mut referenced = used(&rules);
    referenced.extend(used(&dashboard));
    assert!(referenced.len() >= 10, "{referenced:?}");
    for metric in &referenced {
        assert!(
            exported.contains(metric),
            "{metric} is used by the rules or the dashboard but not exported: {exported:?}"
        );
    }
}

/// `generate manpages` writes agentgate(8) and agentgate.toml(5) from the reference, and man
/// renders both without a warning.
#[test]
fn the_man_pages_render_cleanly_and_carry_the_reference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let generated = std::process::Command::new(BIN)
        .args(["generate", "manpages"])
        .arg(dir.path())
        .output()
        .expect("generate");
    assert!(generated.status.success(), "{generated:?}");
    assert!(!dir.path().join("agentgate.1").exists());
    for (page, expected) in [
        (
            "agentgate.8",
            &[
                "SYNOPSIS",
                "COMMANDS",
                "EXIT STATUS",
                "ENVIRONMENT",
                "SIGNALS",
                "FILES",
                "sessions cancel",
                "LISTEN_FDNAMES",
                // A `|` in a table cell's code ends the cell unless escaped.
                "error|warning",
            ][..],
        ),
        (
            "agentgate.toml.5",
            &["max_queued_events", "trusted_proxies", "not_idempotent"][..],
        ),
    ] {
        let rendered = std::process::Command::new("man")
            .args(["--warnings", "-l"])
            .arg(dir.path().join(page))
            .env("MANWIDTH", "100")
            .env("LC_ALL", "C.UTF-8")
            .output()
            .expect("man");
        assert!(rendered.status.success(), "{page}: {rendered:?}");
        assert!(
            rendered.stderr.is_empty(),
            "{page}: {}",
            String::from_utf8_lossy(&rendered.stderr)
        );
        let text = String::from_utf8_lossy(&rendered.stdout).replace('\u{2010}', "-");
        for word in expected {
            assert!(text.contains(word), "{page} lacks {word:?}");
        }
    }
}

/// A user who may use the control socket (mode 0660, the daemon's group) but cannot read the
/// state directory still runs `sessions list`, `sessions show`, `events list`, `events show`,
/// `status`, `deliveries list`, `ledger show`, `events replay` and `deliveries retry`: they go
/// through the daemon.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one user's commands, each checked in turn against the same daemon"
)]
fn sessions_go_through_the_control_socket_for_users_who_cannot_read_the_state() {
    use std::os::unix::fs::PermissionsExt;
    if !root_or_skip("sessions_go_through_the_control_socket_for_users_who_cannot_read_the_state") {
        return;
    }
    let workspace = Workspace::new();
    std::fs::set_permissions(workspace.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    workspace.write_config(&format!(
        "[model]\nbackend = \"replay\"\n{ROUTE}session = \"{{{{ payload.s }}}}\"\n"
    ));
    let daemon = workspace.start();
    let accepted = daemon.post_json("/hook", &[], r#"{"s":"acme/web#7"}"#);
    let event_id = accepted.event_id();
    assert_eq!(
        workspace.wait_terminal(&event_id, Duration::from_secs(30)),
        "completed"
    );
    // As the package lays it out: the directory is the group's to list (0750), the database
    // the service's alone (0600).
    std::fs::set_permissions(
        workspace.state_dir(),
        std::fs::Permissions::from_mode(0o750),
    )
    .expect("chmod");
    std::fs::set_permissions(
        workspace.state_dir().join("agentgate.db"),
        std::fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");
    // uid nobody, in the socket's group (root's, in this test).
    let as_group_member = |args: &[&str]| {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=0", "--clear-groups", BIN])
            .args(args)
            .arg("--config")
            .arg(workspace.config_path())
            .env_remove("AGENTGATE_CONFIG")
            .output()
            .expect("setpriv")
    };
    let denied = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=0", "--clear-groups", "cat"])
        .arg(workspace.state_dir().join("agentgate.db"))
        .output()
        .expect("setpriv cat");
    assert!(
        !denied.status.success(),
        "the database is readable: {denied:?}"
    );
    let listed = as_group_member(&["sessions", "list", "--json"]);
    assert!(listed.status.success(), "{listed:?}");
    assert!(String::from_utf8_lossy(&listed.stdout).contains("acme/web#7"));
    let shown = as_group_member(&["sessions", "show", "acme/web#7"]);
    assert!(shown.status.success(), "{shown:?}");
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains("session acme/web#7"),
        "{shown:?}"
    );
    let status = as_group_member(&["status", "--json"]);
    assert!(status.status.success(), "{status:?}");
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert_eq!(status["daemon"]["running"], true);
    assert_eq!(status["events"]["total"], 1);
    let missing = as_group_member(&["sessions", "show", "nope"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no session \"nope\""));
    let events = as_group_member(&["events", "list", "--status", "completed", "--json"]);
    assert!(events.status.success(), "{events:?}");
    assert!(
        String::from_utf8_lossy(&events.stdout).contains(&event_id),
        "{events:?}"
    );
    let event = as_group_member(&["events", "show", &event_id]);
    assert!(event.status.success(), "{event:?}");
    assert!(
        String::from_utf8_lossy(&event.stdout).contains("status completed"),
        "{event:?}"
    );
    let unknown = as_group_member(&["events", "show", "nope"]);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no event \"nope\""));
    // The outbox, the ledger, a replay and a retry go through the daemon too (exit 73 before).
    let deliveries = as_group_member(&["deliveries", "list", "--json"]);
    assert!(deliveries.status.success(), "{deliveries:?}");
    assert!(
        String::from_utf8_lossy(&deliveries.stdout).contains(&event_id),
        "{deliveries:?}"
    );
    let ledger = as_group_member(&["ledger", "show", "--json"]);
    assert!(ledger.status.success(), "{ledger:?}");
    assert!(
        String::from_utf8_lossy(&ledger.stdout).contains("\"version\""),
        "{ledger:?}"
    );
    let replayed = as_group_member(&["events", "replay", &event_id]);
    assert!(replayed.status.success(), "{replayed:?}");
    let copy = String::from_utf8_lossy(&replayed.stdout).trim().to_string();
    assert_eq!(
        workspace.wait_terminal(&copy, Duration::from_secs(30)),
        "completed"
    );
    let bulk = as_group_member(&["events", "replay", "--status", "completed", "--limit", "1"]);
    assert!(bulk.status.success(), "{bulk:?}");
    assert!(
        String::from_utf8_lossy(&bulk.stderr)
            .contains("replayed 1 completed event(s); more matched"),
        "{bulk:?}"
    );
    workspace.fail_delivery(&event_id);
    let retried = as_group_member(&["deliveries", "retry", &event_id]);
    assert!(retried.status.success(), "{retried:?}");
    let pending = as_group_member(&["deliveries", "retry", "--pending"]);
    assert!(pending.status.success(), "{pending:?}");
    let none = as_group_member(&["deliveries", "retry", &copy]);
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no failed delivery"),
        "{none:?}"
    );
    wait_until("the retried delivery", Duration::from_secs(30), || {
        workspace.cli_json(&["events", "show", &event_id, "--json"])["delivery"]["status"]
            == "delivered"
    });
}

/// check-config with the console token in a credential: where it cannot read the credential (no
/// `$CREDENTIALS_DIRECTORY`, or no such file), it says so and never calls the token short; a
/// short token it reads is warned about, a long one is not.
#[test]
fn check_config_tells_a_console_token_it_cannot_read_from_a_short_one() {
    let workspace = Workspace::new();
    workspace.write_config(
        "[console]\nlisten = \"127.0.0.1:8788\"\ntoken = { credential = \"console-token\" }\n",
    );
    let credentials = workspace.path().join("credentials");
    std::fs::create_dir(&credentials).expect("credentials");
    let check = |credentials_dir: Option<&std::path::Path>| {
        let mut command = std::process::Command::new(BIN);
        command
            .args(["check-config", "--config"])
            .arg(workspace.config_path())
            .env_remove("CREDENTIALS_DIRECTORY");
        if let Some(dir) = credentials_dir {
            command.env("CREDENTIALS_DIRECTORY", dir);
        }
        let output = command.output().expect("check-config");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.code(), said)
    };
    let (code, said) = check(None);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("console.token: cannot be read here"),
        "{said}"
    );
    assert!(!said.contains("shorter"), "{said}");
    let (code, said) = check(Some(&credentials));
    assert_eq!(code, Some(78), "{said}");
    assert!(said.contains("credential \"console-token\""), "{said}");
    assert!(!said.contains("shorter"), "{said}");
    std::fs::write(credentials.join("console-token"), "short\n").expect("token");
    let (code, said) = check(Some(&credentials));
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("shorter than 16 bytes"), "{said}");
    std::fs::write(
        credentials.join("console-token"),
        "0f3c9a5e1d7b2c8a4e6f0b3d9c1a7e5f\n",
    )
    .expect("token");
    let (code, said) = check(Some(&credentials));
    assert_eq!(code, Some(0), "{said}");
    assert!(!said.contains("console.token"), "{said}");
}

/// `status` of a daemon killed while a turn ran: not running, and the turn's event and session
/// shown as interrupted (they resume at the next start), never as running.
#[test]
fn status_of_a_stopped_daemon_shows_its_turns_as_interrupted() {
    let workspace = Workspace::new();
    let model = slow_tool_model();
    write_slow_turn_config(&workspace, &model, "");
    let daemon = workspace.start();
    let accepted = daemon.post_json("/hook", &[], r#"{"n":1}"#);
    assert_eq!(accepted.status, 202, "{accepted:?}");
    wait_for_tool_starts(&workspace, 1);
    let running = workspace.cli(&["status"]);
    let said = String::from_utf8_lossy(&running.stdout);
    assert!(said.contains("running 1"), "{said}");
    daemon.kill9();
    let stopped = workspace.cli(&["status"]);
    let said = String::from_utf8_lossy(&stopped.stdout);
    assert!(stopped.status.success(), "{stopped:?}");
    assert!(said.contains("daemon:     not running"), "{said}");
    assert!(!said.contains("running 1"), "{said}");
    assert!(said.contains("interrupted 1"), "{said}");
}

/// A model endpoint that is down while turns keep retrying it: the journal gets one "model
/// request failed; retrying" line for it per 10 s, saying how many it left out, as a delivery
/// target's failures do, not a line per attempt (151 in a one-minute outage).
#[test]
fn a_model_outage_is_logged_within_a_budget() {
    let workspace = Workspace::new();
    let model = Stub::start(|_, _| Reply::raw(503, "{}").with_header("retry-after", "0"));
    workspace.write_config(&format!(
        "{}\n{ROUTE}",
        model
            .model_section()
            .replace("max_retries = 0", "max_retries = 5")
    ));
    let daemon = workspace.start();
    for n in 0..4 {
        let accepted = daemon.post_json("/hook", &[], &format!(r#"{{"n":{n}}}"#));
        assert_eq!(accepted.status, 202, "{accepted:?}");
    }
    wait_until(
        "the turns to retry the model",
        Duration::from_secs(30),
        || model.requests().len() >= 20,
    );
    let lines = daemon
        .log()
        .matches("model request failed; retrying")
        .count();
    assert_eq!(lines, 1, "{}", daemon.log());
}

/// Every `agentgate` command README, README.Debian and docs/ show (in code blocks, and in inline
/// code that names a command) is one the command line takes as written: each is run with
/// `--help` appended, which checks its subcommand, flags and values and runs nothing. Placeholders
/// (`ID`, `KEY`, `ROUTE`, …) stand for an example value; synopses (`[--json]`, `a|b`) are skipped.
/// The commands that change or read a running system are run for real under systemd
/// (tests/systemd.rs, the operations guide; tests/package.rs, README.Debian).
#[test]
fn every_agentgate_command_in_the_docs_is_one_the_command_line_takes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut documents = vec![root.join("README.md"), root.join("packaging/README.Debian")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs")
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    documents.extend(docs);
    let help = Command::new(BIN).arg("--help").output().expect("help");
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let known = |command: &str| {
        command
            .split_whitespace()
            .nth(1)
            .is_some_and(|sub| help.contains(&format!("\n  {sub} ")))
    };
    let bin_dir = std::path::Path::new(BIN).parent().expect("bin dir");
    let path = format!("{}:/usr/bin:/bin", bin_dir.display());
    let mut checked = 0;
    for document in &documents {
        let text = std::fs::read_to_string(document).expect("document");
        for (command, in_code_block) in documented_commands(&text) {
            // Inline code that is prose ("agentgate cannot accept events now") names no command.
            if !in_code_block && !known(&command) {
                continue;
            }
            let example = example_values(&command);
            if ["[", "|", "…", "<"]
                .iter()
                .any(|synopsis| example.contains(synopsis))
                || command.split_whitespace().nth(1) == Some("tool-exec")
            {
                continue;
            }
            let output = Command::new("sh")
                .args(["-c", &format!("{example} --help")])
                .env("PATH", &path)
                .output()
                .expect("sh");
            assert!(
                output.status.success(),
                "{}: `{command}` is not a command agentgate takes: {}",
                document.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "only {checked} commands found");
}

/// `agentgate …` lines of fenced code blocks (and of README.Debian's indented ones), without a
/// prompt, `sudo` or a trailing comment; `cargo run -- ARGS` as `agentgate ARGS`; then inline
/// code spans. Each with whether it was in a code block.
fn documented_commands(text: &str) -> Vec<(String, bool)> {
    let mut commands = Vec::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        let indented = line.starts_with("    ");
        if !(in_fence || indented) {
            continue;
        }
        let mut command = line
            .trim()
            .trim_start_matches("$ ")
            .trim_start_matches("sudo ");
        if let Some(comment) = command.find(" #") {
            command = command[..comment].trim_end();
        }
        let command = match command.strip_prefix("cargo run --release -- ") {
            Some(args) => format!("agentgate {args}"),
            None => command.to_string(),
        };
        if command.starts_with("agentgate ") {
            commands.push((command, true));
        }
    }
    for (index, span) in text.split('`').enumerate() {
        if index % 2 == 1 && span.starts_with("agentgate ") && !span.contains('\n') {
            commands.push((span.to_string(), false));
        }
    }
    commands
}

/// `command` with its placeholders replaced by example values.
fn example_values(command: &str) -> String {
    command
        .split(' ')
        .map(|word| match word {
            "ID" | "0193b5c2-…" => "01a24217-903d-76c0-a447-7ae6df3ba1e8",
            "KEY" => "'acme/web#7'",
            "ROUTE" | "R" => "demo",
            "NAME" => "nightly",
            "FILE" => "agentgate.toml",
            "PATH" => "/var/backups/agentgate-example",
            "DURATION" => "1h",
            "N" => "5",
            "S" => "failed",
            "TEXT" => "checked",
            "'{...}'" => "'{}'",
            other => other,
        })
        .collect::<Vec<_>>()
        .join(" ")
}
