//! Turn benchmarks against the release binary and an in-process stub model:
//!
//! 1. per-step time: turns of 20 model calls each (the stub answers at once, asking for a tool the
//!    route does not have, so every step is a model round trip plus two commits and no tool
//!    process), median of (turn duration / steps) over many turns;
//! 2. 1,000 concurrent turns waiting on a slow model: peak RSS of the daemon while all of them
//!    wait, and whether every one of them completed (no starvation);
//! 3. time from start to READY=1 with N stored events (N from AGENTGATE_BENCH_EVENTS, default
//!    100,000);
//! 4. tool calls: 1,000 calls of a tool that echoes its arguments, as a command tool (`/bin/cat`)
//!    and as an MCP tool (the reference server's `echo` over stdio, warm), one turn at a time,
//!    each in its sandbox (the default) and with `sandbox = "none"`.
//!    Each sample is the time from one model request to the next within a turn: one model round
//!    trip, two commits and the tool call, so the difference between the two kinds is the
//!    difference between their calls. Needs the servers of `tests/mcp/install`.
//! 5. one long session: the daemon's CPU per event while a session is young and after
//!    thousands of earlier turns (AGENTGATE_BENCH_HISTORY, default 2,000), within the default
//!    history bound.
//!
//! Run: cargo bench --bench turns [per_step|concurrent_turns|time_to_ready|tool_calls|long_session]
//! (AGENTGATE_BENCH_BIN=PATH measures another build of the daemon, to compare with)

#[path = "../tests/common/stub.rs"]
#[expect(dead_code, reason = "the tests' stub model; the benchmark uses a part")]
mod stub;

use std::os::unix::net::UnixDatagram;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stub::{Reply, Stub};

/// The daemon measured: this build's, or AGENTGATE_BENCH_BIN (another build, to compare with).
fn daemon_binary() -> String {
    std::env::var("AGENTGATE_BENCH_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_agentgate").to_string())
}

struct Daemon {
    child: Child,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18900)
}

fn config(dir: &std::path::Path, port: u16, model: &str, concurrency: usize) -> std::path::PathBuf {
    let path = dir.join("agentgate.toml");
    let text = format!(
        r#"state_dir = "{state}"
[server]
listen = "127.0.0.1:{port}"
[runtime]
max_concurrent_turns = {concurrency}
max_turn_steps = 40
turn_idle_timeout = "10m"
[model]
backend = "openai"
base_url = "{model}/v1"
model = "bench"
request_timeout = "120s"
[routes.bench]
path = "/bench"
verify = {{ scheme = "none" }}
session = "{{{{ payload.session }}}}"
"#,
        state = dir.join("state").display()
    );
    std::fs::write(&path, text).expect("config");
    path
}

fn start(config: &std::path::Path, notify: Option<&std::path::Path>) -> Daemon {
    let mut command = Command::new(daemon_binary());
    command
        .args(["serve", "--config"])
        .arg(config)
        .env("AGENTGATE_LOG", "warn")
        .env_remove("JOURNAL_STREAM")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(socket) = notify {
        command.env("NOTIFY_SOCKET", socket);
    }
    Daemon {
        child: command.spawn().expect("spawn agentgate"),
    }
}

fn post(port: u16, body: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let request = format!(
        "POST /bench HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 202")
}

fn wait_ready(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("agentgate did not listen");
}

fn query(dir: &std::path::Path, sql: &str) -> Vec<(i64, i64, i64)> {
    let connection = rusqlite::Connection::open(dir.join("state/agentgate.db")).expect("db");
    let mut statement = connection.prepare(sql).expect("sql");
    statement
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
        .expect("query")
        .collect::<rusqlite::Result<Vec<_>>>()
        .expect("rows")
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Mean time of one request to the stub model on a fresh connection (the stub closes each one),
/// measured from here: the part of a step that is the model's, not agentgate's.
fn model_round_trip(model: &Stub) -> f64 {
    use std::io::{Read, Write};
    let body = r#"{"model":"bench","messages":[{"role":"user","content":"x"}]}"#;
    let rounds = 200;
    let started = Instant::now();
    for _ in 0..rounds {
        let mut stream = std::net::TcpStream::connect(model.addr).expect("stub");
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).expect("write");
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
    }
    started.elapsed().as_secs_f64() * 1e6 / rounds as f64
}

