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
const SYSTEM_DIRS: [&str; 21] = [
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
    "/run/tmpfiles.d",
    "/run/udev",
    "/run/modprobe.d",
    "/run/extensions",
    "/var/lib/systemd",
    "/var/lib/extensions",
    "/var/lib/dpkg",
    "/var/lib/polkit-1",
    "/var/lib/snapd",
    "/var/spool/cron",
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
}

/// Whether two paths are spelled alike (`//`, `.` and a trailing slash aside).
fn same_name(one: &Path, other: &Path) -> bool {
    one.components().eq(other.components())
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
    findings.extend(hidden_reached_through(config, &writable));
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
        // Two tools may share a directory named alike; one that reaches another's through a
        // link (even one that leads there today) can be led elsewhere by it.
        let outer = writable.iter().find(|outer| {
            !same_name(&outer.configured, &path.configured)
                && way.iter().any(|name| outer.holds(name))
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
        let absolute = std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf());
        if let Some(writer) = first_writer(&absolute, writable) {
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

/// What every sandbox hides (the state, the config and its copies, the secrets, the sockets)
/// reached through a name a tool may write, a link that leads out of it today: a call can
/// point it elsewhere, and the daemon would take the tool's file as its own config or secret
/// at the next load. (What lies inside a writable path itself, `leash` refuses.)
fn hidden_reached_through(
    config: &Config,
    writable: &[WritablePath],
) -> Vec<(String, String, Severity)> {
    let hidden = config.hidden.dirs.iter().chain(&config.hidden.files);
    hidden
        .filter_map(|path| {
            let resolved = super::resolved(path);
            if writable.iter().any(|dir| dir.holds(&resolved)) {
                return None;
            }
            let writer = first_writer(&std::path::absolute(path).ok()?, writable)?;
            Some((
                format!("{writer}.writable"),
                format!(
                    "{} is reached through a link in a path {writer} may write: a call of \
                     {writer} can point it elsewhere, and the daemon would take what the tool \
                     put there as its own; keep the state, the config, the secrets and the \
                     links to them out of every writable path",
                    path.display()
                ),
                Severity::Error,
            ))
        })
        .collect()
}

/// A child the config starts: its key, argv, working directory and environment, and whether it
/// runs outside any sandbox (`sandbox = "none"`, or the model command), as the daemon's user.
struct ChildCommand<'a> {
    key: String,
    argv: &'a [String],
    cwd: Option<&'a Path>,
    env: Vec<(&'a str, &'a super::Secret)>,
    unconfined: bool,
}

/// Every child the config starts.
fn children(config: &Config) -> Vec<ChildCommand<'_>> {
    let unconfined = |sandbox: &super::Sandboxing| match sandbox {
        super::Sandboxing::Off => true,
        super::Sandboxing::Strict { .. } => false,
    };
    let child = |key: String, argv, unconfined| ChildCommand {
        key,
        argv,
        cwd: None,
        env: Vec::new(),
        unconfined,
    };
    let mut children = Vec::new();
    match &config.model.backend {
        super::ModelBackend::Command { argv } => {
            children.push(child("model.command".into(), argv, true));
        }
        super::ModelBackend::OpenAi { .. } | super::ModelBackend::Replay { .. } => {}
    }
    for tool in config.tools.values() {
        let key = format!("tools.{}", tool.name);
        children.push(child(key, &tool.command, unconfined(&tool.sandbox)));
    }
    for server in config.mcp.values() {
        match &server.transport {
            super::McpTransport::Stdio {
                command,
                cwd,
                env,
                sandbox,
                ..
            } => children.push(ChildCommand {
                cwd: cwd.as_deref(),
                env: env
                    .iter()
                    .map(|(name, value)| (name.as_str(), value))
                    .collect(),
                ..child(format!("mcp.{}", server.name), command, unconfined(sandbox))
            }),
            super::McpTransport::Http { .. } => {}
        }
    }
    for route in &config.routes {
        match &route.deliver {
            super::DeliverSettings::Command { argv, sandbox, .. } => {
                let key = format!("routes.{}.deliver", route.name);
                children.push(child(key, argv, unconfined(sandbox)));
            }
            super::DeliverSettings::Log | super::DeliverSettings::Http { .. } => {}
        }
    }
    children
}

/// What one child's program, working directory, environment and arguments let a tool plant.
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
    for (name, value) in &child.env {
        let value = String::from_utf8_lossy(value.expose());
        // A sandboxed child may be told where its own writable path is (`DATA_DIR`).
        let others = |writer: &&str| child.unconfined || *writer != key.as_str();
        if let Some(writer) = named_paths(&value, true)
            .into_iter()
            .filter_map(|path| first_writer(&base.join(path), writable))
            .find(others)
        {
            let what = format!("a path its environment variable {name} names");
            report(what, writer, Severity::Error);
        }
    }
    let Some((program, arguments)) = child.argv.split_first() else {
        return findings;
    };
    for (what, writer) in program_findings(child, program, base, writable) {
        report(what, writer, Severity::Error);
    }
    for argument in arguments {
        // A word without a slash is a path only where it names a file in the working
        // directory (`python3 server.py`), not otherwise (`git status`).
        let named = Path::new(argument);
        let paths: Vec<PathBuf> = match child.cwd {
            _ if argument.contains('/') => named_paths(argument, false)
                .into_iter()
                .map(|p| base.join(p))
                .collect(),
            Some(cwd) if cwd.join(named).exists() => vec![cwd.join(named)],
            Some(_) | None => continue,
        };
        for path in paths {
            let Some(writer) = first_writer(&path, writable) else {
                continue;
            };
            // What runs as the daemon's user reads nothing a tool may write; a sandboxed
            // child may be given data there (its own output directory, say).
            let severity = if child.unconfined {
                Severity::Error
            } else if writer != key.as_str() || path.is_file() {
                Severity::Warning
            } else {
                continue;
            };
            let what = format!(
                "{} (a file or directory its command names: a script? a repository?)",
                path.display()
            );
            report(what, writer, severity);
        }
    }
    findings
}

