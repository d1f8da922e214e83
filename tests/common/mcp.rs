//! The MCP servers tests run against, as `tests/mcp/install` puts them under `tests/mcp/`: the
//! reference servers from npm, and a server of the official Python SDK.

use std::path::PathBuf;
use std::time::Duration;

use super::{Workspace, free_port, wait_until};

const START_LIMIT: Duration = Duration::from_secs(60);

/// What `tests/mcp/install` puts in place, relative to `tests/mcp/`.
const INSTALLED: [&str; 3] = [
    "node_modules/.bin/mcp-server-everything",
    "node_modules/.bin/mcp-server-filesystem",
    "venv/bin/python",
];

fn path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/mcp")
        .join(relative)
}

/// Whether a test that runs the MCP servers can run (see [`super::can_run`]).
pub fn servers_or_skip(test: &str) -> bool {
    let present = INSTALLED.iter().all(|relative| path(relative).exists());
    super::can_run(test, super::Need::Mcp, present)
}

pub fn installed(relative: &str) -> String {
    let path = path(relative);
    assert!(
        path.exists(),
        "{} is missing: `tests/setup` (or `tests/mcp/install`) installs the MCP servers",
        path.display()
    );
    path.display().to_string()
}

pub fn node_server(name: &str) -> String {
    installed(&format!("node_modules/.bin/{name}"))
}

/// The pids of the daemon's children whose command line contains `marker`.
pub fn children_of(daemon_pid: u32, marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let Some(parent) = fields.get(1) else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if super::process_alive(pid as u32)
            && parent.parse::<u32>() == Ok(daemon_pid)
            && String::from_utf8_lossy(&cmdline).contains(marker)
        {
            found.push(pid);
        }
    }
    found
}

/// The `[mcp.NAME]` table of `tests/mcp/memo_server.py` (a stdio server that remembers what it is
/// given), with `extra` lines. `tag` is added to its command line, so that
/// [`processes_with`] finds this test's processes of it and no other test's.
pub fn memo_server(name: &str, tag: &str, extra: &str) -> String {
    format!(
        "[mcp.{name}]\ncommand = [{:?}, {:?}, {tag:?}]\n{extra}\n",
        installed("venv/bin/python"),
        installed("memo_server.py"),
    )
}

/// Every live process (of any parent) whose command line contains each of `markers`: its pid
/// and its program (`argv[0]`), by pid.
pub fn processes_with(markers: &[&str]) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if markers.iter().all(|marker| cmdline.contains(marker)) && super::process_alive(pid as u32)
        {
            let program = cmdline.split('\0').next().unwrap_or_default();
            found.push((pid, program.to_string()));
        }
    }
    found.sort_unstable();
    found
}

/// The Python SDK's server on the streamable HTTP transport (`tests/mcp/http_server.py`);
/// killed on drop.
pub struct PythonServer {
    _child: super::KillOnDrop,
    port: u16,
    /// Where it appends the key and text of every `shout` call.
    calls: PathBuf,
}

impl PythonServer {
    pub const TOKEN: &str = "token-from-a-secret";

    pub fn start(workspace: &Workspace) -> PythonServer {
        let port = free_port();
        let calls = workspace.path().join("calls.txt");
        let child = std::process::Command::new(installed("venv/bin/python"))
            .arg(installed("http_server.py"))
            .arg(port.to_string())
            .arg(Self::TOKEN)
            .arg(&calls)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the Python MCP server");
        let server = PythonServer {
            _child: super::KillOnDrop(child),
            port,
            calls,
        };
        wait_until("the Python MCP server to listen", START_LIMIT, || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        std::fs::write(workspace.path().join("token"), format!("{}\n", Self::TOKEN))
            .expect("secret");
        server
    }

    /// The `shout` calls it served: (call key, text), in order.
    pub fn calls(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.split_once(' '))
            .map(|(key, text)| (key.to_string(), text.to_string()))
            .collect()
    }

    /// The `traceparent` each `shout` call carried in its `_meta` ("-" for none), in order.
    pub fn traceparents(&self) -> Vec<String> {
        self.trace_lines(0)
    }

    /// The `traceparent` HTTP header of each `shout` call's request, in order ("-" for none).
    pub fn header_traceparents(&self) -> Vec<String> {
        self.trace_lines(1)
    }

    /// Field `field` of each line of the calls' trace file.
    fn trace_lines(&self, field: usize) -> Vec<String> {
        let mut path = self.calls.clone().into_os_string();
        path.push(".trace");
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|line| line.split(' ').nth(field).unwrap_or("-").to_string())
            .collect()
    }

    /// Its `[mcp.web]` table, with the token header from a secret file.
    pub fn config(&self, workspace: &Workspace) -> String {
        format!(
            "[mcp.web]\nurl = \"http://127.0.0.1:{}/mcp\"\nheaders = {{ X-Test-Token = {{ file = {:?} }} }}\n",
            self.port,
            workspace.path().join("token").display().to_string(),
        )
    }
}
