//! Test harness: runs the real `agentgate` binary on loopback with a config of the test's own, and
//! talks to it over raw HTTP/1.1 so that tests control every byte (slow clients, chunked bodies).
#![expect(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

pub mod approving;
pub mod basics;
pub mod fsync_lint;
pub mod load;
pub mod loopfs;
pub mod machine;
pub mod marks;
pub mod mcp;
pub mod postgres;
pub mod stub;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixListener;

use command_fds::{CommandFdExt, FdMapping};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use basics::{Need, can_run, free_port, is_root, wait_until};

pub const BIN: &str = env!("CARGO_BIN_EXE_agentgate");

/// Whether a test that needs root can run (see [`basics::can_run`]).
pub fn root_or_skip(test: &str) -> bool {
    basics::can_run(test, Need::Root, is_root())
}

/// Builds an LD_PRELOAD shim that makes fsync and fdatasync fail with EIO while the file named by
/// `FAILSYNC_FLAG` exists, or for descriptors whose path contains `FAILSYNC_MATCH`.
pub fn failsync_shim(dir: &Path) -> PathBuf {
    let source = dir.join("failsync.c");
    std::fs::write(
        &source,
        r#"
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <dlfcn.h>
static int failing(int fd) {
    const char *flag = getenv("FAILSYNC_FLAG");
    if (flag && access(flag, F_OK) == 0) return 1;
    const char *pattern = getenv("FAILSYNC_MATCH");
    char link[64], target[4096];
    if (!pattern) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = 0;
    return strstr(target, pattern) != NULL;
}
int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    if (failing(fd)) { errno = EIO; return -1; }
    return real(fd);
}
int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    if (failing(fd)) { errno = EIO; return -1; }
    return real(fd);
}
"#,
    )
    .expect("shim source");
    let library = dir.join("libfailsync.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .arg("-ldl")
        .status()
        .expect("cc");
    assert!(status.success(), "cannot build the fsync shim");
    library
}

/// POSTs `count` JSON bodies (`body(n)`) to `path` over four connections at once; every one must
/// be accepted (202).
pub fn post_many(
    addr: SocketAddr,
    path: &str,
    count: usize,
    body: impl Fn(usize) -> String + Sync,
) {
    std::thread::scope(|scope| {
        for worker in 0..4 {
            let body = &body;
            scope.spawn(move || {
                for n in (worker..count).step_by(4) {
                    let response = try_request(
                        addr,
                        "POST",
                        path,
                        &[("content-type", "application/json")],
                        body(n).as_bytes(),
                    )
                    .expect("POST");
                    assert_eq!(response.status, 202, "{response:?}");
                }
            });
        }
    });
}

/// A test's own config directory and state directory, and its webhook socket.
pub struct Workspace {
    pub dir: tempfile::TempDir,
    pub port: u16,
    state_dir: PathBuf,
    /// The webhook socket, bound with the workspace (its port is in the config), and the
    /// control socket (`control.sock` in the workspace), bound at the first start (before it,
    /// no daemon answers there); both kept for the workspace's life and passed to every daemon
    /// it starts (socket activation, as systemd does), so that no other test can take the port
    /// between a daemon's runs. `None` once released for a test that has the daemon bind them.
    sockets: Mutex<Option<Sockets>>,
}

/// The sockets a workspace passes to its daemons.
struct Sockets {
    webhook: TcpListener,
    control: Option<UnixListener>,
    /// The metrics and console listeners, for a test that asks for them (`metrics_addr`,
    /// `console_addr`).
    metrics: Option<TcpListener>,
    console: Option<TcpListener>,
}

impl Workspace {
    pub fn new() -> Workspace {
        let dir = tempfile::tempdir().expect("tempdir");
        let state_dir = dir.path().join("state");
        Workspace::with_state_dir(dir, state_dir)
    }

    /// A workspace whose state directory is `state_dir` (e.g. on a file system of its own).
    pub fn with_state_dir(dir: tempfile::TempDir, state_dir: PathBuf) -> Workspace {
        let webhook = TcpListener::bind("127.0.0.1:0").expect("a loopback socket");
        let port = webhook.local_addr().expect("its address").port();
        Workspace {
            dir,
            port,
            state_dir,
            sockets: Mutex::new(Some(Sockets {
                webhook,
                control: None,
                metrics: None,
                console: None,
            })),
        }
    }

