//! The recipes in docs/senders.md, driven by the senders' own payloads: every packaged example
//! takes its sender's events into the session its comments promise, a real Alertmanager pair's
//! notifications each reach a turn, and Slack is answered the way Slack asks.

mod common;

use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use common::*;

/// Every config in `packaging/examples/` passes check-config, and takes its sender's payload as
/// that sender sends it (signed by `agentgate send` the way the route verifies), with the
/// session key its comments promise.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one table of packaged examples with the payload each sender sends"
)]
fn every_packaged_example_takes_its_senders_payload() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/examples");
    let cases: &[(&str, &str, serde_json::Value, Option<&str>)] = &[
        (
            "alertmanager",
            "alertmanager",
            serde_json::json!({"version": "4", "groupKey": "{}:{alertname=\"DiskFull\", instance=\"db-1\"}",
                "status": "firing", "receiver": "agentgate",
                "groupLabels": {"alertname": "DiskFull", "instance": "db-1"},
                "commonLabels": {"alertname": "DiskFull", "instance": "db-1", "severity": "page"},
                "commonAnnotations": {"summary": "disk full"}, "externalURL": "http://am:9093",
                "truncatedAlerts": 0,
                "alerts": [{"status": "firing", "labels": {"alertname": "DiskFull", "instance": "db-1"},
                    "annotations": {"summary": "disk full"}, "startsAt": "2026-12-01T05:00:00Z",
                    "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": "0f1e"}]}),
            Some("alertmanager:DiskFull:db-1"),
        ),
        (
            "github",
            "github",
            serde_json::json!({"action": "opened", "repository": {"full_name": "acme/web"},
                "issue": {"number": 7, "title": "crash"}}),
            Some("acme/web#7"),
        ),
        (
            "gitlab",
            "gitlab",
            serde_json::json!({"object_kind": "issue", "project": {"path_with_namespace": "acme/web"},
                "object_attributes": {"iid": 7, "title": "crash"}}),
            Some("acme/web#7"),
        ),
        (
            "grafana",
            "grafana",
            serde_json::json!({"receiver": "agentgate", "status": "firing", "groupKey": "{}:{alertname=\"HighCPU\"}",
                "groupLabels": {"alertname": "HighCPU"}, "title": "[FIRING:1] HighCPU",
                "alerts": [{"status": "firing", "labels": {"alertname": "HighCPU"},
                    "startsAt": "2026-12-01T05:00:00Z"}]}),
            Some("grafana:HighCPU"),
        ),
        (
            "slack",
            "slack",
            serde_json::json!({"type": "event_callback", "team_id": "T1", "event_id": "Ev1",
                "event": {"type": "app_mention", "channel": "C1", "ts": "1700000000.000100", "text": "<@U1> help"}}),
            Some("slack:C1:1700000000.000100"),
        ),
        (
            "standard-webhooks",
            "events",
            serde_json::json!({"type": "user.created", "data": {"id": "u1"}}),
            None,
        ),
        (
            "stripe",
            "stripe",
            serde_json::json!({"id": "evt_1", "object": "event", "type": "invoice.payment_failed",
                "data": {"object": {"id": "in_1", "customer": "cus_9"}}}),
            Some("stripe:cus_9"),
        ),
    ];
    let listed = std::fs::read_dir(&examples)
        .expect("examples")
        .filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "toml"))
        })
        .count();
    assert_eq!(listed, cases.len(), "an example without a case here");
    // The Alertmanager side is valid Alertmanager configuration.
    let checked = std::process::Command::new("amtool")
        .arg("check-config")
        .arg(examples.join("alertmanager.yml"))
        .output()
        .expect("amtool (`tests/setup` installs prometheus-alertmanager)");
    assert!(checked.status.success(), "{checked:?}");
    for (example, route, payload, session) in cases {
        let workspace = Workspace::new();
        let credentials = workspace.path().join("credentials");
        std::fs::create_dir(&credentials).expect("credentials");
        for name in [
            "alertmanager-token",
            "github-secret",
            "gitlab-token",
            "grafana-token",
            "slack-signing-secret",
            "stripe-secret",
        ] {
            std::fs::write(credentials.join(name), format!("{name}-value\n")).expect("secret");
        }
        for name in ["standard-secret", "results-secret"] {
            std::fs::write(
                credentials.join(name),
                "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD\n",
            )
            .expect("secret");
        }
        let text =
            std::fs::read_to_string(examples.join(format!("{example}.toml"))).expect("example");
        workspace.write_config(&format!("[model]\nbackend = \"replay\"\n\n{text}"));
        let credentials_env = credentials.display().to_string();
        let env = [("CREDENTIALS_DIRECTORY", credentials_env.as_str())];
        let check = std::process::Command::new(BIN)
            .args(["check-config", "--config"])
            .arg(workspace.config_path())
            .envs(env)
            .output()
            .expect("check-config");
        assert!(check.status.success(), "{example}: {check:?}");
        let daemon = workspace.start_with_env(&env);
        let sent = std::process::Command::new(BIN)
            .args(["send", route, "--config"])
            .arg(workspace.config_path())
            .args([
                "--url",
                &format!("http://{}", daemon.addr),
                "--data",
                &payload.to_string(),
            ])
            .envs(env)
            .output()
            .expect("send");
        let answer = String::from_utf8_lossy(&sent.stdout).to_string();
        assert!(
            sent.status.success() && answer.contains("202"),
            "{example}: {sent:?}"
        );
        if let Some(session) = session {
            assert!(
                answer.contains(&format!("\"session\":\"{session}\"")),
                "{example}: {answer}"
            );
        }
    }
}

