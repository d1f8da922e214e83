//! What a tool could plant for another child, or for its own next calls, through its `writable`
//! paths (docs/tools.md, "Who may rewrite what the tools may do").
//!
//! A strict sandbox lets a call write only its `writable` paths, but what it writes there
//! outlives the call: a program, a script, a module an interpreter loads from its working
//! directory, a repository's config, a symbolic link in place of a directory, a unit drop-in.
//! Whatever another child (or the daemon, or systemd) later runs or reads from there runs with
//! that child's privileges: its network, its secrets, root for a unit file. So the config is
//! checked for every such place, by every name a path goes by on its way to the file (a link
//! inside a writable path is one a tool may have put there, whatever it leads to today), and
//! the place is refused, or warned of where it may be data.

use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

use super::{Config, Severity};

/// Where the system keeps what runs as root or as every user (programs, libraries, units and
/// their drop-ins, configuration, root's home): no tool may write there, nor a directory that
/// holds one of them (systemd reads a new drop-in of a template at the next instance's start).
const SYSTEM_DIRS: [&str; 12] = [
    "/usr",
    "/etc",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/boot",
    "/root",
    "/run/systemd",
    "/var/lib/systemd",
];

/// The search path of a system service (systemd's default), for a program named without a
/// slash when the process has no `PATH`.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Symbolic links followed on the way to a file at most (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// A strict child's writable path, under both of its names: as configured, and resolved.
struct WritablePath {
    key: String,
    configured: PathBuf,
    resolved: PathBuf,
}

impl WritablePath {
    /// Whether `name` is this path or inside it.
    fn holds(&self, name: &Path) -> bool {
        name.starts_with(&self.configured) || name.starts_with(&self.resolved)
    }

    /// Whether `name` is inside this path, not this path itself.
    fn holds_inside(&self, name: &Path) -> bool {
        self.holds(name) && name != self.configured && name != self.resolved
    }
}

