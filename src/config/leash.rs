//! The agent cannot loosen its own leash (docs/tools.md, "Sandbox"): whoever can write the config
//! file, a secret or a credential can change what the tools may do (widen a sandbox, add a tool,
//! take a secret), so none of them may be writable by the service's user, nor lie inside a
//! tool's `writable` paths. `check-config` looks at who may write them by their owners and modes
//! (it usually runs as root, who may write anything); `serve` asks the kernel whether it, the
//! service's user, may.

use std::path::{Path, PathBuf};

use super::{Config, ConfigSource, DeliverSettings, McpTransport, Sandboxing};

/// Whose writing is looked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writer {
    /// This process (`serve`, as the service's user).
    ThisProcess,
    /// Any user but root, by owner, group and mode (`check-config`).
    AnyoneButRoot,
}

/// What could loosen the leash: one line per finding, naming the path.
pub(crate) fn loosened(config: &Config, source: &ConfigSource, writer: Writer) -> Vec<String> {
    let protected = protected_paths(config, source);
    let mut findings = Vec::new();
    for path in &protected {
        if writable(path, writer) {
            let who = match writer {
                Writer::ThisProcess => "the service's user",
                Writer::AnyoneButRoot => "a user other than root",
            };
            findings.push(format!(
                "{} is writable by {who}: whoever writes it decides what the tools may do; \
                 make it writable by root only",
                path.display()
            ));
        }
    }
    for (key, writable_paths) in writable_paths(config) {
        for inside in writable_paths.iter().flat_map(|dir| {
            protected
                .iter()
                .filter(move |path| path.starts_with(dir))
                .map(move |path| (dir, path))
        }) {
            findings.push(format!(
                "{key}.writable includes {} ({}): keep what configures agentgate out of a tool's reach",
                inside.0.display(),
                inside.1.display()
            ));
        }
    }
    findings
}

/// The config file and its directory, every secret file, the credentials directory.
fn protected_paths(config: &Config, source: &ConfigSource) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let ConfigSource::File(file) = source {
        paths.push(file.clone());
        paths.extend(file.parent().map(Path::to_path_buf));
    }
    let control_socket = &config.server.control_socket;
    paths.extend(
        config
            .hidden
            .files
            .iter()
            .filter(|file| *file != control_socket)
            .cloned(),
    );
    // The state directory is the service's to write; the credentials directory is not.
    paths.extend(
        config
            .hidden
            .dirs
            .iter()
            .filter(|dir| **dir != config.state_dir)
            .cloned(),
    );
    paths.sort();
    paths.dedup();
    paths.retain(|path| path.exists());
    paths
}

/// The `writable` paths of every strict child, by its config key.
fn writable_paths(config: &Config) -> Vec<(String, Vec<PathBuf>)> {
    let strict = |sandbox: &Sandboxing| match sandbox {
        Sandboxing::Strict { writable, .. } => Some(writable.clone()),
        Sandboxing::Off => None,
    };
    let tools = config
        .tools
        .values()
        .filter_map(|tool| Some((format!("tools.{}", tool.name), strict(&tool.sandbox)?)));
    let servers = config
        .mcp
        .values()
        .filter_map(|server| match &server.transport {
            McpTransport::Stdio { sandbox, .. } => {
                Some((format!("mcp.{}", server.name), strict(sandbox)?))
            }
            McpTransport::Http { .. } => None,
        });
    let deliveries = config
        .routes
        .iter()
        .filter_map(|route| match &route.deliver {
            DeliverSettings::Command { sandbox, .. } => {
                Some((format!("routes.{}.deliver", route.name), strict(sandbox)?))
            }
            DeliverSettings::Log | DeliverSettings::Http { .. } => None,
        });
    tools.chain(servers).chain(deliveries).collect()
}

fn writable(path: &Path, writer: Writer) -> bool {
    use std::os::unix::fs::MetadataExt;
    match writer {
        Writer::ThisProcess => nix::unistd::access(path, nix::unistd::AccessFlags::W_OK).is_ok(),
        Writer::AnyoneButRoot => std::fs::metadata(path).is_ok_and(|metadata| {
            let mode = metadata.mode();
            (metadata.uid() != 0 && mode & 0o200 != 0)
                || (metadata.gid() != 0 && mode & 0o020 != 0)
                || mode & 0o002 != 0
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_world_writable_secret_is_found_and_a_root_only_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = dir.path().join("open.secret");
        std::fs::write(&open, "s").expect("write");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        assert!(writable(&open, Writer::AnyoneButRoot));
        let closed = dir.path().join("closed.secret");
        std::fs::write(&closed, "s").expect("write");
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        // Its owner is whoever runs the test: root (as CI does), or another user who may write it.
        assert_eq!(
            writable(&closed, Writer::AnyoneButRoot),
            !nix::unistd::geteuid().is_root()
        );
    }
}
