//! The agent cannot loosen its own leash (docs/tools.md, "Sandbox"): whoever can write the config
//! file, a secret or a credential can change what the tools may do (widen a sandbox, add a tool,
//! take a secret), so none of them may be writable by the service's user, nor lie inside a
//! tool's `writable` paths. `check-config` looks at who may write them by their owners and modes
//! (it usually runs as root, who may write anything); `serve` asks the kernel whether it, the
//! service's user, may. A `writable` path that holds anything a sandbox hides makes the config
//! invalid ([`writable_holding_hidden`]).
//!
//! The floor of every sandbox is here too: what is hidden whatever the config says
//! ([`ALWAYS_HIDDEN`]), and what a tool unit reads from the config file itself ([`floor`]), so
//! that the unit, not the request it is sent, decides the least a call may be denied.

use std::path::{Path, PathBuf};

use super::{
    Config, ConfigError, ConfigSource, DEFAULT_CONTROL_SOCKET, HiddenPaths, read_source,
    resolve_state_dir,
};

/// Directories no sandboxed process sees, whatever the config says: the packaged state
/// directory, the runtime directory of the control and tool sockets, the credentials systemd
/// hands any unit, and the credentials store that README.Debian sets up.
pub(crate) const ALWAYS_HIDDEN: [&str; 4] = [
    "/var/lib/agentgate",
    "/run/agentgate",
    "/run/credentials",
    "/etc/agentgate/credentials",
];

/// `path` as a sandbox must name it: absolute (relative to the working directory), and with its
/// symbolic links resolved where it exists, so that what is hidden is the file itself and not
/// one name for it.
pub(crate) fn resolved(path: &Path) -> PathBuf {
    std::fs::canonicalize(path)
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf())
}

/// The credential under which the tool unit templates hand `tool-exec` the config
/// (`LoadCredential=`, read by systemd as root): a tool unit runs as a user of its own, which may
/// not read the file itself.
pub(crate) const CONFIG_CREDENTIAL: &str = "agentgate.toml";

/// What a tool unit hides from every call whatever its request says, read by `tool-exec` from
/// the config file (root's, which no tool can write), or from its copy in the unit's
/// credentials ([`CONFIG_CREDENTIAL`]) when there is one: [`ALWAYS_HIDDEN`], the config's state
/// directory and control socket, every `{ file = … }` secret it names, and the file itself with
/// its copies beside it. Only those keys are read, so a config the daemon would refuse elsewhere
/// still yields them; one that cannot be read or parsed at all is an error (the call is then
/// refused: what it names could not be hidden).
pub(crate) fn floor(source: &ConfigSource) -> Result<HiddenPaths, ConfigError> {
    let credential = std::env::var_os("CREDENTIALS_DIRECTORY")
        .map(|dir| PathBuf::from(dir).join(CONFIG_CREDENTIAL))
        .filter(|copy| copy.is_file());
    let text = match credential {
        Some(copy) => read_source(&ConfigSource::File(copy))?,
        None => read_source(source)?,
    };
    let document: toml::Table = toml::from_str(&text).map_err(|err| ConfigError::Invalid {
        source_name: source.clone(),
        findings: vec![super::syntax_finding(&err, &super::Locator::new(&text))],
    })?;
    let path_at = |table: &toml::Table, key: &str| table.get(key)?.as_str().map(PathBuf::from);
    let mut floor = HiddenPaths {
        dirs: ALWAYS_HIDDEN.iter().map(PathBuf::from).collect(),
        files: Vec::new(),
    };
    floor
        .dirs
        .push(resolve_state_dir(path_at(&document, "state_dir"), None));
    let control_socket = document
        .get("server")
        .and_then(toml::Value::as_table)
        .and_then(|server| path_at(server, "control_socket"))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL_SOCKET));
    floor.files.push(control_socket);
    secret_files(&toml::Value::Table(document), &mut floor.files);
    if let ConfigSource::File(file) = source {
        floor.files.extend(config_files(file));
    }
    Ok(floor)
}

/// The config file and its copies beside it (every file whose name holds the config's), each
/// hidden like the file: an upgrade's `agentgate.toml.dpkg-old` and `.dpkg-dist`, an editor's
/// `agentgate.toml~`, `.agentgate.toml.swp` and `#agentgate.toml#`, an operator's
/// `agentgate.toml.bak` hold what the file holds (perhaps a literal secret, or the one it held
/// before). Read when a sandbox is set up, so a copy made
/// since the start is hidden too.
pub(crate) fn config_files(file: &Path) -> Vec<PathBuf> {
    let mut files = vec![file.to_path_buf()];
    let (Some(dir), Some(name)) = (file.parent(), file.file_name()) else {
        return files;
    };
    let name = name.to_string_lossy();
    let Ok(entries) = std::fs::read_dir(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }) else {
        return files;
    };
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let entry_name = entry_name.to_string_lossy();
        let a_copy = entry_name != name && entry_name.contains(name.as_ref());
        if a_copy && entry.file_type().is_ok_and(|kind| kind.is_file()) {
            files.push(dir.join(entry.file_name()));
        }
    }
    files
}

