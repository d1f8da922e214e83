//! The last day of the daemon's work, minute by minute, for the console's overview charts:
//! webhooks accepted and refused, turns completed and not with how long they took, and the
//! deliveries pending as last read in each minute. Kept in memory, one slot per minute of a day
//! in a ring, so it stays the same size however busy the daemon is; written to the state
//! directory every few minutes and when the daemon stops, and read back when it starts, so a
//! restart does not empty the charts ([`kept`], [`restore`]). Prometheus and the journal keep
//! the longer view.

use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Minutes the ring holds: a day.
pub(crate) const MINUTES: usize = 24 * 60;

/// The upper bounds of the classes turn durations are counted in, in milliseconds (the last
/// class holds every longer turn): percentiles are read as the bound of their class.
pub(crate) const DURATION_BOUNDS_MS: [u64; 14] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 900_000,
    1_800_000, 3_600_000,
];

/// What happened in one minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Minute {
    /// Minutes since the Unix epoch.
    pub at: i64,
    pub accepted: u64,
    pub refused: u64,
    pub turns_completed: u64,
    /// Turns that ended any other way (failed, interrupted, cancelled).
    pub turns_failed: u64,
    /// Turns that ended, by duration class (`DURATION_BOUNDS_MS`; the last: longer).
    pub durations: [u64; DURATION_BOUNDS_MS.len() + 1],
    /// The deliveries pending when last read in this minute (by `status`, a scrape of
    /// `/metrics` or the console's overview), if they were.
    pub deliveries_pending: Option<i64>,
}

impl Minute {
    /// Adds `other`'s counts to this minute's; its pending deliveries are the later reading.
    pub(crate) fn add(&mut self, other: &Minute) {
        self.accepted += other.accepted;
        self.refused += other.refused;
        self.turns_completed += other.turns_completed;
        self.turns_failed += other.turns_failed;
        for (sum, count) in self.durations.iter_mut().zip(other.durations) {
            *sum += count;
        }
        self.deliveries_pending = other.deliveries_pending.or(self.deliveries_pending);
    }

    /// The duration (ms) under which a share `q` of the minute's turns ended: the bound of the
    /// class it falls in (for the last class, the last bound); `None` without turns.
    pub(crate) fn duration_percentile(&self, q: f64) -> Option<u64> {
        let total: u64 = self.durations.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        let class = self.durations.iter().position(|count| {
            seen += count;
            seen >= rank
        })?;
        DURATION_BOUNDS_MS
            .get(class)
            .or(DURATION_BOUNDS_MS.last())
            .copied()
    }
}

/// One slot per minute of a day, by minute since the epoch modulo a day.
struct Ring(Vec<Minute>);

impl Ring {
    fn new() -> Ring {
        Ring(vec![Minute::default(); MINUTES])
    }

    fn index(at: i64) -> usize {
        usize::try_from(at.rem_euclid(MINUTES as i64)).unwrap_or(0)
    }

    /// Changes the slot of the minute of `now_ms` (Unix milliseconds), emptied first when it
    /// held a minute of an earlier day.
    fn record(&mut self, now_ms: i64, change: impl FnOnce(&mut Minute)) {
        let at = now_ms.div_euclid(60_000);
        if let Some(slot) = self.0.get_mut(Ring::index(at)) {
            if slot.at != at {
                *slot = Minute {
                    at,
                    ..Minute::default()
                };
            }
            change(slot);
        }
    }

    /// Puts `minute` back in its slot, when it is within the day up to `now_ms`: added to what
    /// the slot holds of the same minute, in place of an older minute's.
    fn restore(&mut self, minute: &Minute, now_ms: i64) {
        let now = now_ms.div_euclid(60_000);
        if minute.at > now || minute.at <= now - MINUTES as i64 {
            return;
        }
        if let Some(slot) = self.0.get_mut(Ring::index(minute.at)) {
            if slot.at == minute.at {
                slot.add(minute);
            } else if slot.at < minute.at {
                *slot = *minute;
            }
        }
    }

    /// The day up to the minute of `now_ms`, oldest first: one entry per minute, empty for a
    /// minute nothing was recorded in.
    fn last_day(&self, now_ms: i64) -> Vec<Minute> {
        let now = now_ms.div_euclid(60_000);
        (now - MINUTES as i64 + 1..=now)
            .map(|at| match self.0.get(Ring::index(at)) {
                Some(slot) if slot.at == at => *slot,
                Some(_) | None => Minute {
                    at,
                    ..Minute::default()
                },
            })
            .collect()
    }
}