/// Every finding of this module, as `(key, message, severity)`.
pub(crate) fn plantable(config: &Config) -> Vec<(String, String, Severity)> {
    let writable: Vec<WritablePath> = super::strict_children(config)
        .into_iter()
        .flat_map(|child| {
            child
                .writable
                .iter()
                .map(|path| WritablePath {
                    key: child.key.clone(),
                    configured: path.clone(),
                    resolved: super::resolved(path),
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let mut findings = system_and_nested(&writable);
    findings.extend(read_by_the_daemon(config, &writable));
    for child in children(config) {
        findings.extend(child_findings(&child, &writable));
    }
    findings
}

/// A writable path that is, holds or lies in a system directory, and one that lies inside
/// another's (a call of the outer one can rename the inner directory and put a link to any
/// directory in its place, which the inner tool would then be given to write).
fn system_and_nested(writable: &[WritablePath]) -> Vec<(String, String, Severity)> {
    let mut findings = Vec::new();
    for path in writable {
        let names = [&path.configured, &path.resolved];
        let system = SYSTEM_DIRS.iter().map(Path::new).find(|system| {
            names
                .iter()
                .any(|name| name.starts_with(system) || system.starts_with(name))
        });
        if let Some(system) = system {
            findings.push((
                format!("{}.writable", path.key),
                format!(
                    "{} is, holds or lies in {}, where the system keeps what runs as root or as \
                     every user (programs, libraries, units and their drop-ins, configuration): \
                     what a call writes there runs outside any sandbox; name a directory of its \
                     own",
                    path.configured.display(),
                    system.display()
                ),
                Severity::Error,
            ));
        }
        let way = names_on_the_way(&path.configured);
        let outer = writable.iter().find(|outer| {
            outer.resolved != path.resolved && way.iter().any(|name| outer.holds_inside(name))
        });
        if let Some(outer) = outer {
            findings.push((
                format!("{}.writable", path.key),
                format!(
                    "{} is inside {}.writable ({}), or reached through it: a call of {} can \
                     rename it and put a symbolic link to any directory in its place; name \
                     directories apart from each other",
                    path.configured.display(),
                    outer.key,
                    outer.configured.display(),
                    outer.key
                ),
                Severity::Error,
            ));
        }
    }
    findings
}

/// Files the daemon itself reads that are not secrets (those are hidden from every tool): the
/// replay cassette and PostgreSQL's CA file.
fn read_by_the_daemon(
    config: &Config,
    writable: &[WritablePath],
) -> Vec<(String, String, Severity)> {
    let mut files: Vec<(&str, &Path)> = Vec::new();
    match &config.model.backend {
        super::ModelBackend::Replay {
            cassette: Some(cassette),
        } => files.push(("model.cassette", cassette)),
        super::ModelBackend::Replay { cassette: None }
        | super::ModelBackend::OpenAi { .. }
        | super::ModelBackend::Command { .. } => {}
    }
    match &config.store {
        super::StoreSettings::Postgres(postgres) => {
            if let Some(ca_file) = &postgres.ca_file {
                files.push(("store.ca_file", ca_file));
            }
        }
        super::StoreSettings::Sqlite => {}
    }
    let mut findings = Vec::new();
    for (key, file) in files {
        if let Some(writer) = first_writer(&super::resolved(file), writable) {
            findings.push((
                key.to_string(),
                format!(
                    "{} is in a path {writer} may write, and the daemon reads it: a call of \
                     {writer} could put its own in its place; keep it where no tool may write",
                    file.display()
                ),
                Severity::Error,
            ));
        }
    }
    findings
}

/// A child the config starts: its key, argv and working directory.
struct ChildCommand<'a> {
    key: String,
    argv: &'a [String],
    cwd: Option<&'a Path>,
}

/// Every child the config starts.
fn children(config: &Config) -> Vec<ChildCommand<'_>> {
    let child = |key: String, argv, cwd| ChildCommand { key, argv, cwd };
    let mut children = Vec::new();
    match &config.model.backend {
        super::ModelBackend::Command { argv } => {
            children.push(child("model.command".into(), argv, None));
        }
        super::ModelBackend::OpenAi { .. } | super::ModelBackend::Replay { .. } => {}
    }
    for tool in config.tools.values() {
        children.push(child(format!("tools.{}", tool.name), &tool.command, None));
    }
    for server in config.mcp.values() {
        match &server.transport {
            super::McpTransport::Stdio { command, cwd, .. } => {
                children.push(child(
                    format!("mcp.{}", server.name),
                    command,
                    cwd.as_deref(),
                ));
            }
            super::McpTransport::Http { .. } => {}
        }
    }
    for route in &config.routes {
        match &route.deliver {
            super::DeliverSettings::Command { argv, .. } => {
                children.push(child(format!("routes.{}.deliver", route.name), argv, None));
            }
            super::DeliverSettings::Log | super::DeliverSettings::Http { .. } => {}
        }
    }
    children
}

/// What one child's program, working directory and arguments let a tool plant.
fn child_findings(
    child: &ChildCommand<'_>,
    writable: &[WritablePath],
) -> Vec<(String, String, Severity)> {
    let key = &child.key;
    let mut findings = Vec::new();
    let mut report = |what: String, writer: &str, severity| {
        findings.push((
            key.clone(),
            format!(
                "{what} is in a path {writer} may write: a call of {writer} can replace it, and \
                 what it puts there runs as {key}, on every later call; keep programs, scripts \
                 and working directories where no tool may write"
            ),
            severity,
        ));
    };
    // A relative name is found from the working directory: the child's `cwd`, else the
    // sandbox's (/).
    let base = child.cwd.unwrap_or(Path::new("/"));
    if let Some(cwd) = child.cwd
        && let Some(writer) = first_writer(cwd, writable)
    {
        let what = format!(
            "its working directory {} (interpreters load modules from it)",
            cwd.display()
        );
        report(what, writer, Severity::Error);
    }
    for (index, argument) in child.argv.iter().enumerate() {
        let named = Path::new(argument);
        if index == 0 && !argument.contains('/') {
            for dir in std::env::split_paths(&search_path()) {
                if let Some(writer) = first_writer(&base.join(&dir), writable) {
                    let what = format!(
                        "its program {argument:?} is looked up in PATH, and {}",
                        dir.display()
                    );
                    report(what, writer, Severity::Error);
                }
            }
            continue;
        }
        // A word without a slash is a path only where it names a file in the working
        // directory (`python3 server.py`), not otherwise (`git status`).
        let path = match child.cwd {
            _ if named.is_absolute() || argument.contains('/') => base.join(named),
            Some(cwd) if cwd.join(named).exists() => cwd.join(named),
            Some(_) | None => continue,
        };
        let Some(writer) = first_writer(&path, writable) else {
            continue;
        };
        if index == 0 {
            report(
                format!("its program {}", path.display()),
                writer,
                Severity::Error,
            );
        } else if writer != key.as_str() || path.is_file() {
            let what = format!(
                "{} (a file or directory its command names: a script? a repository?)",
                path.display()
            );
            report(what, writer, Severity::Warning);
        }
    }
    findings
}

/// `PATH` of this process (the service's, under systemd), else systemd's default.
fn search_path() -> OsString {
    std::env::var_os("PATH")
        .filter(|path| !path.is_empty())
        .unwrap_or_else(|| DEFAULT_PATH.into())
}

/// The key of the first strict child that may write `path` under any name it goes by.
fn first_writer<'a>(path: &Path, writable: &'a [WritablePath]) -> Option<&'a str> {
    let way = names_on_the_way(path);
    writable
        .iter()
        .find(|dir| way.iter().any(|name| dir.holds(name)))
        .map(|dir| dir.key.as_str())
}

