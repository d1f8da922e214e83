//! A throwaway PostgreSQL server for a test: its own data directory, a free loopback port, trust
//! authentication, stopped and removed on drop. Debian's server binaries are used (`tests/setup`
//! installs them); as root the server runs as the `postgres` user, which refuses to run as root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use super::basics::{Need, can_run, free_port, is_root, wait_until};

pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    /// Extra server settings (`-c name=value ...`).
    settings: String,
}

/// The directory of Debian's PostgreSQL server binaries, newest version first.
fn server_bin() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop()
}

impl Postgres {
    /// Starts a server; without Debian's server binaries, see [`can_run`].
    pub fn start(test: &str) -> Option<Postgres> {
        Postgres::start_configured(test, false)
    }

    /// A server that also accepts TLS, with a certificate for 127.0.0.1 signed by a test CA
    /// (`ca.pem` in the returned directory).
    pub fn start_with_tls(test: &str) -> Option<(Postgres, PathBuf)> {
        let server = Postgres::start_configured(test, true)?;
        let ca = server.dir.path().join("ca.pem");
        Some((server, ca))
    }

    fn start_configured(test: &str, tls: bool) -> Option<Postgres> {
        let bin = server_bin();
        if !can_run(test, Need::Postgres, bin.is_some()) {
            return None;
        }
        let bin = bin?;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut server = Postgres {
            dir,
            bin,
            port: free_port(),
            settings: String::new(),
        };
        if is_root() {
            // The server's user must reach its data directory through the temp dir.
            std::fs::set_permissions(
                server.dir.path(),
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )
            .expect("chmod");
            let data = server.data();
            std::fs::create_dir(&data).expect("data dir");
            let status = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&data)
                .status()
                .expect("chown");
            assert!(status.success(), "chown postgres {}", data.display());
        }
        let output = server.as_server_user(
            Command::new(server.bin.join("initdb"))
                .arg("-D")
                .arg(server.data())
                .args(["-U", "agentgate", "--auth=trust", "-E", "UTF8", "--no-sync"]),
        );
        assert!(output.status.success(), "initdb failed: {output:?}");
        if tls {
            server.make_certificates();
            server.settings =
                "-c ssl=on -c ssl_cert_file=server.pem -c ssl_key_file=server.key".into();
        }
        // The port was free when it was picked; another process may bind it before the server
        // does, so a start that cannot bind tries another one.
        for _ in 0..5 {
            match server.try_start() {
                Ok(()) => break,
                Err(log) if log.contains("could not bind") || log.contains("already in use") => {
                    server.port = free_port();
                }
                Err(log) => panic!("pg_ctl start failed: {log}"),
            }
        }
        server.wait_for_connections();
        let created = server.psql("postgres", "CREATE DATABASE agentgate");
        assert!(created.is_some(), "cannot create the test database");
        Some(server)
    }

    /// A CA, and a server certificate for 127.0.0.1 in the data directory (owned by the server).
    fn make_certificates(&self) {
        let dir = self.dir.path();
        let openssl = |args: &[&str]| {
            let output = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .expect("run openssl");
            assert!(output.status.success(), "openssl {args:?}: {output:?}");
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=agentgate test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").expect("san");
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ]);
        for name in ["server.pem", "server.key"] {
            let target = self.data().join(name);
            std::fs::copy(dir.join(name), &target).expect("copy certificate");
            std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .expect("chmod");
            if is_root() {
                let status = Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(&target)
                    .status()
                    .expect("chown");
                assert!(status.success());
            }
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn as_server_user(&self, command: &mut Command) -> Output {
        let command = if is_root() {
            let mut wrapped = Command::new("runuser");
            wrapped
                .args(["-u", "postgres", "--"])
                .arg(command.get_program())
                .args(command.get_args());
            wrapped.output()
        } else {
            command.output()
        };
        command.expect("run a PostgreSQL command")
    }

    /// The URL agentgate connects with.
    pub fn url(&self) -> String {
        format!("postgres://agentgate@127.0.0.1:{}/agentgate", self.port)
    }

    /// Writes the URL into a file for `url = { file = ... }`.
    pub fn url_file(&self, dir: &Path) -> PathBuf {
        let path = dir.join("pg-url");
        std::fs::write(&path, format!("{}\n", self.url())).expect("write url file");
        path
    }

    /// Starts the (stopped) server and waits until it accepts connections.
    pub fn start_again(&self) {
        if let Err(log) = self.try_start() {
            panic!("pg_ctl start failed: {log}");
        }
        self.wait_for_connections();
    }

    /// Starts the server; `Err` has what pg_ctl and the server's log said.
    fn try_start(&self) -> Result<(), String> {
        let output = self.as_server_user(
            Command::new(self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(self.data().join("server.log"))
                .arg("-o")
                .arg(format!(
                    "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={} -c max_connections=300 {}",
                    self.port,
                    self.data().display(),
                    self.settings
                ))
                .args(["-w", "start"]),
        );
        if output.status.success() {
            return Ok(());
        }
        let log = std::fs::read_to_string(self.data().join("server.log")).unwrap_or_default();
        Err(format!("{output:?}\n{log}"))
    }

    fn wait_for_connections(&self) {
        wait_until(
            "PostgreSQL to accept connections",
            Duration::from_secs(30),
            || self.psql("postgres", "SELECT 1").is_some(),
        );
    }

    /// Stops the server at once (`-m fast`: sessions are cut off, committed data stays).
    pub fn stop(&self) {
        let output = self.as_server_user(
            Command::new(self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .args(["-m", "fast", "-w", "stop"]),
        );
        assert!(output.status.success(), "pg_ctl stop failed: {output:?}");
    }

    /// Runs one statement with psql; its unaligned output, or `None` when it failed.
    pub fn psql(&self, database: &str, sql: &str) -> Option<String> {
        let output = Command::new(self.bin.join("psql"))
            .args(["-h", "127.0.0.1", "-U", "agentgate", "-At", "-F", "|", "-v"])
            .arg("ON_ERROR_STOP=1")
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-d")
            .arg(database)
            .arg("-c")
            .arg(sql)
            .output()
            .ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
    }

    /// A transaction on the agentgate database that has run `sql` and stays open, holding the
    /// locks it took, until the returned handle is dropped.
    pub fn open_transaction(&self, sql: &str) -> OpenTransaction {
        use std::io::{BufRead, Write};
        let mut child = Command::new(self.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "agentgate",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
            ])
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-d", "agentgate"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("psql");
        let mut input = child.stdin.take().expect("psql's input");
        writeln!(input, "BEGIN;\n{sql};\nSELECT 'open';").expect("write to psql");
        let output = child.stdout.take().expect("psql's output");
        let open = std::io::BufReader::new(output)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "open");
        assert!(open, "psql ended before the transaction was open: {sql}");
        OpenTransaction {
            child,
            input: Some(input),
        }
    }

    /// Rows of a query on the agentgate database, each split into its columns.
    pub fn rows(&self, sql: &str) -> Vec<Vec<String>> {
        let text = self
            .psql("agentgate", sql)
            .unwrap_or_else(|| panic!("query failed: {sql}"));
        text.lines()
            .filter(|line| !line.is_empty())
            .map(|line| line.split('|').map(str::to_string).collect())
            .collect()
    }

    /// A single value.
    pub fn value(&self, sql: &str) -> String {
        self.psql("agentgate", sql)
            .unwrap_or_else(|| panic!("query failed: {sql}"))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.as_server_user(
            Command::new(self.bin.join("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .args(["-m", "immediate", "-w", "stop"]),
        );
    }
}

/// An open transaction (`Postgres::open_transaction`): rolled back when dropped (psql's input
/// closes, and psql ends).
pub struct OpenTransaction {
    child: std::process::Child,
    input: Option<std::process::ChildStdin>,
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        drop(self.input.take());
        let _ = self.child.wait();
    }
}
