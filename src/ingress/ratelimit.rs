//! Per-route rate limits: a token bucket that refills continuously.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Rate;

pub(crate) struct TokenBucket {
    capacity: f64,
    per_second: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub(crate) fn new(rate: Rate) -> TokenBucket {
        let capacity = f64::from(rate.count);
        TokenBucket {
            capacity,
            per_second: capacity / rate.period.as_secs_f64(),
            state: Mutex::new((capacity, Instant::now())),
        }
    }

    /// Takes a token, or says how long until one is available.
    pub(crate) fn take(&self, now: Instant) -> Result<(), Duration> {
        let mut state = crate::locks::lock(&self.state);
        let (tokens, last) = *state;
        let elapsed = now.saturating_duration_since(last).as_secs_f64();
        let tokens = (tokens + elapsed * self.per_second).min(self.capacity);
        if tokens >= 1.0 {
            *state = (tokens - 1.0, now);
            Ok(())
        } else {
            *state = (tokens, now);
            Err(Duration::from_secs_f64((1.0 - tokens) / self.per_second))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_past_capacity_and_refills() {
        let bucket = TokenBucket::new(Rate {
            count: 2,
            period: Duration::from_secs(60),
        });
        let start = Instant::now();
        assert!(bucket.take(start).is_ok());
        assert!(bucket.take(start).is_ok());
        let wait = bucket
            .take(start)
            .expect_err("third request is over the limit");
        assert!(wait > Duration::from_secs(29) && wait <= Duration::from_secs(30));
        assert!(bucket.take(start + Duration::from_secs(31)).is_ok());
    }
}
