//! Time as agentgate writes it down and waits on it: the wall clock in Unix seconds (webhook
//! signatures and timestamps) and milliseconds (what the store keeps), and the growing wait
//! between attempts at something that failed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 for a clock set before it).
pub(crate) fn now_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// Milliseconds since the Unix epoch (0 for a clock set before it).
pub(crate) fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

/// The wait before attempt `attempt + 1`: `first` doubled `attempt` times, at most `cap`, then
/// spread by a random factor within `1 ± jitter / 2`, so that many failures do not retry in
/// lockstep.
pub(crate) fn backoff(first: Duration, cap: Duration, attempt: u32, jitter: f64) -> Duration {
    let exponential = first.saturating_mul(1u32 << attempt.min(31)).min(cap);
    exponential.mul_f64(1.0 - jitter / 2.0 + fastrand::f64() * jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_within_its_jitter() {
        let (first, cap) = (Duration::from_millis(500), Duration::from_secs(30));
        for attempt in [0, 1, 5, 6, 31, 100] {
            let exponential = first.saturating_mul(2u32.saturating_pow(attempt)).min(cap);
            let wait = backoff(first, cap, attempt, 0.5);
            assert!(wait >= exponential.mul_f64(0.75), "{attempt}: {wait:?}");
            assert!(wait <= exponential.mul_f64(1.25), "{attempt}: {wait:?}");
        }
        assert_eq!(backoff(first, cap, 3, 0.0), Duration::from_secs(4));
    }
}