/// Where a child's program comes from, as `(what, writer)` for each place a tool may write:
/// the program itself, each directory of the search path looked in before the one that holds
/// a program named without a slash, and the interpreters its `#!` lines name (the kernel
/// follows [`MAX_INTERPRETERS`] of them), with what those lines name besides (`env`'s program
/// is looked up in the search path too).
fn program_findings<'a>(
    child: &ChildCommand<'_>,
    program: &str,
    base: &Path,
    writable: &'a [WritablePath],
) -> Vec<(String, &'a str)> {
    let mut found = Vec::new();
    let search = child
        .env
        .iter()
        .find(|(name, _)| *name == "PATH")
        .map(|(_, value)| OsString::from(String::from_utf8_lossy(value.expose()).as_ref()))
        .unwrap_or_else(search_path);
    let mut next = Some(program.to_string());
    for depth in 0..=MAX_INTERPRETERS {
        let Some(name) = next.take() else {
            break;
        };
        let path = if name.contains('/') {
            base.join(&name)
        } else {
            match look_up(&name, &search, base, writable, &mut found) {
                Some(path) => path,
                None => break,
            }
        };
        if let Some(writer) = first_writer(&path, writable) {
            let what = match depth {
                0 => format!("its program {}", path.display()),
                _ => format!("the interpreter {} that a #! line names", path.display()),
            };
            found.push((what, writer));
        }
        let Some(line) = shebang(&path) else {
            break;
        };
        let mut words = line.split_whitespace();
        next = words.next().map(str::to_string);
        let rest: Vec<&str> = words.collect();
        for named in rest.iter().flat_map(|word| named_paths(word, false)) {
            if let Some(writer) = first_writer(&base.join(named), writable) {
                found.push((
                    format!("a path the #! line of {} names", path.display()),
                    writer,
                ));
            }
        }
        if next
            .as_deref()
            .is_some_and(|interpreter| interpreter.ends_with("/env"))
        {
            // `#!/usr/bin/env [-S] [NAME=VALUE]... PROGRAM`: what runs is PROGRAM.
            next = rest
                .iter()
                .find(|word| !word.starts_with('-') && !word.contains('='))
                .map(|word| (*word).to_string());
        }
    }
    found
}

/// Interpreters the kernel follows from a script to a binary at most (`#!` naming a script
/// with a `#!` line of its own).
const MAX_INTERPRETERS: usize = 4;