    /// Closes the workspace's sockets, for a test that has them bound otherwise (by
    /// `systemd-socket-activate`, or by the daemon itself from `[server]`).
    pub fn release_port(&self) {
        if let Ok(mut sockets) = self.sockets.lock()
            && let Some(Sockets {
                control: Some(_), ..
            }) = sockets.take()
        {
            let _ = std::fs::remove_file(self.path().join("control.sock"));
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn config_path(&self) -> PathBuf {
        self.path().join("agentgate.toml")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state_dir.clone()
    }

    /// Writes the config: `state_dir` and `[server] listen` are filled in, `body` is the rest.
    pub fn write_config(&self, body: &str) {
        self.write_config_with_state(body, &self.state_dir());
    }

    pub fn write_config_with_state(&self, body: &str, state_dir: &Path) {
        let text = format!(
            "state_dir = {:?}\n\n[server]\nlisten = \"127.0.0.1:{}\"\ncontrol_socket = {:?}\nheader_timeout = \"1s\"\nmax_body = \"64KiB\"\n\n{body}",
            state_dir.display(),
            self.port,
            self.path().join("control.sock").display(),
        );
        std::fs::write(self.config_path(), text).expect("write config");
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The address of the metrics listener the workspace's daemons are passed (as systemd
    /// passes a socket named `metrics`), bound at the first call and kept for the workspace's
    /// life: no race for a free port.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.extra_socket(|sockets| &mut sockets.metrics)
    }

    /// The same for the console listener (a socket named `console`).
    pub fn console_addr(&self) -> SocketAddr {
        self.extra_socket(|sockets| &mut sockets.console)
    }

    fn extra_socket(
        &self,
        which: impl FnOnce(&mut Sockets) -> &mut Option<TcpListener>,
    ) -> SocketAddr {
        let mut sockets = self.sockets.lock().expect("the workspace's sockets");
        let sockets = sockets
            .as_mut()
            .expect("the workspace's sockets are not released");
        which(sockets)
            .get_or_insert_with(|| TcpListener::bind("127.0.0.1:0").expect("a loopback socket"))
            .local_addr()
            .expect("its address")
    }

    /// Marks event `id`'s delivery failed, as if every attempt had failed (the real way takes
    /// 16 attempts over hours of backoff).
    pub fn fail_delivery(&self, id: &str) {
        let database = rusqlite::Connection::open(self.state_dir().join("agentgate.db"))
            .expect("open the database");
        database
            .busy_timeout(Duration::from_secs(5))
            .expect("busy timeout");
        database
            .execute(
                "UPDATE deliveries SET status = 'failed', attempts = 16, last_error = 'receiver down' WHERE event_id = ?1",
                [id],
            )
            .expect("fail the delivery");
    }

    /// Runs an `agentgate` subcommand with this workspace's config and returns its output.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(self.config_path())
            .env_remove("AGENTGATE_CONFIG")
            .env_remove("NOTIFY_SOCKET")
            .output()
            .expect("run agentgate")
    }

    /// Runs an `agentgate` subcommand that prints JSON, and parses it.
    pub fn cli_json(&self, args: &[&str]) -> serde_json::Value {
        let output = self.cli(args);
        assert!(output.status.success(), "{args:?}: {output:?}");
        serde_json::from_slice(&output.stdout).expect("the command prints JSON")
    }

    /// `GET /metrics` on the control socket: the exposition's text.
    pub fn metrics(&self) -> String {
        control_request(&self.path().join("control.sock"), "GET", "/metrics").body
    }

    /// `agentgate status --json`.
    pub fn status(&self) -> serde_json::Value {
        let output = self.cli(&["status", "--json"]);
        assert!(output.status.success(), "status failed: {output:?}");
        serde_json::from_slice(&output.stdout).expect("status --json is JSON")
    }

    /// Runs a query on the state database (read-only, while the daemon may run).
    pub fn query<T>(
        &self,
        sql: &str,
        map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Vec<T> {
        let connection = rusqlite::Connection::open_with_flags(
            self.state_dir().join("agentgate.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .expect("open the state database");
        connection
            .busy_timeout(Duration::from_secs(5))
            .expect("busy timeout");
        let mut statement = connection.prepare(sql).expect("prepare");
        statement
            .query_map([], map)
            .expect("query")
            .collect::<rusqlite::Result<Vec<T>>>()
            .expect("rows")
    }

    /// The status of event `id`.
    pub fn event_status(&self, id: &str) -> String {
        self.query(
            &format!("SELECT status FROM events WHERE id = '{id}'"),
            |row| row.get(0),
        )
        .pop()
        .unwrap_or_default()
    }

    /// Waits until event `id` has one of the terminal statuses and returns it.
    pub fn wait_terminal(&self, id: &str, limit: Duration) -> String {
        let mut status = String::new();
        wait_until(&format!("event {id} to end"), limit, || {
            status = self.event_status(id);
            matches!(
                status.as_str(),
                "completed" | "failed" | "abandoned" | "suspended"
            )
        });
        status
    }

    /// `sessions show KEY --json`.
    pub fn session_json(&self, key: &str) -> serde_json::Value {
        let output = self.cli(&["sessions", "show", key, "--json"]);
        assert!(output.status.success(), "sessions show failed: {output:?}");
        serde_json::from_slice(&output.stdout).expect("sessions show --json is JSON")
    }

    pub fn events_total(&self) -> i64 {
        self.status()["events"]["total"]
            .as_i64()
            .expect("events.total")
    }

    /// Starts `agentgate serve` and waits until /healthz answers.
    pub fn start(&self) -> Daemon {
        self.start_with_env(&[])
    }

    pub fn start_with_env(&self, env: &[(&str, &str)]) -> Daemon {
        let addr = self.addr();
        self.start_with(env, || {
            try_request(addr, "GET", "/healthz", &[], b"").is_ok_and(|r| r.status == 200)
        })
    }

    /// Starts `agentgate serve` and waits until `ready` says it serves.
    pub fn start_with(&self, env: &[(&str, &str)], ready: impl FnMut() -> bool) -> Daemon {
        self.spawn(self.serve_command(&[]), env, ready)
    }

    /// Starts `agentgate serve` run by `wrapper` (e.g. `prlimit ...`) and waits until /healthz
    /// answers.
    pub fn start_wrapped(&self, wrapper: &[&str]) -> Daemon {
        let addr = self.addr();
        self.spawn(self.serve_command(wrapper), &[], || {
            try_request(addr, "GET", "/healthz", &[], b"").is_ok_and(|r| r.status == 200)
        })
    }

    /// `agentgate serve` with this workspace's config, run by `wrapper` (e.g. `strace ...`) if
    /// one is given. The workspace's sockets are passed as systemd passes them (from fd 3 on,
    /// named `webhook`, `control`, and `metrics` and `console` when the test asked for them; a
    /// shell sets `LISTEN_PID` to its own pid and execs the daemon, which keeps it); once they
    /// are released, the daemon binds `[server] listen` and `control_socket` itself.
    pub fn serve_command(&self, wrapper: &[&str]) -> Command {
        let passed = self.passed_sockets();
        let mut argv: Vec<std::ffi::OsString> = wrapper.iter().map(Into::into).collect();
        if !passed.is_empty() {
            argv.extend(["/bin/sh", "-c", "LISTEN_PID=$$ exec \"$0\" \"$@\""].map(Into::into));
        }
        argv.extend([BIN, "serve", "--config"].map(Into::into));
        argv.push(self.config_path().into());
        let mut command = Command::new(&argv[0]);
        command.args(&argv[1..]).env_remove("LISTEN_PID");
        if passed.is_empty() {
            command
                .env_remove("LISTEN_FDS")
                .env_remove("LISTEN_FDNAMES");
            return command;
        }
        let names: Vec<&str> = passed.iter().map(|(name, _)| *name).collect();
        command
            .env("LISTEN_FDS", passed.len().to_string())
            .env("LISTEN_FDNAMES", names.join(":"));
        let mappings = passed
            .into_iter()
            .zip(3..)
            .map(|((_, parent_fd), child_fd)| FdMapping {
                parent_fd,
                child_fd,
            })
            .collect();
        command.fd_mappings(mappings).expect("the socket mappings");
        command
    }

    /// Copies of the sockets to pass, by name (none once released); the control socket is
    /// bound at the first call.
    fn passed_sockets(&self) -> Vec<(&'static str, std::os::fd::OwnedFd)> {
        let Ok(mut sockets) = self.sockets.lock() else {
            return Vec::new();
        };
        let Some(sockets) = sockets.as_mut() else {
            return Vec::new();
        };
        let control = sockets.control.get_or_insert_with(|| {
            let path = self.path().join("control.sock");
            let control = UnixListener::bind(&path).expect("the control socket");
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o660))
                .expect("chmod the control socket");
            control
        });
        let copy = |socket: &TcpListener| socket.try_clone().expect("a copy of a socket").into();
        let mut passed = vec![
            ("webhook", copy(&sockets.webhook)),
            (
                "control",
                control
                    .try_clone()
                    .expect("a copy of the control socket")
                    .into(),
            ),
        ];
        passed.extend(
            sockets
                .metrics
                .as_ref()
                .map(|socket| ("metrics", copy(socket))),
        );
        passed.extend(
            sockets
                .console
                .as_ref()
                .map(|socket| ("console", copy(socket))),
        );
        passed
    }

    fn spawn(
        &self,
        mut command: Command,
        env: &[(&str, &str)],
        mut ready: impl FnMut() -> bool,
    ) -> Daemon {
        command
            .env_remove("NOTIFY_SOCKET")
            .env_remove("JOURNAL_STREAM")
            .env("AGENTGATE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("spawn agentgate serve");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Ok(mut text) = sink.lock() {
                    text.push_str(&line);
                    text.push('\n');
                }
            }
        });
        let mut daemon = Daemon {
            child,
            log,
            addr: self.addr(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if ready() {
                return daemon;
            }
            if let Ok(Some(status)) = daemon.child.try_wait() {
                // What it said before it exited may still be in the pipe.
                let read_by = Instant::now() + Duration::from_secs(2);
                while !reader.is_finished() && Instant::now() < read_by {
                    std::thread::sleep(Duration::from_millis(10));
                }
                panic!(
                    "agentgate exited with {status} before serving:\n{}",
                    daemon.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "agentgate did not become ready:\n{}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A running daemon; killed on drop.
pub struct Daemon {
    pub child: Child,
    log: Arc<Mutex<String>>,
    pub addr: SocketAddr,
}

impl Daemon {
    pub fn log(&self) -> String {
        self.log.lock().map(|t| t.clone()).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the daemon's log says `text` (up to 10 s).
    pub fn wait_for_log(&self, text: &str) {
        wait_until(
            &format!("the log to say {text:?}"),
            Duration::from_secs(10),
            || self.log().contains(text),
        );
    }

    /// Sends SIGTERM and waits for the exit status; fails the test if the daemon has not exited
    /// after the longest drain the stop sequence allows (90 s).
    pub fn terminate(mut self) -> std::process::ExitStatus {
        signal(self.child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for agentgate") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agentgate did not exit within 90 s of SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HttpResponse {
        try_request(self.addr, method, path, headers, body).expect("HTTP request")
    }

    pub fn post_json(&self, path: &str, headers: &[(&str, &str)], body: &str) -> HttpResponse {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        self.request("POST", path, &all, body.as_bytes())
    }

    /// Peak resident memory in KiB (VmHWM).
    pub fn peak_rss_kib(&self) -> u64 {
        proc_status_kib(self.child.id(), "VmHWM:")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A child process killed (and reaped) on drop, so that a failed assertion leaves nothing
/// running behind it.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether process `pid` runs (a zombie waiting to be reaped does not).
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            != Some("Z")
    })
}

pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(status.success());
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|err| panic!("body is not JSON ({err}): {}", self.body))
    }

    /// The `event_id` of an accepted (202) or duplicate (200) answer.
    pub fn event_id(&self) -> String {
        self.json()["event_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no event_id in {}", self.body))
            .to_string()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One request on a fresh connection, `Connection: close`.
pub fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    read_response(&mut stream)
}

/// A TCP connection to `addr` from the loopback address `source` (127.0.0.0/8 is all this
/// machine's), as a second sender would make: one address's connections are counted apart from
/// another's (`server.max_connections_per_peer`).
pub fn connect_from(source: std::net::Ipv4Addr, addr: SocketAddr) -> std::io::Result<TcpStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    socket.bind(&SockAddr::from(SocketAddr::from((source, 0))))?;
    socket.connect(&SockAddr::from(addr))?;
    Ok(socket.into())
}

/// Reads a whole `Connection: close` response.
pub fn read_response(stream: &mut TcpStream) -> std::io::Result<HttpResponse> {
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

/// One request on a control socket (Unix), its connection closed after the answer.
pub fn control_request(path: &std::path::Path, method: &str, target: &str) -> HttpResponse {
    let mut stream = std::os::unix::net::UnixStream::connect(path).expect("connect control socket");
    stream
        .write_all(format!("{method} {target} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: 0\r\n\r\n").as_bytes())
        .expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read");
    parse_response(&raw).expect("response")
}

pub fn parse_response(raw: &[u8]) -> std::io::Result<HttpResponse> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("incomplete response: {text:?}")))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {head:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(HttpResponse {
        status,
        headers,
        body: body.to_string(),
    })
}

/// HMAC-SHA256 in hex, for tests that sign raw requests themselves.
pub fn hmac_sha256_hex(key: &[u8], message: &[u8]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(key).expect("hmac key");
    mac.update(message);
    hex::encode(mac.finalize().into_bytes())
}

/// A self-signed certificate for 127.0.0.1 with the common name `name`, written to
/// `cert.pem` and `key.pem` in `dir` (replacing them, as a renewal does).
pub fn self_signed(dir: &std::path::Path, name: &str) {
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ])
        .arg("-keyout")
        .arg(dir.join("key.pem"))
        .arg("-out")
        .arg(dir.join("cert.pem"))
        .args(["-days", "2", "-subj", &format!("/CN={name}")])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        // A server's certificate, not a CA's: rustls refuses a CA certificate as a server's.
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .output()
        .expect("run openssl");
    assert!(made.status.success(), "{made:?}");
}
