//! agentgate's units under a real systemd: PID 1 of a private namespace booted by the harness in
//! `tests/systemd/` (root; see `common::can_run`). Socket activation, restarts under load,
//! watchdog, drain past TimeoutStopSec, reload, crash restarts, journal fields and catalog.

mod common;

use std::time::{Duration, Instant};

use common::load::Load;
use common::machine::Machine;
use common::*;

fn config(extra: &str) -> String {
    format!(
        r#"[runtime]
drain_timeout = "5s"
{extra}

[routes.hook]
path = "/hook"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
"#
    )
}

fn wait_for(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    wait_until(what, limit, &mut condition);
}

#[test]
fn cold_start_by_socket_activation_with_journal_fields_and_catalog() {
    let Some(machine) = Machine::boot("cold_start") else {
        return;
    };
    machine.install(&config(""), "");
    assert_eq!(machine.show("agentgate.service", "ActiveState"), "inactive");
    let response = machine
        .post(r#"{"session":"acme/web#7"}"#)
        .expect("first POST");
    assert_eq!(response.status, 202, "{response:?}");
    // READY=1 reaches systemd by a datagram of its own: the 202 may come first.
    wait_for("the service to be active", Duration::from_secs(10), || {
        machine.show("agentgate.service", "ActiveState") == "active"
    });
    assert!(machine.reconcile_runs() >= 1);
    let lines = machine.journal("-u agentgate.service SESSION_KEY=acme/web#7");
    assert!(lines.contains("event accepted"), "{lines}");
    // The turn's lines and its result's delivery carry the session's fields too.
    wait_for(
        "the turn's lines under the session's key",
        Duration::from_secs(30),
        || {
            let lines = machine.journal("-u agentgate.service SESSION_KEY=acme/web#7");
            lines.contains("turn completed") && lines.contains("result delivered")
        },
    );
    assert!(
        !machine
            .journal("-u agentgate.service SESSION_KEY=other")
            .contains("event accepted")
    );
    let explained = machine.ok("journalctl --no-pager -x -u agentgate.service");
    assert!(
        explained.contains("was verified and committed to the state"),
        "{explained}"
    );
    // A refusal's reason is in its message, which is all `-o cat` shows.
    let refused = try_request(machine.addr(), "POST", "/nowhere", &[], b"{}").expect("POST");
    assert_eq!(refused.status, 404, "{refused:?}");
    wait_for("the refusal's line", Duration::from_secs(10), || {
        machine
            .journal("-u agentgate.service")
            .contains("webhook refused (404): no route")
    });
    // Its tools run in tool units: the service keeps every protection (SPEC: at most 2.0).
    let (score, security) = machine.security_score();
    assert!(score <= 2.0, "{security}");
    let pid = machine.show("agentgate.service", "MainPID");
    let environment = machine.ok(&format!("tr '\\0' '\\n' < /proc/{pid}/environ"));
    assert!(!environment.contains("LISTEN_FDS=") || environment.contains("LISTEN_FDNAMES"));
}

#[test]
fn ten_restarts_under_load_lose_no_request_and_no_event() {
    let Some(machine) = Machine::boot("restarts") else {
        return;
    };
    machine.install(&config(""), "");
    assert_eq!(
        machine
            .post(r#"{"session":"warmup"}"#)
            .expect("warm up")
            .status,
        202
    );
    let load = Load::start(machine.addr(), 4);
    let pids: Vec<String> = (0..10)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(300));
            machine.ok("systemctl restart agentgate.service");
            machine.show("agentgate.service", "MainPID")
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let result = load.finish();
    let failed = result.failures;
    assert!(
        failed.is_empty(),
        "{} failed requests: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    let mut distinct = pids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        10,
        "every restart gets a new process: {pids:?}"
    );
    let total = machine.status_json()["events"]["total"]
        .as_u64()
        .expect("total");
    assert_eq!(total, result.accepted + 1, "accepted events lost");
    let reconciles = machine.reconcile_runs();
    assert!(
        reconciles >= 11,
        "reconcile ran {reconciles} times for 11 starts"
    );
    eprintln!(
        "restarts: 10, accepted {}, worst request latency {:?}",
        result.accepted, result.worst
    );
}

#[test]
fn the_watchdog_restarts_a_frozen_daemon() {
    let Some(machine) = Machine::boot("watchdog") else {
        return;
    };
    machine.install(&config(""), "WatchdogSec=2");
    assert_eq!(
        machine.post(r#"{"session":"w"}"#).expect("POST").status,
        202
    );
    let frozen = machine.show("agentgate.service", "MainPID");
    machine.ok(&format!("kill -STOP {frozen}"));
    let started = Instant::now();
    wait_for(
        "a restart after the watchdog fired",
        Duration::from_secs(20),
        || {
            let pid = machine.show("agentgate.service", "MainPID");
            pid != frozen
                && pid != "0"
                && machine.show("agentgate.service", "ActiveState") == "active"
        },
    );
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2 + 8), "restart took {took:?}");
    assert!(
        machine
            .journal("-u agentgate.service")
            .contains("Watchdog timeout")
    );
    assert_eq!(
        machine.post(r#"{"session":"w2"}"#).expect("POST").status,
        202
    );
}

#[test]
fn a_drain_longer_than_timeout_stop_sec_is_not_killed() {
    let Some(machine) = Machine::boot("drain") else {
        return;
    };
    let model = "[model]\nbackend = \"command\"\ncommand = [\"/bin/sleep\", \"60\"]\nrequest_timeout = \"90s\"\n";
    let text = config("").replace("[routes.hook]", &format!("{model}\n[routes.hook]"));
    machine.install(&text, "TimeoutStopSec=2");
    assert_eq!(
        machine.post(r#"{"session":"long"}"#).expect("POST").status,
        202
    );
    wait_for("the turn to start", Duration::from_secs(10), || {
        machine
            .journal("-u agentgate.service")
            .contains("turn started")
    });
    let started = Instant::now();
    machine.ok("systemctl stop agentgate.service");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(4),
        "the drain was cut short after {took:?}"
    );
    assert_eq!(machine.show("agentgate.service", "Result"), "success");
    let sessions =
        machine.ok("agentgate sessions list --json --config /etc/agentgate/agentgate.toml");
    assert!(sessions.contains("resume_pending"), "{sessions}");
    assert!(
        machine
            .journal("-u agentgate.service")
            .contains("marked resume_pending")
    );
    // An override while the service is stopped changes the state itself: asking the daemon
    // through its socket-activated control socket would start the service.
    machine.ok("agentgate sessions suspend long --config /etc/agentgate/agentgate.toml");
    assert_eq!(machine.show("agentgate.service", "ActiveState"), "inactive");
    let sessions =
        machine.ok("agentgate sessions list --json --config /etc/agentgate/agentgate.toml");
    assert!(sessions.contains("\"suspended\""), "{sessions}");
}

#[test]
fn reload_with_a_broken_config_keeps_serving() {
    let Some(machine) = Machine::boot("reload") else {
        return;
    };
    machine.install(&config(""), "");
    assert_eq!(
        machine.post(r#"{"session":"r"}"#).expect("POST").status,
        202
    );
    // A good reload succeeds; a refused one makes `systemctl reload` fail, and the daemon keeps
    // serving on the previous config.
    machine.ok("systemctl reload agentgate.service");
    let refused = machine.sh(
        "printf '[routes.hook]\\npath = 5\\n' > /etc/agentgate/agentgate.toml && systemctl reload agentgate.service",
    );
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        machine
            .journal("-u agentgate.service")
            .contains("reload refused")
    );
    assert_eq!(
        machine.post(r#"{"session":"r2"}"#).expect("POST").status,
        202
    );
    assert_eq!(machine.show("agentgate.service", "ActiveState"), "active");
}

/// Many connections to a service that cannot start on its config: each is answered 503 with
/// `Retry-After`, never refused, and both sockets stay up.
fn assert_held(machine: &Machine, reason: &str) {
    for attempt in 0..60 {
        let answer = machine
            .post(&format!(r#"{{"session":"held-{attempt}"}}"#))
            .unwrap_or_else(|err| {
                let journal =
                    machine.journal("-u agentgate.service -u agentgate-reconcile.service");
                panic!("connection {attempt} refused or reset: {err}\n{journal}")
            });
        assert_eq!(answer.status, 503, "{answer:?}");
        assert_eq!(answer.header("retry-after"), Some("30"), "{answer:?}");
        assert!(
            !answer.body.contains(reason),
            "a sender is not told the config's details"
        );
    }
    for unit in [
        "agentgate.socket",
        "agentgate-control.socket",
        "agentgate.service",
    ] {
        assert_eq!(machine.show(unit, "ActiveState"), "active", "{unit}");
    }
    assert_eq!(machine.show("agentgate.service", "NRestarts"), "0");
    let status = machine.show("agentgate.service", "StatusText");
    assert!(status.contains(reason), "{status}");
    // The operator's side of the control socket says why.
    let control =
        machine.sh("curl -sS --unix-socket /run/agentgate/control.sock http://localhost/v1/status");
    let said = String::from_utf8_lossy(&control.stdout);
    assert!(said.contains(reason), "{control:?}");
    assert_not_serving(machine, reason);
}

/// `agentgate status` of a daemon that runs but answers 503 (held on a config error, or
/// waiting for the state): running, not serving, and why, in both lines and in the JSON.
fn assert_not_serving(machine: &Machine, reason: &str) {
    let status = machine.ok("agentgate status --config /etc/agentgate/agentgate.toml");
    assert!(
        status.contains("daemon:     running, NOT SERVING")
            && status.contains("accepting:  NO, webhooks get 503")
            && status.contains(reason)
            && !status.contains("not running"),
        "{status}"
    );
    let json = machine.status_json();
    assert_eq!(json["daemon"]["running"], true, "{json}");
    assert_eq!(json["accepting"]["ok"], false, "{json}");
    assert!(
        json["daemon"]["not_serving"]
            .as_str()
            .is_some_and(|why| why.contains(reason)),
        "{json}"
    );
}

/// A config error never takes the endpoint offline (docs/reference.md, "systemd"): whether only
/// the service can see it (a credential's content) or reconcile sees it too (a config that does
/// not parse), the service holds its sockets and answers 503 with the reason in its status,
/// however many connections arrive; after the fix, `systemctl restart` works at once.
#[test]
fn a_config_error_holds_the_sockets_and_a_restart_after_the_fix_serves() {
    let Some(machine) = Machine::boot("configerror") else {
        return;
    };
    machine.ok(
        "mkdir -p /etc/agentgate && printf 'not-a-whsec-secret' > /etc/agentgate/deliver.secret",
    );
    let route_deliver = "deliver = { kind = \"http\", url = \"http://127.0.0.1:9/\", secret = { credential = \"deliver\" } }";
    let good = format!("{}{route_deliver}\n", config(""));
    machine.install(
        &good,
        "LoadCredential=deliver:/etc/agentgate/deliver.secret",
    );
    assert_held(&machine, "routes.hook.deliver.secret");

    machine.ok("printf 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw' > /etc/agentgate/deliver.secret");
    // A held service has no config to reload: a reload fails and names the command that works.
    let reload = machine.sh("systemctl try-reload-or-restart agentgate.service");
    assert!(!reload.status.success(), "{reload:?}");
    assert!(
        machine
            .journal("-u agentgate.service")
            .contains("then run systemctl restart agentgate"),
        "the refused reload names the restart"
    );
    machine.ok("systemctl restart agentgate.service");
    assert_eq!(
        machine.post(r#"{"session":"fixed"}"#).expect("POST").status,
        202
    );

    // A config reconcile refuses too: the oneshot's 78 does not fail the start.
    machine.ok("printf '[routes.hook]\\npath = 5\\n' > /etc/agentgate/agentgate.toml");
    machine.ok("systemctl restart agentgate.service");
    assert_held(&machine, "agentgate.toml:2");
    assert_eq!(
        machine.show("agentgate-reconcile.service", "ExecMainStatus"),
        "78"
    );
    machine.ok(&format!(
        "cat > /etc/agentgate/agentgate.toml <<'EOF'\n{good}EOF"
    ));
    machine.ok("systemctl restart agentgate.service");
    assert_eq!(
        machine
            .post(r#"{"session":"fixed-again"}"#)
            .expect("POST")
            .status,
        202
    );
}

/// Crash restarts, on one booted namespace: a ledger planted before a crash is reconciled, then
/// a poison event under load costs no more restarts than documented.
#[test]
fn crash_restarts_reconcile_and_a_crash_loop_stays_within_its_bound() {
    let Some(machine) = Machine::boot("crash") else {
        return;
    };
    a_crash_restart_reconciles_a_ledger_planted_before_it(&machine);
    a_poison_event_under_load_kills_the_daemon_at_most_max_attempts_plus_two_times(&machine);
}

fn a_crash_restart_reconciles_a_ledger_planted_before_it(machine: &Machine) {
    machine.install(&config(""), "");
    assert_eq!(
        machine.post(r#"{"session":"c"}"#).expect("POST").status,
        202
    );
    let before = machine.reconcile_runs();
    let pid = machine.show("agentgate.service", "MainPID");
    machine.ok(&format!(
        "printf 'garbage' > /var/lib/agentgate/ledger.json && kill -9 {pid}"
    ));
    wait_for("the crash restart", Duration::from_secs(20), || {
        let now = machine.show("agentgate.service", "MainPID");
        now != pid && now != "0" && machine.show("agentgate.service", "ActiveState") == "active"
    });
    // journald may write the oneshot's last line a moment after the daemon it preceded is up.
    wait_for(
        "reconcile's line for the crash restart",
        Duration::from_secs(30),
        || machine.reconcile_runs() > before,
    );
    let quarantine = machine.ok("ls /var/lib/agentgate/quarantine");
    assert!(quarantine.contains("-ledger.json"), "{quarantine}");
    // The filter docs/operations.md gives finds the quarantine line.
    assert!(
        !machine
            .journal("-u 'agentgate*' MESSAGE_ID=7e28c6dc83aa474ea8de22650fa5aed3")
            .trim()
            .is_empty(),
        "no ledger quarantine line for the documented filter"
    );
    let ledger = machine.ok("cat /var/lib/agentgate/ledger.json");
    assert!(ledger.contains("\"version\": 1"), "{ledger}");
    assert_eq!(
        machine.post(r#"{"session":"c2"}"#).expect("POST").status,
        202
    );
}

/// A burst of events cannot push what matters out of the journal. journald drops a unit's lines
/// past its rate limit; at 2,000 events/s for 60 s, per-event lines stay within
/// `event_log_max_per_second` (the rest are counted in the periodic summary line instead), and a
/// warning right after the burst is in the journal.
#[test]
fn a_burst_of_events_does_not_push_warnings_out_of_the_journal() {
    let Some(machine) = Machine::boot("log_burst") else {
        return;
    };
    machine.install(
        &format!(
            "{}\n[routes.canary]\npath = \"/canary\"\nverify = {{ scheme = \"bearer\", secret = \"canary-secret\" }}\n",
            config("max_queued_events = 1000000")
        ),
        "",
    );
    assert_eq!(
        machine
            .post(r#"{"session":"warmup"}"#)
            .expect("warm up")
            .status,
        202
    );
    let load = Load::at_rate(machine.addr(), 24, 2_000);
    // The burst's length, not a synchronization: the load runs for this long.
    std::thread::sleep(Duration::from_secs(60));
    let result = load.finish();
    assert!(
        result.failures.is_empty(),
        "{} failed requests: {:?}",
        result.failures.len(),
        &result.failures[..result.failures.len().min(5)]
    );
    let refused = try_request(
        machine.addr(),
        "POST",
        "/canary",
        &[("content-type", "application/json")],
        b"{}",
    )
    .expect("POST /canary");
    assert_eq!(refused.status, 401, "{refused:?}");
    wait_for(
        "the warning in the journal",
        Duration::from_secs(30),
        || {
            machine
                .journal("-u agentgate.service ROUTE=canary -p warning")
                .contains("webhook refused")
        },
    );
    // The summary comes once a minute: the one that covers the burst may still be due.
    let summaries =
        || machine.journal("-u agentgate.service MESSAGE_ID=b9407274a51241d6a2033e70e2f89303");
    wait_for(
        "a summary line that counts the left-out lines",
        Duration::from_secs(90),
        || summaries().contains("per-event lines left out"),
    );
    assert!(summaries().contains("events accepted"), "{}", summaries());
    eprintln!(
        "log burst: {} events accepted in 60 s ({:.0}/s)",
        result.accepted,
        result.accepted as f64 / 60.0
    );
}

/// Installs a command model that hangs on an event asking to be held ("hold-me"), unless it is
/// the resumed run, and answers at once otherwise. Returns its `[model]` section.
/// Installs `script` in the machine as the command model `/usr/local/bin/NAME`, and returns the
/// `[model]` section that uses it.
fn install_model(machine: &Machine, name: &str, script: &str) -> String {
    std::fs::write(machine.share.path().join(name), script).expect("write the model");
    machine.ok(&format!(
        "install -m 0755 {}/{name} /usr/local/bin/{name}",
        machine.share.path().display()
    ));
    format!(
        "[model]\nbackend = \"command\"\ncommand = [\"/usr/local/bin/{name}\"]\nrequest_timeout = \"600s\"\n"
    )
}

/// Installs a command model that calls `tool` with `arguments` (JSON) once, then answers with
/// the call's result; returns its `[model]` section.
fn install_call_once_model(machine: &Machine, tool: &str, arguments: &str) -> String {
    let call = serde_json::json!({
        "id": "c1", "type": "function",
        "function": {"name": tool, "arguments": arguments},
    });
    install_model(
        machine,
        &format!("{tool}-model"),
        &format!(
            r#"#!/usr/bin/python3
import json, sys
messages = json.load(sys.stdin)["messages"]
if messages[-1].get("role") == "tool":
    print(json.dumps({{"role": "assistant", "content": "done: " + messages[-1]["content"]}}))
else:
    print(json.dumps({{"role": "assistant", "content": None, "tool_calls": [json.loads({call:?})]}}))
"#,
            call = call.to_string()
        ),
    )
}

/// A command model that kills the daemon (its parent) whenever its messages carry
/// `POISON-PILL`, and otherwise answers after 0.1 s, so that turns overlap under load.
const POISON_MODEL: &str = r#"#!/bin/sh
input=$(cat)
case "$input" in
*POISON-PILL*) kill -KILL "$PPID"; sleep 30 ;;
esac
sleep 0.1
printf '{"role": "assistant", "content": "done"}'
"#;

/// docs/reference.md, "Crash loops and bystanders": 300 events for 300 sessions, the 20th of
/// them poison (its model call kills the daemon, each time). Its first run crashes beside about
/// 15 others, which are not blamed: each resumes alone once and completes. The poison session
/// resumes alone from then on, so each of its later crashes is its own and counts, and it is
/// suspended after `resume_max_attempts` (3) counted resumes: systemd restarts the daemon at
/// most 3 + 2 times, however many events wait. Every other event completes.
fn a_poison_event_under_load_kills_the_daemon_at_most_max_attempts_plus_two_times(
    machine: &Machine,
) {
    let model = install_model(machine, "poison-model", POISON_MODEL);
    let config = config("").replace("[routes.hook]", &format!("{model}\n[routes.hook]"));
    // From an empty state: only this scenario's events are counted.
    machine.ok("systemctl stop agentgate.service && rm -rf /var/lib/agentgate/*");
    machine.install(
        &format!("{config}delivery_id = \"{{{{ payload.n }}}}\"\n"),
        "",
    );
    machine.ok("systemctl start agentgate.service");
    let restarts = || -> u32 {
        machine
            .show("agentgate.service", "NRestarts")
            .parse()
            .expect("NRestarts")
    };
    let before = restarts();
    let started = Instant::now();
    const EVENTS: u32 = 300;
    for n in 0..EVENTS {
        let task = if n == 19 { "POISON-PILL" } else { "routine" };
        let body = format!(r#"{{"session":"load-{n}","n":{n},"task":"{task}"}}"#);
        // A sender retries what a dying daemon left unanswered; the delivery id makes that safe.
        wait_for(
            &format!("event {n} to be acknowledged"),
            Duration::from_secs(60),
            || {
                machine
                    .post(&body)
                    .is_ok_and(|r| r.status == 202 || r.status == 200)
            },
        );
    }
    // Polled while the poison event crashes the daemon: a status cut short by a crash is no
    // answer yet.
    let counts = |status: &str| {
        machine
            .try_status_json()
            .and_then(|json| json["events"]["by_status"][status].as_u64())
    };
    wait_for(
        "the poison event's suspension and every other event's completion",
        Duration::from_secs(180),
        || counts("suspended") == Some(1) && counts("completed") == Some(u64::from(EVENTS) - 1),
    );
    let deaths = restarts() - before;
    let suspended =
        machine.ok("agentgate sessions list --json --config /etc/agentgate/agentgate.toml");
    let sessions: serde_json::Value = serde_json::from_str(&suspended).expect("sessions json");
    let suspended: Vec<&str> = sessions
        .as_array()
        .expect("sessions")
        .iter()
        .filter(|s| s["state"] == "suspended")
        .filter_map(|s| s["key"].as_str())
        .collect();
    assert_eq!(suspended, ["load-19"]);
    eprintln!(
        "crash loop: {EVENTS} events, {deaths} daemon deaths for the poison event, {:?}",
        started.elapsed()
    );
    assert!(
        (4..=5).contains(&deaths),
        "the daemon was restarted {deaths} times for one poison event (resume_max_attempts = 3)"
    );
}

fn install_hold_model(machine: &Machine) -> String {
    install_model(
        machine,
        "hold-model",
        r#"#!/usr/bin/python3
import json, os, sys
text = json.dumps(json.load(sys.stdin)["messages"])
if "hold-me" in text and "[agentgate] The previous run" not in text:
    os.execv("/bin/sleep", ["/bin/sleep", "300"])
print(json.dumps({"role": "assistant", "content": "done"}))
"#,
    )
}

/// `systemctl restart` while a turn runs: the stopping daemon keeps answering webhooks during
/// its drain (their turns run in the next process), so a sender is not kept waiting by a
/// restart; the interrupted turn and the new event both end in the next process.
#[test]
fn a_restart_while_a_turn_runs_keeps_answering_webhooks() {
    let Some(machine) = Machine::boot("restartturn") else {
        return;
    };
    let model = install_hold_model(&machine);
    machine.install(
        &config("").replace("[routes.hook]", &format!("{model}\n[routes.hook]")),
        "",
    );
    let held = machine
        .post(r#"{"session":"held","task":"hold-me"}"#)
        .expect("POST");
    assert_eq!(held.status, 202, "{held:?}");
    wait_for("the held turn to run", Duration::from_secs(30), || {
        machine.sh("pgrep -f '^/bin/sleep 300'").status.success()
    });
    machine.ok("systemctl --no-block restart agentgate.service");
    wait_for("the drain to begin", Duration::from_secs(10), || {
        machine.show("agentgate.service", "ActiveState") == "deactivating"
    });
    let asked = Instant::now();
    let during = machine
        .post(r#"{"session":"other"}"#)
        .expect("POST during the drain");
    let waited = asked.elapsed();
    assert_eq!(during.status, 202, "{during:?}");
    assert!(waited < Duration::from_secs(2), "answered after {waited:?}");
    assert_eq!(
        machine.show("agentgate.service", "ActiveState"),
        "deactivating",
        "answered by the stopping daemon"
    );
    let ended = |id: &str| {
        machine
            .ok(&format!(
                "agentgate events show {id} --json --config /etc/agentgate/agentgate.toml"
            ))
            .contains("\"status\": \"completed\"")
    };
    wait_for("both events to complete", Duration::from_secs(60), || {
        ended(&held.event_id()) && ended(&during.event_id())
    });
}

/// A start on a full state file system (a crash left a turn running, and marking it is a
/// write): the unit starts anyway, says why it waits in its status, answers webhooks 503 with
/// `Retry-After`, and `systemctl restart` does not hang; once space is freed it resumes the turn.
#[test]
fn a_start_on_a_full_disk_answers_503_and_resumes_once_freed() {
    let Some(machine) = Machine::boot("fulldisk") else {
        return;
    };
    let model = install_hold_model(&machine);
    machine
        .ok("mkdir -p /var/lib/agentgate && mount -t tmpfs -o size=16m tmpfs /var/lib/agentgate");
    let text = config("min_free_disk = \"0\"")
        .replace("[routes.hook]", &format!("{model}\n[routes.hook]"));
    machine.install(&text, "");
    let held = machine
        .post(r#"{"session":"held","task":"hold-me"}"#)
        .expect("POST");
    assert_eq!(held.status, 202, "{held:?}");
    wait_for("the held turn to run", Duration::from_secs(30), || {
        machine.sh("pgrep -f '^/bin/sleep 300'").status.success()
    });
    // The disk fills up, then the daemon is killed: its next start must mark the turn crashed.
    let _ = machine.sh("dd if=/dev/zero of=/var/lib/agentgate/fill bs=1M 2>/dev/null");
    machine.ok("systemctl kill -s KILL agentgate.service");
    wait_for(
        "the restart to wait for space",
        Duration::from_secs(30),
        || {
            machine
                .show("agentgate.service", "StatusText")
                .contains("waiting for the state to be writable")
        },
    );
    assert_eq!(machine.show("agentgate.service", "ActiveState"), "active");
    assert_not_serving(&machine, "waiting for the state to be writable");
    let refused = machine
        .post(r#"{"session":"later"}"#)
        .expect("POST while full");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.header("retry-after"), Some("30"), "{refused:?}");
    let asked = Instant::now();
    machine.ok("systemctl restart agentgate.service");
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "restart took {:?}",
        asked.elapsed()
    );
    machine.ok("rm /var/lib/agentgate/fill");
    wait_for(
        "the held event to resume and complete",
        Duration::from_secs(60),
        || {
            machine
                .ok(&format!(
                    "agentgate events show {} --json --config /etc/agentgate/agentgate.toml",
                    held.event_id()
                ))
                .contains("\"status\": \"completed\"")
        },
    );
}

/// A member of the `_agentgate` group (who may use the control socket, mode 0660, but not the
/// service's database) reads the state through the daemon: `status`, `sessions`, `events`.
#[test]
fn a_member_of_the_daemon_s_group_reads_through_the_control_socket() {
    let Some(machine) = Machine::boot("groupmember") else {
        return;
    };
    machine.install(&config(""), "");
    let posted = machine.post(r#"{"session":"shown"}"#).expect("POST");
    assert_eq!(posted.status, 202, "{posted:?}");
    let id = posted.event_id();
    wait_for("the event to complete", Duration::from_secs(30), || {
        machine.status_json()["events"]["by_status"]["completed"] == 1
    });
    machine.ok("useradd --no-create-home --groups _agentgate agentgate-reader");
    let as_member = |command: &str| {
        machine.sh(&format!(
            "runuser -u agentgate-reader -- agentgate {command} --config /etc/agentgate/agentgate.toml"
        ))
    };
    for command in [
        "status --json",
        "sessions list",
        &format!("events show {id}"),
    ] {
        let output = as_member(command);
        assert!(output.status.success(), "{command}: {output:?}");
    }
    let listed = as_member("sessions list --json");
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("shown"),
        "{listed:?}"
    );
}

/// Session control on the installed units, through the socket-activated control socket: a
/// suspension made while a turn runs survives `systemctl restart` (the interrupted event is not
/// resumed at start), `sessions resume` runs that event again while the session's next event
/// waits (one turn per session), and `sessions cancel` kills the hung model process and ends the
/// event `failed`, delivered; each action is journaled with its MESSAGE_ID.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one session's control actions under systemd, step by step"
)]
fn suspend_restart_resume_and_cancel_under_systemd() {
    let Some(machine) = Machine::boot("control") else {
        return;
    };
    // The model: hangs on a turn of an event that asks for it (the newest user message that
    // names a task decides; the transcript holds the session's earlier events too), answers at
    // once otherwise.
    let model = install_model(
        &machine,
        "hold-model",
        r#"#!/usr/bin/python3
import json, os, sys
messages = json.load(sys.stdin)["messages"]
for message in reversed(messages):
    text = json.dumps(message.get("content"))
    if message.get("role") == "user" and ("hold-me" in text or "quick" in text):
        if "hold-me" in text:
            os.execv("/bin/sleep", ["/bin/sleep", "300"])
        break
print(json.dumps({"role": "assistant", "content": "done"}))
"#,
    );
    let text = config("").replace("[routes.hook]", &format!("{model}\n[routes.hook]"));
    machine.install(&text, "");
    let cli = |command: &str| {
        machine.ok(&format!(
            "agentgate {command} --config /etc/agentgate/agentgate.toml"
        ))
    };
    let post = |body: &str| -> String {
        let response = machine.post(body).expect("POST");
        assert_eq!(response.status, 202, "{response:?}");
        response.event_id()
    };
    let event = |id: &str| -> serde_json::Value {
        serde_json::from_str(&cli(&format!("events show {id} --json"))).expect("events show")
    };
    let hung_model_runs = || machine.sh("pgrep -f '^/bin/sleep 300'").status.success();
    let journaled = |message_id: &str| {
        !machine
            .journal(&format!("-u agentgate.service MESSAGE_ID={message_id}"))
            .is_empty()
    };

    let held = post(r#"{"session":"held","task":"hold-me"}"#);
    wait_for("the held turn to start", Duration::from_secs(30), || {
        hung_model_runs() && event(&held)["status"] == "running"
    });
    cli("sessions suspend held");
    assert!(journaled("edcec10b073e46c1af472b6ca6e53c23"));
    let next = post(r#"{"session":"held","task":"quick"}"#);

    // The restart drains (drain_timeout = 5s): the hung turn is interrupted.
    machine.ok("systemctl restart agentgate.service");
    let bystander = post(r#"{"session":"other","task":"quick"}"#);
    wait_for("the bystander to complete", Duration::from_secs(30), || {
        event(&bystander)["status"] == "completed"
    });
    let sessions = cli("sessions list --json");
    assert!(sessions.contains("\"suspended\""), "{sessions}");
    let interrupted = event(&held);
    assert_eq!(
        interrupted["turns"].as_array().map(Vec::len),
        Some(1),
        "resumed at start despite the suspension: {interrupted}"
    );
    assert_eq!(
        interrupted["turns"][0]["status"], "interrupted",
        "{interrupted}"
    );
    assert!(!hung_model_runs(), "the drain left the model running");
    assert_eq!(event(&next)["status"], "queued");

    // Resume: the interrupted event runs again, first; the next one waits behind it.
    cli("sessions resume held");
    assert!(journaled("7416ee7898a9431690ced8193360227b"));
    wait_for(
        "the held event to run again",
        Duration::from_secs(30),
        || {
            let held = event(&held);
            held["status"] == "running" && held["turns"].as_array().map(Vec::len) == Some(2)
        },
    );
    wait_for(
        "the model to hang again",
        Duration::from_secs(30),
        hung_model_runs,
    );
    assert_eq!(
        event(&next)["status"],
        "queued",
        "two turns of one session at once"
    );

    // Cancel: the hung model process is killed, the event fails and that is delivered.
    cli("sessions cancel held");
    assert!(journaled("21225f76e7564e6d8df082b2fd4275e0"));
    wait_for(
        "the cancelled event to be delivered",
        Duration::from_secs(30),
        || {
            let held = event(&held);
            held["status"] == "failed" && held["delivery"]["status"] == "delivered"
        },
    );
    let cancelled = event(&held);
    assert!(
        cancelled.to_string().contains("cancelled by operator"),
        "{cancelled}"
    );
    assert!(!hung_model_runs(), "the cancelled turn's model still runs");
    wait_for(
        "the next event to complete",
        Duration::from_secs(30),
        || event(&next)["status"] == "completed",
    );
}

const OPERATIONS_GUIDE: &str = include_str!("../docs/operations.md");

/// A command as docs/operations.md shows it; the test fails if the guide stops showing it.
fn guide(command: &str) -> &str {
    assert!(
        OPERATIONS_GUIDE.contains(command),
        "docs/operations.md no longer shows `{command}`"
    );
    command
}

/// docs/operations.md, followed on the installed units: check and apply a config, the journal
/// filters it gives, the session commands and the control socket, `status`, events and
/// deliveries, `send`, and the backup and restore procedure. Commands run as written, except
/// where the guide shows a placeholder (an event id, a route name, a date).
#[test]
fn the_operations_guide_works_as_written() {
    let Some(machine) = Machine::boot("operations") else {
        return;
    };
    machine.install(&config(""), "");
    machine.ok(guide("agentgate check-config"));
    machine.ok(guide("systemctl try-reload-or-restart agentgate.service"));
    let response = machine.post(r#"{"session":"acme/web#7"}"#).expect("POST");
    assert_eq!(response.status, 202, "{response:?}");
    let id = response.event_id();
    let show = |id: &str| -> serde_json::Value {
        let text = machine.ok(&format!("{} {id} --json", guide("agentgate events show")));
        serde_json::from_str(&text).expect("events show --json")
    };
    wait_for("the event to be delivered", Duration::from_secs(30), || {
        show(&id)["delivery"]["status"] == "delivered"
    });

    let session_lines = machine.ok(guide("journalctl -u agentgate SESSION_KEY='acme/web#7'"));
    assert!(session_lines.contains("event accepted"), "{session_lines}");
    guide("journalctl -u agentgate EVENT_ID=");
    let event_lines = machine.ok(&format!("journalctl -u agentgate EVENT_ID={id}"));
    assert!(event_lines.contains("turn completed"), "{event_lines}");
    let everything = machine.ok(guide("journalctl -u 'agentgate*'"));
    assert!(everything.contains("reconcile finished"), "{everything}");
    let explained = machine.ok(guide("journalctl -x -u agentgate"));
    assert!(
        explained.contains("was verified and committed to the state"),
        "{explained}"
    );

    let sessions = machine.ok(guide("agentgate sessions list"));
    assert!(sessions.contains("acme/web#7"), "{sessions}");
    let transcript = machine.ok(guide("agentgate sessions show 'acme/web#7'"));
    assert!(transcript.contains("assistant"), "{transcript}");
    machine.ok(guide("agentgate sessions suspend 'acme/web#7'"));
    assert!(machine.ok("agentgate sessions list").contains("suspended"));
    let suspended = machine
        .post(r#"{"session":"acme/web#7"}"#)
        .expect("POST while suspended");
    let waiting = suspended.event_id();
    machine.ok(guide("agentgate sessions resume 'acme/web#7'"));
    wait_for(
        "the waiting event to complete",
        Duration::from_secs(30),
        || show(&waiting)["status"] == "completed",
    );
    machine.ok(guide("agentgate ledger show"));
    let resumed = machine.ok(guide(
        "curl --unix-socket /run/agentgate/control.sock -X POST http://localhost/v1/sessions/acme%2Fweb%237/resume",
    ));
    assert!(resumed.contains("acme/web#7"), "{resumed}");

    let status = machine.ok(guide("agentgate status"));
    assert!(status.contains("running"), "{status}");
    assert!(status.contains("events:"), "{status}");
    let events = machine.ok(guide("agentgate events list"));
    assert!(events.contains(&id), "{events}");
    let replayed = machine.ok(&format!("{} {id}", guide("agentgate events replay")));
    assert!(!replayed.is_empty(), "replay prints the new event's id");
    machine.ok(guide("agentgate deliveries list --failed"));
    machine.ok(guide("agentgate deliveries retry --failed"));
    std::fs::write(
        machine.share.path().join("payload.json"),
        r#"{"session":"sent-by-send"}"#,
    )
    .expect("write payload.json");
    guide("agentgate send ROUTE --data @payload.json");
    let sent = machine.ok(&format!(
        "cd {} && agentgate send hook --data @payload.json",
        machine.share.path().display()
    ));
    assert!(sent.contains("202"), "{sent}");

    // Backup while running, then the restore procedure (the guide's date is an example).
    let events_before = machine.status_json()["events"]["total"].clone();
    machine.ok(guide("agentgate backup /var/backups/agentgate-$(date +%F)"));
    machine.ok(guide(
        "systemctl stop agentgate.socket agentgate-control.socket agentgate.service",
    ));
    // As on a fresh install: no state directory yet.
    machine.ok("rm -rf /var/lib/agentgate");
    machine.ok(guide(
        "install -d -o _agentgate -g _agentgate -m 0750 /var/lib/agentgate",
    ));
    guide(
        "cp /var/backups/agentgate-2026-12-01/agentgate.db /var/backups/agentgate-2026-12-01/ledger.json /var/lib/agentgate/",
    );
    machine.ok("cp /var/backups/agentgate-$(date +%F)/agentgate.db /var/backups/agentgate-$(date +%F)/ledger.json /var/lib/agentgate/");
    machine.ok(guide(
        "rm -f /var/lib/agentgate/agentgate.db-wal /var/lib/agentgate/agentgate.db-shm",
    ));
    machine.ok(guide(
        "chown _agentgate:_agentgate /var/lib/agentgate/agentgate.db /var/lib/agentgate/ledger.json",
    ));
    machine.ok(guide(
        "systemctl start agentgate.socket agentgate-control.socket",
    ));
    let status = machine.status_json();
    assert_eq!(
        status["events"]["total"], events_before,
        "the restored state holds every event: {status}"
    );
}

/// An approval pending across `systemctl restart`: the request survives it, the CLI decides it
/// through the restarted daemon's control socket (recorded as root), the turn completes, and
/// both steps are in the journal with their MESSAGE_IDs. The approved call ran in a tool unit as
/// `_agentgate-tool`, not as the daemon's user.
#[test]
fn an_approval_pending_across_a_restart_is_decided_after_it() {
    let Some(machine) = Machine::boot("approval") else {
        return;
    };
    let model = install_call_once_model(&machine, "deploy", r#"{"target": "prod"}"#);
    let setup = format!(
        "{model}\n[tools.deploy]\ncommand = [\"/usr/bin/id\", \"-un\"]\napproval = true\n\
         parameters = {{ type = \"object\", properties = {{ target = {{ type = \"string\", enum = [\"prod\"] }} }} }}\n"
    );
    let text = config("").replace("[routes.hook]", &format!("{setup}\n[routes.hook]"))
        + "tools = [\"deploy\"]\n";
    machine.install(&text, "");
    let cli = |command: &str| {
        machine.ok(&format!(
            "agentgate {command} --config /etc/agentgate/agentgate.toml"
        ))
    };
    let response = machine
        .post(r#"{"session":"deploys","task":"ship"}"#)
        .expect("POST");
    assert_eq!(response.status, 202, "{response:?}");
    let event = response.event_id();
    let pending = || -> Vec<serde_json::Value> {
        serde_json::from_str::<serde_json::Value>(&cli("approvals list --json"))
            .ok()
            .and_then(|list| list["approvals"].as_array().cloned())
            .unwrap_or_default()
    };
    wait_for("the approval request", Duration::from_secs(30), || {
        pending().len() == 1
    });
    let id = pending()[0]["id"].as_str().unwrap_or_default().to_string();
    machine.ok("systemctl restart agentgate.service");
    assert_eq!(pending().len(), 1, "the request survives the restart");
    let decided = cli(&format!("approvals approve {id} --note restart-proof"));
    assert!(decided.contains("approved by root"), "{decided}");
    let status = || -> String {
        serde_json::from_str::<serde_json::Value>(&cli(&format!("events show {event} --json")))
            .ok()
            .and_then(|shown| shown["status"].as_str().map(str::to_string))
            .unwrap_or_default()
    };
    wait_for("the turn to complete", Duration::from_secs(30), || {
        status() == "completed"
    });
    // The call ran, in a tool unit, as the tool units' own user: not the daemon's.
    let transcript = cli("sessions show deploys --json");
    assert!(
        transcript.contains(r#"\"stdout\":\"_agentgate-tool\\n\""#),
        "{transcript}"
    );
    for message_id in [
        "3f0a9c51d2b84e6f9a7c1e5d08b4f2a6",
        "c4e81b7a90f34d2a8b6e2f1d93a5c707",
    ] {
        assert!(
            !machine
                .journal(&format!("-u agentgate.service MESSAGE_ID={message_id}"))
                .is_empty(),
            "{message_id} is not in the journal"
        );
    }
}

/// A schedule as README.Debian adds one: a file naming the route and the payload, a calendar in
/// the timer's drop-in (here every second, so that the test takes seconds), the timer enabled.
/// Every fire is a new event with the delivery id `schedule:NAME:<time of the fire>`: on
/// systemd 252 `TRIGGER_TIMER_REALTIME_USEC` keeps the first fire's time, so a key made of it
/// made every later fire a duplicate. Then a fire missed while the timer was stopped runs once
/// when it starts again (`Persistent=true`), as a new event too, and the same fire posted again
/// is a duplicate.
#[test]
fn every_fire_of_a_schedule_timer_is_one_event() {
    let Some(machine) = Machine::boot("schedule") else {
        return;
    };
    machine.install(&config(""), "");
    let calendar = |on_calendar: &str| {
        machine.ok(&format!(
            "printf '[Timer]\\nOnCalendar=\\nOnCalendar={on_calendar}\\n' | install -D -m 0644 /dev/stdin /etc/systemd/system/agentgate-schedule@tick.timer.d/calendar.conf && systemctl daemon-reload"
        ));
    };
    machine.ok(
        r#"printf 'route = "hook"\npayload = { session = "tick", task = "report" }\n' | install -D -m 0640 -g _agentgate /dev/stdin /etc/agentgate/schedules/tick.toml"#,
    );
    calendar("*-*-* *:*:*");
    machine.ok("systemctl enable --now agentgate-schedule@tick.timer");
    // What each run of the service printed: the daemon's answer to its fire.
    let answers = || -> Vec<String> {
        machine
            .journal("-u agentgate-schedule@tick.service")
            .lines()
            .filter(|line| line.starts_with("20"))
            .map(str::to_string)
            .collect()
    };
    let events = || -> Vec<String> {
        let text = machine.ok(
            "agentgate events list --session tick --json --config /etc/agentgate/agentgate.toml",
        );
        serde_json::from_str::<Vec<serde_json::Value>>(&text)
            .unwrap_or_default()
            .iter()
            .filter_map(|event| event["delivery_id"].as_str().map(str::to_string))
            .collect()
    };
    wait_for("three fires", Duration::from_secs(30), || {
        answers().len() >= 3
    });
    machine.ok("systemctl stop agentgate-schedule@tick.timer");
    wait_for(
        "the last fire's run to end",
        Duration::from_secs(10),
        || machine.show("agentgate-schedule@tick.service", "ActiveState") == "inactive",
    );
    let fired = answers();
    assert!(
        fired.iter().all(|answer| answer.contains("\"accepted\"")),
        "every fire is a new event: {fired:#?}"
    );
    let mut keys = events();
    assert_eq!(keys.len(), fired.len(), "{keys:#?} {fired:#?}");
    assert!(keys.iter().all(|key| key.starts_with("schedule:tick:20")));

    // A fire missed while the timer is stopped runs once when it starts again.
    let missed = machine.ok("date -u -d '+1 sec' '+%Y-%m-%d %H:%M:%S'");
    calendar(&format!("{missed} UTC"));
    let missed_at = machine.ok(&format!("date -u -d '{missed} UTC' +%s"));
    wait_for("the missed time to pass", Duration::from_secs(10), || {
        machine.ok("date -u +%s") > missed_at
    });
    machine.ok("systemctl start agentgate-schedule@tick.timer");
    wait_for("the catch-up", Duration::from_secs(30), || {
        answers().len() == fired.len() + 1
            && machine.show("agentgate-schedule@tick.service", "ActiveState") == "inactive"
    });
    let caught_up = answers();
    assert!(
        caught_up[fired.len()].contains("\"accepted\""),
        "{caught_up:#?}"
    );
    keys = events();
    assert_eq!(keys.len(), caught_up.len(), "{keys:#?}");
    let distinct: std::collections::BTreeSet<_> = keys.iter().collect();
    assert_eq!(distinct.len(), keys.len(), "{keys:#?}");

    // The same fire posted again (the service run again for it): a duplicate, nothing new.
    let again = machine.ok(
        "TRIGGER_UNIT=agentgate-schedule@tick.timer runuser -u _agentgate -- agentgate send --schedule tick",
    );
    assert!(again.contains("\"duplicate\""), "{again}");
    assert_eq!(events().len(), keys.len());
}

/// A call that grows its pipes uses up its own user's allowance, not the daemon's: 24 calls at
/// once, each growing its stdin, stdout and stderr to 1 MiB (72 MiB, over the kernel's 64 MiB
/// `fs.pipe-user-pages-soft` for one user), and the daemon's user still gets full-size pipes
/// and may grow one. The pipes are created in the tool unit, so the kernel charges them to
/// `_agentgate-tool`. The calls also see their own user in `USER` and `LOGNAME`, and no cgroup
/// tree (which would name every service and show what each uses).
#[test]
fn a_call_s_pipes_are_charged_to_the_tool_user_not_the_daemon_s() {
    let Some(machine) = Machine::boot("pipes") else {
        return;
    };
    const CALLS: usize = 24;
    let model = install_call_once_model(&machine, "hog", "{}");
    std::fs::write(
        machine.share.path().join("hog"),
        r#"#!/usr/bin/python3
import fcntl, os, secrets, time
grown = []
for fd in (0, 1, 2):
    try:
        grown.append(str(fcntl.fcntl(fd, 1031, 1 << 20)))
    except OSError as err:
        grown.append(err.strerror)
open("/srv/hog/ready-" + secrets.token_hex(8), "w").close()
while not os.path.exists("/srv/hog/release"):
    time.sleep(0.1)
cgroups = ",".join(sorted(os.listdir("/sys/fs/cgroup"))) or "none"
print("USER=%s LOGNAME=%s CGROUPS=%s GROWN=%s" % (
    os.environ.get("USER"), os.environ.get("LOGNAME"), cgroups, ",".join(grown)))
"#,
    )
    .expect("write the tool");
    let tool = "[tools.hog]\ncommand = [\"/usr/local/lib/hog\"]\nwritable = [\"/srv/hog\"]\ntimeout = \"300s\"\n";
    let text = config(&format!("max_concurrent_turns = {}", CALLS + 1))
        .replace("[routes.hook]", &format!("{model}\n{tool}\n[routes.hook]"))
        + "tools = [\"hog\"]\n";
    machine.install(&text, "");
    machine.ok(&format!(
        "install -m 0755 {}/hog /usr/local/lib/hog
         install -d -o _agentgate-tool -g _agentgate-tool /srv/hog
         mkdir -p /etc/systemd/system/agentgate-tool@.service.d
         printf '[Service]\\nReadWritePaths=/srv/hog\\n' > /etc/systemd/system/agentgate-tool@.service.d/hog.conf
         systemctl daemon-reload",
        machine.share.path().display()
    ));
    for n in 0..CALLS {
        let response = machine
            .post(&format!(r#"{{"session":"hog-{n}","task":"grow"}}"#))
            .expect("POST");
        assert_eq!(response.status, 202, "{response:?}");
    }
    wait_for(
        "every call to grow its pipes",
        Duration::from_secs(120),
        || machine.ok("ls /srv/hog | grep -c '^ready-' || true") == CALLS.to_string(),
    );
    // The daemon's user, while every call holds its pipes: a new pipe has the default 64 KiB
    // and may grow to 1 MiB (a user at the allowance may not grow one, and over it a new pipe
    // gets 8 KiB).
    let daemon_user_pipe = machine.ok(
        r#"setpriv --reuid=_agentgate --regid=_agentgate --clear-groups python3 -c '
import fcntl, os
read, write = os.pipe()
size = fcntl.fcntl(write, 1032)
try:
    grown = fcntl.fcntl(write, 1031, 1 << 20)
except OSError as err:
    grown = err.strerror
print(size, grown)'"#,
    );
    machine.ok("touch /srv/hog/release");
    wait_for("every turn to complete", Duration::from_secs(120), || {
        machine.status_json()["events"]["by_status"]["completed"].as_u64() == Some(CALLS as u64)
    });
    assert_eq!(
        daemon_user_pipe, "65536 1048576",
        "the daemon's user's pipes"
    );
    let transcript =
        machine.ok("agentgate sessions show hog-0 --json --config /etc/agentgate/agentgate.toml");
    assert!(
        transcript.contains("USER=_agentgate-tool LOGNAME=_agentgate-tool CGROUPS=none"),
        "{transcript}"
    );
}