/// Every name `path` (absolute) goes by on its way to the file, from the root: each directory
/// and file as named, each link's target in turn, and the file as finally resolved. A name
/// inside a writable path is a step a tool may have planted, whatever the link leads to now.
/// At most [`MAX_LINKS`] links are followed; what is past them is not walked.
fn names_on_the_way(path: &Path) -> Vec<PathBuf> {
    let mut names = Vec::new();
    let mut current = PathBuf::from("/");
    let mut ahead: Vec<OsString> = Vec::new();
    push_reversed(&mut ahead, path);
    let mut links = 0;
    while let Some(part) = ahead.pop() {
        if part == ".." {
            current.pop();
            continue;
        }
        let next = current.join(&part);
        names.push(next.clone());
        match std::fs::read_link(&next) {
            Ok(target) if links < MAX_LINKS => {
                links += 1;
                if target.is_absolute() {
                    current = PathBuf::from("/");
                }
                push_reversed(&mut ahead, &target);
            }
            Ok(_) | Err(_) => current = next,
        }
    }
    names.push(current);
    names
}

/// `path`'s components onto `stack`, last first, so that popping gives them in order.
fn push_reversed(stack: &mut Vec<OsString>, path: &Path) {
    for component in path.components().rev() {
        match component {
            Component::Normal(name) => stack.push(name.to_os_string()),
            Component::ParentDir => stack.push("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link inside a directory is a name on the way to what it leads to, and so is the
    /// directory a relative link climbs out of.
    #[test]
    fn every_name_on_the_way_is_seen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = super::super::resolved(dir.path());
        std::fs::create_dir_all(root.join("opt/v1/bin")).expect("dirs");
        std::fs::create_dir_all(root.join("srv")).expect("srv");
        std::os::unix::fs::symlink(root.join("opt/v1"), root.join("srv/current")).expect("link");
        std::os::unix::fs::symlink("../srv/current", root.join("opt/up")).expect("relative");
        let way = names_on_the_way(&root.join("srv/current/bin/status"));
        assert!(way.contains(&root.join("srv/current")), "{way:?}");
        assert_eq!(way.last(), Some(&root.join("opt/v1/bin/status")));
        let way = names_on_the_way(&root.join("opt/up/bin"));
        assert!(way.contains(&root.join("srv/current")), "{way:?}");
        assert_eq!(way.last(), Some(&root.join("opt/v1/bin")));
        let way = names_on_the_way(Path::new("/a/./b/../c"));
        assert_eq!(way.last(), Some(&PathBuf::from("/a/c")));
        std::os::unix::fs::symlink(root.join("loop"), root.join("loop")).expect("loop");
        let looped = names_on_the_way(&root.join("loop/x"));
        assert!(looped.len() < 10 * MAX_LINKS, "{}", looped.len());
    }
}