static RING: LazyLock<Mutex<Ring>> = LazyLock::new(|| Mutex::new(Ring::new()));

fn record(change: impl FnOnce(&mut Minute)) {
    let mut ring = RING.lock().unwrap_or_else(PoisonError::into_inner);
    ring.record(crate::clock::now_millis(), change);
}

pub(super) fn accepted() {
    record(|minute| minute.accepted += 1);
}

pub(super) fn refused() {
    record(|minute| minute.refused += 1);
}

pub(super) fn turn_ended(completed: bool, elapsed: Duration) {
    let millis = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
    let class = DURATION_BOUNDS_MS
        .iter()
        .position(|bound| millis <= *bound)
        .unwrap_or(DURATION_BOUNDS_MS.len());
    record(|minute| {
        if completed {
            minute.turns_completed += 1;
        } else {
            minute.turns_failed += 1;
        }
        if let Some(count) = minute.durations.get_mut(class) {
            *count += 1;
        }
    });
}

/// The deliveries pending, as just read from the store.
pub(crate) fn deliveries_pending(pending: i64) {
    record(|minute| {
        minute.deliveries_pending = Some(pending);
    });
}

/// The last day up to now, minute by minute, oldest first.
pub(crate) fn last_day() -> Vec<Minute> {
    let ring = RING.lock().unwrap_or_else(PoisonError::into_inner);
    ring.last_day(crate::clock::now_millis())
}

/// The minutes of the last day in which anything was recorded, oldest first: what is kept
/// across a restart.
pub(crate) fn kept() -> Vec<Minute> {
    last_day()
        .into_iter()
        .filter(|minute| {
            *minute
                != Minute {
                    at: minute.at,
                    ..Minute::default()
                }
        })
        .collect()
}

/// Puts minutes kept by an earlier run back, those of the last day.
pub(crate) fn restore(minutes: &[Minute]) {
    let mut ring = RING.lock().unwrap_or_else(PoisonError::into_inner);
    let now = crate::clock::now_millis();
    for minute in minutes {
        ring.restore(minute, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minute_s_percentiles_are_the_bounds_of_their_classes() {
        let mut minute = Minute::default();
        assert_eq!(minute.duration_percentile(0.5), None);
        minute.durations[0] = 9; // up to 100 ms
        minute.durations[4] = 1; // up to 2.5 s
        assert_eq!(minute.duration_percentile(0.5), Some(100));
        assert_eq!(minute.duration_percentile(0.95), Some(2_500));
        minute.durations[DURATION_BOUNDS_MS.len()] = 90; // longer than the last bound
        assert_eq!(minute.duration_percentile(0.5), Some(3_600_000));
    }

    #[test]
    fn minutes_kept_by_an_earlier_run_come_back_within_the_day() {
        let mut ring = Ring::new();
        let now = 5_000 * 60_000;
        ring.record(now, |minute| minute.accepted += 1);
        let kept = |at: i64, accepted: u64| Minute {
            at,
            accepted,
            ..Minute::default()
        };
        ring.restore(&kept(5_000, 2), now); // the same minute: added
        ring.restore(&kept(4_990, 3), now);
        ring.restore(&kept(5_000 - MINUTES as i64, 7), now); // a day ago: left out
        ring.restore(&kept(5_001, 9), now); // ahead of the clock: left out
        let day = ring.last_day(now);
        assert_eq!(day[MINUTES - 1].accepted, 3);
        assert_eq!(day[MINUTES - 11].accepted, 3);
        assert_eq!(day.iter().map(|minute| minute.accepted).sum::<u64>(), 6);
    }

    #[test]
    fn the_ring_holds_a_day_and_forgets_what_is_older() {
        let mut ring = Ring::new();
        let start = 1_000 * 60_000;
        let day = 60_000 * MINUTES as i64;
        ring.record(start, |minute| minute.accepted += 1);
        ring.record(start + day - 60_000, |minute| minute.refused += 2);
        let shown = ring.last_day(start + day - 60_000);
        assert_eq!(shown.len(), MINUTES);
        assert_eq!((shown[0].at, shown[0].accepted), (1_000, 1));
        assert_eq!(shown[MINUTES - 1].refused, 2);
        // A day later, the first minute's slot is another minute's.
        ring.record(start + day, |minute| minute.accepted += 5);
        let next = ring.last_day(start + day);
        assert_eq!(next[MINUTES - 1].accepted, 5);
        assert!(next.iter().all(|minute| minute.at != 1_000));
    }
}