/// Debian's Alertmanager, configured from `packaging/examples/alertmanager.yml`, as an HA pair
/// whose peers do not reach each other, so both send every notification (as a pair does when its
/// gossip lags or is cut): an alert fires, a second joins the group with an older start, the
/// first resolves, the second too, the first fires again and resolves again. Each of those six
/// notifications is one event of the group's session whose turn runs; each copy from the other
/// peer is a duplicate. Without `startsAt` in the key, the second firing was a duplicate of the
/// first.
#[test]
fn a_real_alertmanager_pair_notifies_each_change_once() {
    let workspace = Workspace::new();
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/examples");
    let credentials = workspace.path().join("credentials");
    std::fs::create_dir(&credentials).expect("credentials");
    std::fs::write(credentials.join("alertmanager-token"), "am-token\n").expect("token");
    let route = std::fs::read_to_string(examples.join("alertmanager.toml")).expect("example");
    workspace.write_config(&format!("[model]\nbackend = \"replay\"\n\n{route}"));
    let credentials_env = credentials.display().to_string();
    let daemon = workspace.start_with_env(&[("CREDENTIALS_DIRECTORY", credentials_env.as_str())]);
    let am_config = std::fs::read_to_string(examples.join("alertmanager.yml"))
        .expect("alertmanager.yml")
        .replace("http://127.0.0.1:8787", &format!("http://{}", daemon.addr))
        .replace(
            "/etc/prometheus/agentgate-token",
            &credentials.join("alertmanager-token").display().to_string(),
        )
        .replace("group_wait: 30s", "group_wait: 200ms")
        .replace("group_interval: 5m", "group_interval: 500ms");
    std::fs::write(workspace.path().join("alertmanager.yml"), am_config).expect("am config");
    let peers = [free_port(), free_port()];
    let _alertmanagers = peers.map(|port| start_alertmanager(&workspace, port));

    let events = || -> Vec<(String, String)> {
        workspace.query(
            "SELECT id, session_key FROM events WHERE route = 'alertmanager' ORDER BY seq",
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
    };
    let duplicates = || {
        metric(
            &workspace,
            "agentgate_http_requests_total{route=\"alertmanager\",code=\"200\"}",
        )
    };
    let root = |start: &str, end: Option<&str>| alert_flags("/", start, end);
    let var = |start: &str, end: Option<&str>| alert_flags("/var", start, end);
    let (first_start, var_start) = (rfc3339_ago(60), rfc3339_ago(3600));
    let mut again_start = String::new();
    for step in 1..=6 {
        let now = rfc3339_ago(0);
        let flags = match step {
            1 => root(&first_start, None),
            2 => var(&var_start, None),
            3 => root(&first_start, Some(&now)),
            4 => var(&var_start, Some(&now)),
            5 => {
                // After the resolution: a new firing starts a second later than it ended.
                std::thread::sleep(Duration::from_millis(1100));
                again_start = rfc3339_ago(0);
                root(&again_start, None)
            }
            _ => root(&again_start, Some(&now)),
        };
        for port in peers {
            amtool(port, &flags);
        }
        wait_until(
            &format!("step {step}'s notification from both peers"),
            Duration::from_secs(30),
            || events().len() >= step && duplicates() >= step as u64,
        );
        assert_eq!(events().len(), step, "one event per change");
    }
    let events = events();
    for (id, session) in &events {
        assert_eq!(session, "alertmanager:DiskFull:db-1");
        assert_eq!(
            workspace.wait_terminal(id, Duration::from_secs(30)),
            "completed"
        );
    }
    let statuses = |id: &str| -> Vec<String> {
        let stored: Vec<Vec<u8>> = workspace.query(
            &format!("SELECT payload FROM events WHERE id = '{id}'"),
            |row| row.get(0),
        );
        let payload: serde_json::Value = serde_json::from_slice(&stored[0]).expect("payload");
        payload["alerts"]
            .as_array()
            .map(|alerts| {
                alerts
                    .iter()
                    .map(|a| format!("{}={}", a["labels"]["mount"], a["status"]))
                    .collect()
            })
            .unwrap_or_default()
    };
    // The partial resolution, and the second firing of "/" (alone in its group again).
    assert_eq!(
        statuses(&events[2].0),
        ["\"/\"=\"resolved\"", "\"/var\"=\"firing\""]
    );
    assert_eq!(statuses(&events[4].0), ["\"/\"=\"firing\""]);
    assert_eq!(
        duplicates(),
        6,
        "each copy of the other peer, and nothing else"
    );
}

/// A `prometheus-alertmanager` on `port` with the workspace's `alertmanager.yml`, clustered
/// with nobody.
fn start_alertmanager(workspace: &Workspace, port: u16) -> KillOnDrop {
    let alertmanager = KillOnDrop(
        std::process::Command::new("prometheus-alertmanager")
            .arg(format!(
                "--config.file={}",
                workspace.path().join("alertmanager.yml").display()
            ))
            .arg(format!(
                "--storage.path={}",
                workspace.path().join(format!("am-data-{port}")).display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--cluster.listen-address=")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start prometheus-alertmanager (`tests/setup` installs it)"),
    );
    wait_until("Alertmanager to listen", Duration::from_secs(30), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    alertmanager
}

/// `amtool alert add` arguments for the DiskFull alert of `mount` on db-1, firing since `start`,
/// resolved at `end`.
fn alert_flags(mount: &str, start: &str, end: Option<&str>) -> Vec<String> {
    let mut flags = vec![
        "alertname=DiskFull".to_string(),
        "instance=db-1".to_string(),
        format!("mount={mount}"),
        "severity=page".to_string(),
        format!("--start={start}"),
    ];
    flags.extend(end.map(|end| format!("--end={end}")));
    flags
}

/// The value of the sample `name{labels}` in the daemon's metrics (0 when absent).
fn metric(workspace: &Workspace, sample: &str) -> u64 {
    workspace
        .metrics()
        .lines()
        .find_map(|line| line.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Runs `amtool alert add ARGS` against the Alertmanager on `port`.
fn amtool(port: u16, args: &[String]) {
    let added = std::process::Command::new("amtool")
        .args(["alert", "add"])
        .args(args)
        .arg(format!("--alertmanager.url=http://127.0.0.1:{port}"))
        .output()
        .expect("amtool");
    assert!(added.status.success(), "{added:?}");
}

/// The UTC time `seconds_ago` seconds ago, as RFC 3339 (what amtool's --start and --end take).
fn rfc3339_ago(seconds_ago: u64) -> String {
    let output = std::process::Command::new("date")
        .args(["-u", "-d", &format!("@{}", unix_now() - seconds_ago)])
        .arg("+%Y-%m-%dT%H:%M:%SZ")
        .output()
        .expect("date");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// A daemon with the packaged examples of `routes`, their credentials in a credentials
/// directory (each holds `<name>-value`), and the replay model.
fn start_examples(workspace: &Workspace, routes: &[&str]) -> Daemon {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/examples");
    let credentials = workspace.path().join("credentials");
    std::fs::create_dir(&credentials).expect("credentials");
    let mut config = String::from("[model]\nbackend = \"replay\"\n\n");
    for route in routes {
        config +=
            &std::fs::read_to_string(examples.join(format!("{route}.toml"))).expect("example");
        config += "\n";
    }
    for name in [
        "alertmanager-token",
        "gitlab-token",
        "grafana-token",
        "slack-signing-secret",
    ] {
        std::fs::write(credentials.join(name), format!("{name}-value\n")).expect("secret");
    }
    workspace.write_config(&config);
    let credentials = credentials.display().to_string();
    workspace.start_with_env(&[("CREDENTIALS_DIRECTORY", credentials.as_str())])
}

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/senders")
        .join(name);
    std::fs::read_to_string(path).expect("fixture")
}

fn gitlab_post(daemon: &Daemon, event: &str, body: &str) -> HttpResponse {
    let uuid = format!("{:x}", unix_nanos());
    daemon.post_json(
        "/hooks/gitlab",
        &[
            ("x-gitlab-token", "gitlab-token-value"),
            ("x-gitlab-event", event),
            ("x-gitlab-event-uuid", &uuid),
        ],
        body,
    )
}

fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos()
}

/// GitLab's documented hook payloads: a comment on an issue, a merge request, a commit or a
/// snippet joins the session of what it comments on (in GitLab's notation), confidential issues
/// and comments are taken, and a payload the session template cannot read (no project) is
/// still accepted, in its own session, with a warning and a count.
#[test]
fn gitlab_comments_join_what_they_comment_on() {
    let workspace = Workspace::new();
    let daemon = start_examples(&workspace, &["gitlab"]);
    let cases = [
        ("Issue Hook", "gitlab-issue.json", "gitlabhq/gitlab-test#23"),
        (
            "Confidential Issue Hook",
            "gitlab-confidential-issue.json",
            "gitlabhq/gitlab-test#24",
        ),
        (
            "Merge Request Hook",
            "gitlab-merge-request.json",
            "gitlabhq/gitlab-test!12",
        ),
        (
            "Note Hook",
            "gitlab-note-issue.json",
            "gitlabhq/gitlab-test#10",
        ),
        (
            "Confidential Note Hook",
            "gitlab-confidential-note-issue.json",
            "gitlabhq/gitlab-test#10",
        ),
        (
            "Note Hook",
            "gitlab-note-merge-request.json",
            "gitlabhq/gitlab-test!1",
        ),
        (
            "Note Hook",
            "gitlab-note-commit.json",
            "gitlabhq/gitlab-test@cfe32cf61b73",
        ),
        (
            "Note Hook",
            "gitlab-note-snippet.json",
            "gitlabhq/gitlab-test$53",
        ),
    ];
    for (event, file, session) in cases {
        let answer = gitlab_post(&daemon, event, &fixture(file));
        assert_eq!(answer.status, 202, "{file}: {answer:?}");
        assert_eq!(answer.json()["session"], session, "{file}");
    }
    let odd = gitlab_post(&daemon, "Note Hook", r#"{"object_kind":"note"}"#);
    assert_eq!(odd.status, 202, "{odd:?}");
    assert_eq!(
        odd.json()["session"],
        format!("gitlab:{}", odd.event_id()).as_str()
    );
    assert!(
        workspace
            .metrics()
            .contains(r#"agentgate_template_fallbacks_total{route="gitlab",template="session"} 1"#),
        "{}",
        workspace.metrics()
    );
    daemon.wait_for_log("template cannot be evaluated for this payload");
}

fn slack_signed(daemon: &Daemon, content_type: &str, body: &str) -> HttpResponse {
    let timestamp = unix_now().to_string();
    let signature = format!(
        "v0={}",
        hmac_sha256_hex(
            b"slack-signing-secret-value",
            format!("v0:{timestamp}:{body}").as_bytes()
        )
    );
    daemon.request(
        "POST",
        "/hooks/slack",
        &[
            ("content-type", content_type),
            ("x-slack-request-timestamp", &timestamp),
            ("x-slack-signature", &signature),
        ],
        body.as_bytes(),
    )
}

/// The newest stored event's session key and type.
fn newest_event(workspace: &Workspace) -> (String, String) {
    workspace
        .query(
            "SELECT session_key, event_type FROM events ORDER BY id DESC LIMIT 1",
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .into_iter()
        .next()
        .expect("an event")
}

/// Slack's interactivity and slash commands, as Slack sends them (forms) and as it wants them
/// answered: a button press (`block_actions`, `channel.id`) reaches the session of the thread
/// its message is in, answered 200 with an empty body; a slash command is answered 200 with an
/// ephemeral line for the user who typed it.
#[test]
fn slack_buttons_and_slash_commands_are_answered_as_slack_asks() {
    let workspace = Workspace::new();
    let daemon = start_examples(&workspace, &["slack"]);
    let form = "application/x-www-form-urlencoded";
    let actions = fixture("slack-block-actions.json");
    let body: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("payload", &actions)
        .finish();
    let pressed = slack_signed(&daemon, form, &body);
    assert_eq!(pressed.status, 200, "{pressed:?}");
    assert!(pressed.body.is_empty(), "{pressed:?}");
    assert_eq!(
        newest_event(&workspace),
        (
            "slack:CBR2V3XEX:1548261000.000100".to_string(),
            "block_actions".to_string()
        )
    );

    let command = "token=gIkuvaNzQIHg97ATvDxqgjtO&team_id=T0001&team_domain=example&channel_id=C2147483705&channel_name=test&user_id=U2147483697&user_name=Steve&command=%2Ftriage&text=db-1+is+slow&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2F1234%2F5678&trigger_id=13345224609.738474920.8088930838d88f008e0";
    let typed = slack_signed(&daemon, form, command);
    assert_eq!(typed.status, 200, "{typed:?}");
    let answer = typed.json();
    assert_eq!(answer["response_type"], "ephemeral", "{answer}");
    let (session, event_type) = newest_event(&workspace);
    assert_eq!(
        (session.as_str(), event_type.as_str()),
        ("slack:C2147483705:commands", "/triage")
    );
    let text = answer["text"].as_str().unwrap_or_default().to_string();
    let id: String = workspace
        .query("SELECT id FROM events ORDER BY id DESC LIMIT 1", |row| {
            row.get(0)
        })
        .into_iter()
        .next()
        .unwrap_or_default();
    assert!(text.contains(&id), "{text}");
    // Both were accepted and are counted as accepted, whatever their status code.
    assert!(
        workspace
            .metrics()
            .contains("agentgate_accept_duration_seconds_count 2"),
        "{}",
        workspace.metrics()
    );
}

/// An Alertmanager (or Grafana) alert `name` with `fingerprint`, `status` and `starts_at`.
fn alert(
    fingerprint: &str,
    status: &str,
    starts_at: &str,
    labels: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({"status": status, "labels": labels, "annotations": {"summary": "disk full"},
        "startsAt": starts_at,
        "endsAt": if status == "resolved" { "2026-12-01T06:00:00Z" } else { "0001-01-01T00:00:00Z" },
        "generatorURL": "http://prometheus:9090/graph", "fingerprint": fingerprint})
}

/// A notification of the group `group_labels` with `alerts`, as Alertmanager sends it.
fn notification(group_labels: serde_json::Value, alerts: &[serde_json::Value]) -> String {
    let firing = alerts.iter().any(|a| a["status"] == "firing");
    let key = group_labels
        .as_object()
        .map(|labels| {
            labels
                .iter()
                .map(|(name, value)| format!("{name}={value}"))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    serde_json::json!({"version": "4", "groupKey": format!("{{}}:{{{key}}}"),
        "truncatedAlerts": 0, "status": if firing { "firing" } else { "resolved" },
        "receiver": "agentgate", "groupLabels": group_labels, "commonLabels": group_labels,
        "commonAnnotations": {}, "externalURL": "http://alertmanager:9093", "alerts": alerts})
    .to_string()
}

/// Alert groups as they change: the same notification again (a repeat, the other member of an
/// HA pair) is a duplicate; an alert that joins with an older start, an alert that resolves
/// while another fires, and the resolution are each a new event of the group's one session.
/// An alert that fires again after it resolved, and its next resolution, are new too. A
/// `group_by` without `alertname` is a session of its own labels, not a refusal; Grafana's
/// notifications are one session and keyed the same way.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one alert group's life, step by step"
)]
fn alert_groups_that_gain_lose_and_resolve_alerts_are_each_new() {
    let workspace = Workspace::new();
    let daemon = start_examples(&workspace, &["alertmanager", "grafana"]);
    let post = |path: &str, token: &str, body: &str| {
        daemon.post_json(path, &[("authorization", &format!("Bearer {token}"))], body)
    };
    let am = |body: &str| post("/hooks/alertmanager", "alertmanager-token-value", body);
    let group = serde_json::json!({"alertname": "DiskFull", "instance": "db-1"});
    let labels = |mount: &str| serde_json::json!({"alertname": "DiskFull", "instance": "db-1", "mount": mount});
    let root = alert("aa01", "firing", "2026-12-01T05:00:00Z", labels("/"));
    let var_older = alert("bb02", "firing", "2026-12-01T04:00:00Z", labels("/var"));
    let steps = [
        (vec![root.clone()], 202),
        (vec![root.clone()], 200),
        (vec![root.clone(), var_older.clone()], 202),
        (
            vec![
                alert("aa01", "resolved", "2026-12-01T05:00:00Z", labels("/")),
                var_older.clone(),
            ],
            202,
        ),
        (
            vec![
                alert("aa01", "resolved", "2026-12-01T05:00:00Z", labels("/")),
                alert("bb02", "resolved", "2026-12-01T04:00:00Z", labels("/var")),
            ],
            202,
        ),
        // "/" fires again after it resolved (a new start), is repeated, and resolves again.
        (
            vec![alert("aa01", "firing", "2026-12-01T07:00:00Z", labels("/"))],
            202,
        ),
        (
            vec![alert("aa01", "firing", "2026-12-01T07:00:00Z", labels("/"))],
            200,
        ),
        (
            vec![alert(
                "aa01",
                "resolved",
                "2026-12-01T07:00:00Z",
                labels("/"),
            )],
            202,
        ),
    ];
    let mut accepted = Vec::new();
    for (step, (alerts, status)) in steps.iter().enumerate() {
        let answer = am(&notification(group.clone(), alerts));
        assert_eq!(answer.status, *status, "step {step}: {answer:?}");
        if *status == 202 {
            assert_eq!(
                answer.json()["session"],
                "alertmanager:DiskFull:db-1",
                "step {step}"
            );
            accepted.push(answer.event_id());
        }
    }
    assert_eq!(accepted.len(), 6);

    let by_cluster = am(&notification(
        serde_json::json!({"cluster": "eu-1"}),
        &[alert(
            "cc03",
            "firing",
            "2026-12-01T05:00:00Z",
            serde_json::json!({"alertname": "NodeDown", "cluster": "eu-1"}),
        )],
    ));
    assert_eq!(by_cluster.status, 202, "{by_cluster:?}");
    assert_eq!(by_cluster.json()["session"], "alertmanager:eu-1");

    // Grafana, in the shape of its webhook contact point: a repeat while the rule fires (new
    // values, same alert) and the copy of a second Grafana instance are duplicates; the
    // resolution, the rule firing again later and that resolution are each new.
    let firing: serde_json::Value =
        serde_json::from_str(&fixture("grafana-firing.json")).expect("fixture");
    let grafana = |status: &str, starts_at: &str, value: f64| {
        let mut body = firing.clone();
        let resolved = status == "resolved";
        body["status"] = status.into();
        body["state"] = if resolved { "ok" } else { "alerting" }.into();
        body["title"] = if resolved {
            "[RESOLVED] HighCPU Infra (web-1)".into()
        } else {
            body["title"].clone()
        };
        let alert = &mut body["alerts"][0];
        alert["status"] = status.into();
        alert["startsAt"] = starts_at.into();
        alert["values"]["A"] = value.into();
        if resolved {
            alert["endsAt"] = "2026-12-01T05:20:00Z".into();
        }
        post("/hooks/grafana", "grafana-token-value", &body.to_string())
    };
    let first = "2026-12-01T05:00:10.123456789Z";
    let later = "2026-12-01T09:30:10.5Z";
    let answers = [
        grafana("firing", first, 93.4),
        grafana("firing", first, 95.1),
        grafana("firing", first, 95.1),
        grafana("resolved", first, 41.0),
        grafana("firing", later, 97.0),
        grafana("resolved", later, 40.0),
    ];
    let statuses: Vec<u16> = answers.iter().map(|answer| answer.status).collect();
    assert_eq!(statuses, [202, 200, 200, 202, 202, 202], "{answers:?}");
    for answer in answers.iter().filter(|answer| answer.status == 202) {
        assert_eq!(answer.json()["session"], "grafana:HighCPU:Infra");
    }
}

/// `agentgate send --schedule NAME`, as `agentgate-schedule@NAME.service` runs it: the route and
/// payload from `schedules/NAME.toml` beside the config, the delivery id from the time the timer
/// elapsed, so one fire posted twice is a duplicate; by hand (no timer) each run is new. A name
/// that would leave the directory, or a file that names no route, is refused with its reason.
#[test]
fn a_schedule_posts_once_per_fire() {
    let workspace = Workspace::new();
    workspace.write_config(
        "[routes.reports]\npath = \"/hooks/reports\"\nverify = { scheme = \"none\" }\nsession = \"{{ payload.report }}\"\n",
    );
    let schedules = workspace.path().join("schedules");
    std::fs::create_dir(&schedules).expect("schedules");
    std::fs::write(
        schedules.join("nightly.toml"),
        "route = \"reports\"\npayload = { report = \"nightly\", window = \"24h\" }\n",
    )
    .expect("schedule");
    std::fs::write(schedules.join("broken.toml"), "payload = {}\n").expect("schedule");
    let _daemon = workspace.start();
    let fire = |name: &str, elapsed: Option<&str>| {
        let mut command = std::process::Command::new(BIN);
        command
            .args(["send", "--schedule", name, "--config"])
            .arg(workspace.config_path())
            .env_remove("TRIGGER_UNIT")
            .env_remove("TRIGGER_TIMER_REALTIME_USEC");
        // Started by its timer (which keeps no stamp on this machine): the time systemd passed.
        if let Some(micros) = elapsed {
            command
                .env("TRIGGER_UNIT", format!("agentgate-schedule@{name}.timer"))
                .env("TRIGGER_TIMER_REALTIME_USEC", micros);
        }
        command.output().expect("send --schedule")
    };
    let first = fire("nightly", Some("1796277600123456"));
    assert!(first.status.success(), "{first:?}");
    assert!(
        String::from_utf8_lossy(&first.stdout).starts_with("202"),
        "{first:?}"
    );
    let again = fire("nightly", Some("1796277600999999"));
    assert!(again.status.success(), "{again:?}");
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("\"duplicate\""),
        "{again:?}"
    );
    let by_hand = fire("nightly", None);
    assert!(
        String::from_utf8_lossy(&by_hand.stdout).starts_with("202"),
        "{by_hand:?}"
    );
    let ids: Vec<(String, String)> = workspace.query(
        "SELECT delivery_id, session_key FROM events ORDER BY seq",
        |row| Ok((row.get(0)?, row.get(1)?)),
    );
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[0].0, "schedule:nightly:2026-12-03T06:00:00Z");
    assert_eq!(ids[0].1, "nightly");
    assert!(ids[1].0.starts_with("schedule:nightly:"), "{ids:?}");

    let escaping = fire("../agentgate", None);
    assert_eq!(escaping.status.code(), Some(2), "{escaping:?}");
    let broken = fire("broken", None);
    assert_eq!(broken.status.code(), Some(78), "{broken:?}");
    assert!(
        String::from_utf8_lossy(&broken.stderr).contains("route"),
        "{broken:?}"
    );
    let missing = fire("weekly", None);
    assert_eq!(missing.status.code(), Some(78), "{missing:?}");
}

/// A Stripe retry is the same event signed again, with the time of its own attempt in
/// `Stripe-Signature` (`t=<unix seconds>,v1=<HMAC-SHA256 of "t.body">`): one whose event id is
/// a number, and one that has none, are each answered as a duplicate of the first delivery.
#[test]
fn a_stripe_retry_is_a_duplicate_whatever_its_event_id() {
    let workspace = Workspace::new();
    let secret = "whsec_retry_test";
    workspace.write_config(
        "[model]\nbackend = \"replay\"\n\n[routes.stripe]\npath = \"/hooks/stripe\"\n\
         verify = { scheme = \"stripe\", secret = { env = \"TEST_STRIPE_SECRET\" } }\n\
         deliver = { kind = \"log\" }\n",
    );
    let daemon = workspace.start_with_env(&[("TEST_STRIPE_SECRET", secret)]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let attempt = |body: &str, at: u64| {
        let signed = format!("{at}.{body}");
        let signature = format!(
            "t={at},v1={}",
            hmac_sha256_hex(secret.as_bytes(), signed.as_bytes())
        );
        daemon.post_json("/hooks/stripe", &[("stripe-signature", &signature)], body)
    };
    for body in [
        r#"{"id": 9001, "object": "event", "type": "invoice.payment_failed"}"#,
        r#"{"object": "event", "type": "charge.dispute.created", "created": 1767225600}"#,
    ] {
        let first = attempt(body, now - 120);
        assert_eq!(first.status, 202, "{first:?}");
        let retry = attempt(body, now);
        assert_eq!(retry.status, 200, "{body}: {retry:?}");
        assert_eq!(retry.json()["status"], "duplicate", "{retry:?}");
        assert_eq!(retry.json()["event_id"], first.json()["event_id"]);
    }
    assert_eq!(workspace.events_total(), 2);
}
