//! Schedules: `agentgate send --schedule NAME`, what `agentgate-schedule@NAME.service` runs when
//! its timer elapses.
//!
//! A schedule is a file, `schedules/NAME.toml` beside the config file (the route, the payload),
//! and an instance of the `agentgate-schedule@.timer` template whose calendar the operator sets
//! in a drop-in: the systemd way to run an agent every night, with `Persistent=true` catching up
//! a fire missed while the machine was off. The event goes through the running daemon like any
//! `send`, with the delivery id `schedule:NAME:<the time the timer elapsed>` (systemd passes it
//! as `TRIGGER_TIMER_REALTIME_USEC`), so one fire posted twice is a duplicate. Started by hand,
//! without its timer, the time is now: a new event. See docs/reference.md, "Schedules".

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use super::send::Outgoing;
use crate::config::{ConfigSource, DEFAULT_CONFIG_PATH};
use crate::exit::Failure;

/// `schedules/NAME.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleFile {
    /// The route the event is posted to.
    route: String,
    /// The payload (a TOML table, posted as JSON) [default: {}].
    #[serde(default)]
    payload: Option<toml::Table>,
    /// The event type, for a route whose scheme carries one in a header.
    event_type: Option<String>,
}

/// What `send --schedule name` posts. `route`, when given as well, must be the file's.
pub(super) fn outgoing(
    source: &ConfigSource,
    name: &str,
    route: Option<&str>,
) -> Result<Outgoing, Failure> {
    if !is_plain_name(name) {
        return Err(Failure::usage(format!(
            "--schedule {name:?}: a schedule is named by letters, digits and -_.:@ (the file \
             schedules/NAME.toml and the unit agentgate-schedule@NAME.timer)"
        )));
    }
    let path = schedules_dir(source).join(format!("{name}.toml"));
    let text = std::fs::read_to_string(&path)
        .map_err(|err| Failure::config(format!("{}: {err}", path.display())))?;
    let file: ScheduleFile = toml::from_str(&text)
        .map_err(|err| Failure::config(format!("{}: {}", path.display(), err.message())))?;
    if let Some(route) = route.filter(|route| *route != file.route) {
        return Err(Failure::usage(format!(
            "{} posts to route {:?}, not {route:?}",
            path.display(),
            file.route
        )));
    }
    let payload = serde_json::to_vec(&file.payload.unwrap_or_default())
        .map_err(|err| Failure::config(format!("{}: payload: {err}", path.display())))?;
    let elapsed = timer_elapsed()?;
    Ok(Outgoing {
        route: file.route,
        body: payload,
        delivery_id: format!(
            "schedule:{name}:{}",
            humantime::format_rfc3339_seconds(elapsed)
        ),
        event_type: file.event_type,
    })
}

/// `schedules/` beside the config file (`/etc/agentgate/schedules` for the packaged one).
fn schedules_dir(source: &ConfigSource) -> PathBuf {
    let config = match source {
        ConfigSource::File(path) => path.as_path(),
        ConfigSource::Embedded => Path::new(DEFAULT_CONFIG_PATH),
    };
    config
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join("schedules")
}

/// When the timer that started this service elapsed, else now (started by hand).
fn timer_elapsed() -> Result<SystemTime, Failure> {
    match std::env::var("TRIGGER_TIMER_REALTIME_USEC") {
        Ok(value) => value
            .trim()
            .parse::<u64>()
            .map(|micros| UNIX_EPOCH + Duration::from_micros(micros))
            .map_err(|err| Failure::usage(format!("TRIGGER_TIMER_REALTIME_USEC={value:?}: {err}"))),
        Err(_) => Ok(SystemTime::now()),
    }
}

fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:@".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_name_cannot_leave_the_schedules_directory() {
        for name in ["nightly", "weekly-deps", "a.b_c:d@e"] {
            assert!(is_plain_name(name), "{name}");
        }
        for name in ["", "../agentgate", "a/b", ".hidden", "sp ace", "x\n"] {
            assert!(!is_plain_name(name), "{name:?}");
        }
    }
}
