//! `sandbox`, `network` and `writable` of command tools, stdio MCP servers and command
//! deliveries, and the paths no sandboxed process may see (docs/tools.md, "Sandbox").

use std::path::PathBuf;

use super::Checker;
use crate::config::leash::ALWAYS_HIDDEN;
use crate::config::settings::{HiddenPaths, PostgresSettings, Sandboxing, StoreSettings};

/// The three keys as the config file has them.
pub(super) struct RawSandbox {
    pub sandbox: Option<String>,
    pub network: Option<bool>,
    pub writable: Option<Vec<PathBuf>>,
}

impl Checker<'_> {
    /// The sandboxing of the child that `prefix` configures: strict unless it says otherwise.
    pub(super) fn sandboxing(&mut self, prefix: &str, raw: RawSandbox) -> Sandboxing {
        match raw.sandbox.as_deref() {
            None | Some("strict") => {}
            Some("none") => {
                for (key, set) in [
                    ("network", raw.network.is_some()),
                    ("writable", raw.writable.is_some()),
                ] {
                    if set {
                        self.warn(
                            &format!("{prefix}.{key}"),
                            "has no effect with sandbox = \"none\"",
                        );
                    }
                }
                self.warn(
                    &format!("{prefix}.sandbox"),
                    "sandbox = \"none\": it runs as the daemon's user and can read the state \
                     (every session's payloads and transcripts), the credentials and the control \
                     socket; a prompt-injected model can make it do so",
                );
                return Sandboxing::Off;
            }
            Some(other) => {
                self.error(
                    &format!("{prefix}.sandbox"),
                    format!("unknown sandbox {other:?}; use strict or none"),
                );
            }
        }
        let writable = raw.writable.unwrap_or_default();
        for path in &writable {
            let key = format!("{prefix}.writable");
            if !path.is_absolute() {
                self.error(&key, format!("{} is not an absolute path", path.display()));
            } else if !path.exists() {
                self.warn(
                    &key,
                    format!(
                        "{} does not exist; the tool cannot write there until it does",
                        path.display()
                    ),
                );
            }
        }
        Sandboxing::Strict {
            network: raw.network.unwrap_or(false),
            writable,
        }
    }

    /// A strict child gets a private, empty `/tmp`: a program, script or working directory
    /// under `/tmp` that its argv or `cwd` names is not there for it (a warning: the call fails).
    pub(super) fn private_tmp(&mut self, prefix: &str, sandbox: &Sandboxing, paths: Vec<PathBuf>) {
        let strict = match sandbox {
            Sandboxing::Strict { .. } => true,
            Sandboxing::Off => false,
        };
        if let Some(path) = paths.iter().find(|path| strict && path.starts_with("/tmp")) {
            self.warn(
                prefix,
                format!(
                    "{} is under /tmp, which a strict sandbox replaces with a private, empty one: \
                     the process will not find it; move it, or set sandbox = \"none\"",
                    path.display()
                ),
            );
        }
    }

    /// What no sandboxed process may see: the state directory, the credentials directory, the
    /// control socket, the config file, every secret file the config names, and what is hidden
    /// whatever the config says ([`ALWAYS_HIDDEN`]).
    pub(super) fn hidden_paths(
        &self,
        state_dir: &std::path::Path,
        control_socket: Option<&std::path::Path>,
        store: Option<&StoreSettings>,
    ) -> HiddenPaths {
        let mut dirs = vec![state_dir.to_path_buf()];
        dirs.extend(self.environment.credentials_dir.map(PathBuf::from));
        dirs.extend(ALWAYS_HIDDEN.iter().map(PathBuf::from));
        let mut files = self.secret_files.clone();
        files.extend(control_socket.map(std::path::Path::to_path_buf));
        if let Some(StoreSettings::Postgres(postgres)) = store {
            files.extend(store_sockets(postgres));
        }
        HiddenPaths { dirs, files }
    }
}

/// The Unix sockets of a PostgreSQL store's URL (`host=/run/postgresql`): with peer
/// authentication, a process of the service's user that reached one would have the database,
/// that is, the state.
fn store_sockets(postgres: &PostgresSettings) -> Vec<PathBuf> {
    use tokio_postgres::config::Host;
    let Some(config) = std::str::from_utf8(postgres.url.expose())
        .ok()
        .and_then(|text| text.trim().parse::<tokio_postgres::Config>().ok())
    else {
        return Vec::new();
    };
    let ports = config.get_ports();
    config
        .get_hosts()
        .iter()
        .enumerate()
        .filter_map(|(index, host)| match host {
            Host::Unix(dir) => {
                let port = ports
                    .get(index)
                    .or_else(|| ports.first())
                    .copied()
                    .unwrap_or(5432);
                Some(dir.join(format!(".s.PGSQL.{port}")))
            }
            Host::Tcp(_) => None,
        })
        .collect()
}
