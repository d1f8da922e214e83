//! Schedules: `agentgate send --schedule NAME`, what `agentgate-schedule@NAME.service` runs when
//! its timer elapses.
//!
//! A schedule is a file, `schedules/NAME.toml` beside the config file (the route, the payload),
//! and an instance of the `agentgate-schedule@.timer` template whose calendar the operator sets
//! in a drop-in: the systemd way to run an agent every night, with `Persistent=true` catching up
//! a fire missed while the machine was off. The event goes through the running daemon like any
//! `send`, with the delivery id `schedule:NAME:<the time of this fire>`, so one fire posted
//! twice is a duplicate and every fire is a new event. Started by hand, without its timer, the
//! time is now: a new event. See docs/reference.md, "Schedules".
//!
//! The time of a fire is the one systemd stamps on the timer's file in
//! `/var/lib/systemd/timers` as it starts the service (`Persistent=true` keeps that file). It is
//! not `TRIGGER_TIMER_REALTIME_USEC`: systemd 252 (Debian 12) sets that variable from the first
//! fire and keeps it for every later one until a `daemon-reload`, so a key made of it turned
//! every later fire, and a catch-up, into a duplicate of the first. The variable is used only
//! where the timer keeps no stamp.

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
    let fired = Trigger::from_environment().fire_time(Path::new(TIMER_STAMPS))?;
    Ok(Outgoing {
        route: file.route,
        body: payload,
        delivery_id: format!(
            "schedule:{name}:{}",
            humantime::format_rfc3339_seconds(fired)
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

/// Where systemd keeps the time of each persistent timer's last fire (`stamp-UNIT`).
const TIMER_STAMPS: &str = "/var/lib/systemd/timers";

/// What systemd says about the timer that started this service: the unit (`TRIGGER_UNIT`) and
/// the time it elapsed (`TRIGGER_TIMER_REALTIME_USEC`, µs since the epoch).
struct Trigger {
    unit: Option<String>,
    realtime_usec: Option<String>,
}

impl Trigger {
    fn from_environment() -> Trigger {
        Trigger {
            unit: std::env::var("TRIGGER_UNIT").ok(),
            realtime_usec: std::env::var("TRIGGER_TIMER_REALTIME_USEC").ok(),
        }
    }

    /// The time of the fire that started this service: the stamp in `stamps` of the timer that
    /// started it, else `realtime_usec`; now when no timer started it.
    fn fire_time(&self, stamps: &Path) -> Result<SystemTime, Failure> {
        let Some(timer) = self
            .unit
            .as_deref()
            .filter(|unit| unit.ends_with(".timer") && is_plain_name(unit))
        else {
            return Ok(SystemTime::now());
        };
        let stamp = stamps.join(format!("stamp-{timer}"));
        if let Ok(fired) = std::fs::metadata(&stamp).and_then(|stamp| stamp.modified()) {
            return Ok(fired);
        }
        match &self.realtime_usec {
            Some(value) => value
                .trim()
                .parse::<u64>()
                .map(|micros| UNIX_EPOCH + Duration::from_micros(micros))
                .map_err(|err| {
                    Failure::usage(format!("TRIGGER_TIMER_REALTIME_USEC={value:?}: {err}"))
                }),
            None => Ok(SystemTime::now()),
        }
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

    #[test]
    fn a_fire_is_the_time_systemd_stamped_on_its_timer() {
        let stamps = tempfile::tempdir().expect("tempdir");
        let stamp = stamps.path().join("stamp-agentgate-schedule@nightly.timer");
        let file = std::fs::File::create(&stamp).expect("stamp");
        let fired = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        file.set_modified(fired).expect("mtime");
        // systemd 252 keeps the first fire's time in the variable; the stamp is this fire's.
        let trigger = Trigger {
            unit: Some("agentgate-schedule@nightly.timer".into()),
            realtime_usec: Some("1699913600000000".into()),
        };
        assert_eq!(trigger.fire_time(stamps.path()).ok(), Some(fired));
        // A timer that keeps no stamp (Persistent=false): the variable.
        let unstamped = Trigger {
            unit: Some("agentgate-schedule@weekly.timer".into()),
            ..trigger
        };
        assert_eq!(
            unstamped.fire_time(stamps.path()).ok(),
            Some(UNIX_EPOCH + Duration::from_secs(1_699_913_600))
        );
        // By hand: now, whatever the variable says.
        let by_hand = Trigger {
            unit: None,
            realtime_usec: Some("1699913600000000".into()),
        };
        let now = by_hand.fire_time(stamps.path()).ok();
        assert!(now.is_some_and(|now| now > fired), "{now:?}");
    }
}