/// Where a program named without a slash is found in `search`: each directory looked in before
/// the one that holds it that a tool may write is noted in `found`.
fn look_up<'a>(
    name: &str,
    search: &OsString,
    base: &Path,
    writable: &'a [WritablePath],
    found: &mut Vec<(String, &'a str)>,
) -> Option<PathBuf> {
    for dir in std::env::split_paths(search) {
        let dir = base.join(dir);
        if let Some(writer) = first_writer(&dir, writable) {
            let what = format!(
                "its program {name:?} is looked up in PATH, and {}",
                dir.display()
            );
            found.push((what, writer));
        }
        if dir.join(name).is_file() {
            return Some(dir.join(name));
        }
    }
    None
}

/// `PATH` of this process (the service's, under systemd), else systemd's default.
fn search_path() -> OsString {
    std::env::var_os("PATH")
        .filter(|path| !path.is_empty())
        .unwrap_or_else(|| DEFAULT_PATH.into())
}

/// The rest of a script's `#!` line, if `path` is a script.
fn shebang(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut head = [0_u8; 256];
    let read = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let line = head[..read].strip_prefix(b"#!")?;
    let line = line.split(|byte| *byte == b'\n').next()?;
    Some(String::from_utf8_lossy(line).into_owned())
}

/// The paths a command-line word or an environment value may name: the whole, what follows an
/// `=` (`--config=/srv/x`), what follows a short option (`-I/srv/lib`), each part of a list
/// (`/a:/b`), words apart (`--require "/srv/x.js"`), without quotes or a leading `@` (an
/// argument file), and `file:` URLs decoded. Only names with a slash count, unless
/// `bare_words` (an environment value, whose relative names are found from the working
/// directory: `PYTHONPATH=lib`).
fn named_paths(text: &str, bare_words: bool) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    let words = text.split(|c: char| c == '=' || c == ',' || c.is_whitespace());
    for word in words {
        let word = word.trim_matches(|c| c == '"' || c == '\'');
        let word = word.strip_prefix('@').unwrap_or(word);
        if word.starts_with("file:") {
            let decoded = url::Url::parse(word)
                .ok()
                .and_then(|url| url.to_file_path().ok());
            paths.extend(decoded);
            continue;
        }
        // `-I/srv/lib`: a one-letter option with its value, counted by characters.
        let mut chars = word.chars();
        let word = match (chars.next(), chars.next()) {
            (Some('-'), Some(_)) if chars.as_str().starts_with('/') => chars.as_str(),
            _ => word,
        };
        let parts = word.split(':').filter(|part| !part.is_empty());
        paths.extend(
            parts
                .filter(|part| bare_words || part.contains('/'))
                .map(PathBuf::from),
        );
    }
    paths
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

    /// What a word or an environment value may name, in each form a program reads a path in;
    /// a word that starts with `-` and a character of several bytes is read, not cut inside it.
    #[test]
    fn the_paths_a_word_names() {
        let named = |text: &str, bare: bool| -> Vec<String> {
            named_paths(text, bare)
                .iter()
                .map(|path| path.display().to_string())
                .collect()
        };
        assert_eq!(named("--config=/srv/x", false), ["/srv/x"]);
        assert_eq!(named("-I/srv/lib", false), ["/srv/lib"]);
        assert_eq!(named("/a:/b", false), ["/a", "/b"]);
        assert_eq!(named(r#"--require "/srv/e.js""#, false), ["/srv/e.js"]);
        assert_eq!(named("'core.fsmonitor'='/srv/hook'", false), ["/srv/hook"]);
        assert_eq!(named("@/srv/jvm.args", false), ["/srv/jvm.args"]);
        assert_eq!(named("file:///srv/%77/x.mjs", false), ["/srv/w/x.mjs"]);
        assert_eq!(named("file://localhost/srv/x", false), ["/srv/x"]);
        assert_eq!(named("lib:w", true), ["lib", "w"]);
        assert!(named("status", false).is_empty());
        for odd in ["-über", "-é/x", "-\u{fffd}/x", "-", "--", "é"] {
            let _ = named(odd, true);
        }
        assert_eq!(named("-é/x", false), ["/x"]);
    }

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