/// Every `{ file = PATH }` table in `value`: the one form a secret file reference takes.
fn secret_files(value: &toml::Value, found: &mut Vec<PathBuf>) {
    match value {
        toml::Value::Table(table) => {
            if let (1, Some(toml::Value::String(path))) = (table.len(), table.get("file")) {
                found.push(PathBuf::from(path));
            }
            for nested in table.values() {
                secret_files(nested, found);
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                secret_files(item, found);
            }
        }
        toml::Value::String(_)
        | toml::Value::Integer(_)
        | toml::Value::Float(_)
        | toml::Value::Boolean(_)
        | toml::Value::Datetime(_) => {}
    }
}

/// Each strict child's `writable` path that is, or holds, a path every sandbox hides, by its
/// config key: whoever may write a directory may rename what is in it and put something of
/// their own in its place (a secret, a config for the next reload), so such a config is refused.
pub(crate) fn writable_holding_hidden(config: &Config) -> Vec<(String, String)> {
    let hidden: Vec<PathBuf> = config
        .hidden
        .dirs
        .iter()
        .chain(&config.hidden.files)
        .map(|path| resolved(path))
        .collect();
    let mut findings = Vec::new();
    for child in super::strict_children(config) {
        for configured in &child.writable {
            let writable = resolved(configured);
            if let Some(held) = hidden.iter().find(|path| path.starts_with(&writable)) {
                findings.push((
                    format!("{}.writable", child.key),
                    format!(
                        "{}{} holds {}, which no tool may reach: a tool that can write there can \
                         rename it and put its own in its place; name a directory that holds \
                         none of the state, the config, the secrets, the credentials or \
                         agentgate's sockets",
                        link_note(configured, &writable),
                        writable.display(),
                        held.display()
                    ),
                ));
            }
        }
    }
    findings
}

/// Says that `configured` is a symbolic link to `writable`, if it is: a link that whoever may
/// write its directory could have put there (a tool whose own `writable` path holds it).
fn link_note(configured: &Path, writable: &Path) -> String {
    match std::path::absolute(configured) {
        Ok(absolute) if absolute != writable => format!(
            "{} is a symbolic link (check who put it there: whoever may write {} may have); it \
             leads to ",
            configured.display(),
            configured.parent().unwrap_or(configured).display()
        ),
        Ok(_) | Err(_) => String::new(),
    }
}

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
    findings
}

/// The config file and its directory, every secret file, the credentials directories (the
/// state directory and the sockets are the service's own to write).
fn protected_paths(config: &Config, source: &ConfigSource) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let ConfigSource::File(file) = source {
        paths.push(file.clone());
        paths.extend(file.parent().map(Path::to_path_buf));
    }
    let services_own = |path: &&PathBuf| {
        **path == config.state_dir
            || **path == config.server.control_socket
            || ALWAYS_HIDDEN[..3]
                .iter()
                .any(|own| path.as_path() == Path::new(own))
    };
    paths.extend(
        config
            .hidden
            .dirs
            .iter()
            .chain(&config.hidden.files)
            .filter(|path| !services_own(path))
            .cloned(),
    );
    paths.sort();
    paths.dedup();
    paths.retain(|path| path.exists());
    paths
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
    fn the_config_s_copies_beside_it_are_hidden_with_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        for name in [
            "agentgate.toml",
            "agentgate.toml.dpkg-old",
            "agentgate.toml~",
            ".agentgate.toml.swp",
            "#agentgate.toml#",
            "other.toml",
        ] {
            std::fs::write(dir.path().join(name), "x").expect("write");
        }
        std::fs::create_dir(dir.path().join("agentgate.toml.d")).expect("mkdir");
        let mut names: Vec<String> = config_files(&dir.path().join("agentgate.toml"))
            .iter()
            .filter_map(|path| Some(path.file_name()?.to_string_lossy().into_owned()))
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "#agentgate.toml#",
                ".agentgate.toml.swp",
                "agentgate.toml",
                "agentgate.toml.dpkg-old",
                "agentgate.toml~"
            ]
        );
    }

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