fn per_step() {
    const TURNS: usize = 200;
    const STEPS: usize = 20;
    let concurrency: usize = std::env::var("AGENTGATE_BENCH_CONCURRENCY")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(16);
    let model = Stub::start(|request, _| {
        let calls = request.json()["messages"]
            .as_array()
            .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count());
        if calls + 1 >= STEPS {
            Reply::answer("done")
        } else {
            Reply::tool_call(&format!("c{calls}"), "absent_tool", serde_json::json!({}))
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let daemon = start(&config(dir.path(), port, &model.url(), concurrency), None);
    wait_ready(port);
    let round_trip_us = model_round_trip(&model);
    for n in 0..TURNS {
        assert!(post(port, &format!(r#"{{"session":"s{n}"}}"#)));
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done = query(
            dir.path(),
            "SELECT count(*), 0, 0 FROM turns WHERE status = 'completed'",
        );
        if done[0].0 as usize == TURNS || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(daemon);
    let mut per_step_us: Vec<f64> = query(
        dir.path(),
        "SELECT started_at, finished_at, steps FROM turns WHERE status = 'completed'",
    )
    .into_iter()
    .map(|(start, end, steps)| (end - start) as f64 * 1000.0 / steps.max(1) as f64)
    .collect();
    per_step_us.sort_by(f64::total_cmp);
    let median = per_step_us
        .get(per_step_us.len() / 2)
        .copied()
        .unwrap_or(0.0);
    let p90 = per_step_us
        .get(per_step_us.len() * 9 / 10)
        .copied()
        .unwrap_or(0.0);
    println!(
        "per_step: turns={} steps_per_turn={STEPS} concurrency={concurrency} median_us={median:.0} p90_us={p90:.0} model_round_trip_us={round_trip_us:.0} median_overhead_us={:.0}",
        per_step_us.len(),
        median - round_trip_us
    );
}

fn concurrent_turns() {
    const TURNS: usize = 1000;
    let delay = Duration::from_secs(8);
    let model = Stub::start(move |_, _| Reply::answer("ok").after(delay));
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let daemon = start(&config(dir.path(), port, &model.url(), TURNS), None);
    wait_ready(port);
    let idle_rss = rss_kib(daemon.child.id(), "VmRSS:");
    let started = Instant::now();
    for n in 0..TURNS {
        assert!(post(port, &format!(r#"{{"session":"c{n}"}}"#)));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while model.requests().len() < TURNS && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let waiting = model.requests().len();
    let rss_waiting = rss_kib(daemon.child.id(), "VmRSS:");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut completed = 0;
    while Instant::now() < deadline {
        completed = query(
            dir.path(),
            "SELECT count(*), 0, 0 FROM turns WHERE status = 'completed'",
        )[0]
        .0;
        if completed as usize == TURNS {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let peak = rss_kib(daemon.child.id(), "VmHWM:");
    println!(
        "concurrent_turns: turns={TURNS} waiting_at_once={waiting} idle_rss_kib={idle_rss} rss_while_waiting_kib={rss_waiting} peak_rss_kib={peak} completed={completed} all_done_after_s={:.1} (model delay {}s)",
        started.elapsed().as_secs_f64(),
        delay.as_secs()
    );
    drop(daemon);
}

fn time_to_ready() {
    let events: usize = std::env::var("AGENTGATE_BENCH_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let model = Stub::start(|_, _| Reply::answer("ok").after(Duration::from_secs(3600)));
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let config = config(dir.path(), port, &model.url(), 16);
    // Create the schema, then fill it directly: the figure is about start-up, not accepting.
    drop({
        let daemon = start(&config, None);
        wait_ready(port);
        daemon
    });
    {
        let mut connection =
            rusqlite::Connection::open(dir.path().join("state/agentgate.db")).expect("db");
        let tx = connection.transaction().expect("tx");
        {
            let mut insert = tx
                .prepare(
                    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                                         received_at, status, updated_at)
                     VALUES (?1, 'bench', ?2, '', NULL, '{}', ?3, 0, 'completed', 0)",
                )
                .expect("prepare");
            let payload = vec![b'x'; 1024];
            for n in 0..events {
                insert
                    .execute(rusqlite::params![
                        format!("evt-{n}"),
                        format!("s{}", n % 10_000),
                        payload
                    ])
                    .expect("insert");
            }
        }
        tx.commit().expect("commit");
    }
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("notify socket");
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let started = Instant::now();
    let daemon = start(&config, Some(&socket_path));
    let mut buffer = [0u8; 1024];
    let mut ready = None;
    while let Ok(n) = socket.recv(&mut buffer) {
        if String::from_utf8_lossy(&buffer[..n]).contains("READY=1") {
            ready = Some(started.elapsed());
            break;
        }
    }
    drop(daemon);
    println!(
        "time_to_ready: stored_events={events} ready_after_ms={}",
        ready.map_or("none".to_string(), |d| format!(
            "{:.1}",
            d.as_secs_f64() * 1000.0
        ))
    );
}

#[expect(
    clippy::too_many_lines,
    reason = "one measured scenario: its servers, turns and report read best in one place"
)]
fn tool_calls() {
    const TURNS: usize = 50;
    const CALLS_PER_TURN: usize = 20;
    let everything = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/mcp/node_modules/.bin/mcp-server-everything");
    assert!(everything.exists(), "run tests/mcp/install first");
    let command = |sandbox: &str| {
        format!(
            "[tools.echo_args]\ncommand = [\"/bin/cat\"]\nparameters = {{ type = \"object\", properties = {{ message = {{ type = \"string\", maxLength = 64 }} }} }}\nsandbox = \"{sandbox}\"\n"
        )
    };
    let server = |sandbox: &str| {
        format!(
            "[mcp.everything]\ncommand = [{:?}, \"stdio\"]\nsandbox = \"{sandbox}\"\n",
            everything.display().to_string()
        )
    };
    // Each kind sandboxed (the default) and not: the difference is what the sandbox costs.
    let kinds = [
        ("command", "echo_args", command("strict"), "[\"echo_args\"]"),
        (
            "command-unconfined",
            "echo_args",
            command("none"),
            "[\"echo_args\"]",
        ),
        (
            "mcp",
            "everything__echo",
            server("strict"),
            "[\"everything.echo\"]",
        ),
        (
            "mcp-unconfined",
            "everything__echo",
            server("none"),
            "[\"everything.echo\"]",
        ),
    ];
    for (kind, tool, section, offered) in kinds {
        let arrivals: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
        let seen = arrivals.clone();
        let model = Stub::start(move |request, _| {
            let body = request.json();
            let messages = body["messages"].as_array().cloned().unwrap_or_default();
            let session = messages
                .iter()
                .filter_map(|m| m["content"].as_str())
                .find_map(|c| c.split("\"session\": \"").nth(1)?.split('"').next())
                .unwrap_or("")
                .to_string();
            if let Ok(mut seen) = seen.lock() {
                seen.push((session, Instant::now()));
            }
            let calls = messages.iter().filter(|m| m["role"] == "assistant").count();
            if calls >= CALLS_PER_TURN {
                Reply::answer("done")
            } else {
                Reply::tool_call(
                    &format!("c{calls}"),
                    tool,
                    serde_json::json!({"message": "hello"}),
                )
            }
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let path = config(dir.path(), port, &model.url(), 1);
        let text = std::fs::read_to_string(&path).expect("config");
        std::fs::write(&path, format!("{text}tools = {offered}\n\n{section}")).expect("config");
        let daemon = start(&path, None);
        wait_ready(port);
        // Warm: the server has started and one turn has run before the measured ones.
        assert!(post(port, r#"{"session":"warm"}"#));
        let completed = |n: usize| {
            let deadline = Instant::now() + Duration::from_secs(300);
            while Instant::now() < deadline {
                let done = query(
                    dir.path(),
                    "SELECT count(*), 0, 0 FROM turns WHERE status = 'completed'",
                );
                if done[0].0 as usize >= n {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            panic!("turns did not complete");
        };
        completed(1);
        for n in 0..TURNS {
            assert!(post(port, &format!(r#"{{"session":"s{n}"}}"#)));
        }
        completed(TURNS + 1);
        drop(daemon);
        let arrivals = arrivals.lock().map(|a| a.clone()).unwrap_or_default();
        let mut samples_us: Vec<f64> = Vec::new();
        for n in 0..TURNS {
            let session = format!("s{n}");
            let times: Vec<Instant> = arrivals
                .iter()
                .filter(|(s, _)| *s == session)
                .map(|(_, at)| *at)
                .collect();
            samples_us.extend(
                times
                    .windows(2)
                    .map(|pair| (pair[1] - pair[0]).as_secs_f64() * 1e6),
            );
        }
        samples_us.sort_by(f64::total_cmp);
        let at = |q: f64| samples_us[((samples_us.len() - 1) as f64 * q) as usize];
        println!(
            "tool_calls kind={kind} calls={} median_us={:.0} p99_us={:.0}",
            samples_us.len(),
            at(0.5),
            at(0.99)
        );
    }
}

/// The daemon's CPU time so far (user and system), in milliseconds.
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command's name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |index: usize| fields.get(index).and_then(|t| t.parse::<f64>().ok());
    // utime and stime, fields 14 and 15 of the line, in ticks of 10 ms (USER_HZ).
    (ticks(11).unwrap_or(0.0) + ticks(12).unwrap_or(0.0)) * 10.0
}

/// Posts `count` events of `payload_bytes` to session `long` and waits until `until` turns
/// have completed; the daemon's CPU milliseconds per event meanwhile.
fn session_events(port: u16, dir: &std::path::Path, pid: u32, count: usize, until: i64) -> f64 {
    let filler = "x".repeat(8 * 1024);
    let before = cpu_ms(pid);
    for n in 0..count {
        let body = format!(r#"{{"session":"long","n":{n},"detail":"{filler}"}}"#);
        assert!(post(port, &body));
    }
    let deadline = Instant::now() + Duration::from_secs(1800);
    while query(
        dir,
        "SELECT count(*), 0, 0 FROM turns WHERE status = 'completed'",
    )[0]
    .0 < until
    {
        assert!(Instant::now() < deadline, "the turns did not complete");
        std::thread::sleep(Duration::from_millis(50));
    }
    (cpu_ms(pid) - before) / count as f64
}

/// One session that lives long: the daemon's CPU per event while the session is young, and
/// after AGENTGATE_BENCH_HISTORY (default 2,000) earlier turns, each event 8 KiB, the route's
/// history bound the default (20 turns), the model answering at once.
fn long_session() {
    const MEASURED: usize = 100;
    let history: usize = std::env::var("AGENTGATE_BENCH_HISTORY")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000);
    let model = Stub::start(|_, _| Reply::answer("done"));
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let daemon = start(&config(dir.path(), port, &model.url(), 4), None);
    wait_ready(port);
    let pid = daemon.child.id();
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    let young = session_events(port, dir.path(), pid, MEASURED, count(MEASURED));
    let filled = history.max(MEASURED);
    session_events(port, dir.path(), pid, filled - MEASURED, count(filled));
    let old = session_events(port, dir.path(), pid, MEASURED, count(filled + MEASURED));
    println!(
        "long_session: daemon CPU per event: {young:.2} ms over turns 1-{MEASURED}, \
         {old:.2} ms over turns {}-{} (8 KiB events, history bound 20 turns)",
        filled + 1,
        filled + MEASURED
    );
}

fn main() {
    let which = std::env::args().nth(1).filter(|a| !a.starts_with("--"));
    match which.as_deref() {
        Some("per_step") => per_step(),
        Some("concurrent_turns") => concurrent_turns(),
        Some("time_to_ready") => time_to_ready(),
        Some("tool_calls") => tool_calls(),
        Some("long_session") => long_session(),
        _ => {
            per_step();
            concurrent_turns();
            time_to_ready();
            tool_calls();
            long_session();
        }
    }
}
