//! Reading what a child process writes no faster than a rate.
//!
//! What a child writes must be read, or it blocks on its full pipe; but read as fast as it can
//! write, a flood (a command's `yes`, an MCP server's notifications or stderr without end) costs
//! the daemon most of a core for as long as the child runs, and a few of them stall every
//! route's work. A [`Pace`] lets a burst through and then holds reading to its rate: the child
//! blocks on its pipe (or its socket) instead, and what it wrote is read later, none of it lost.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A rate of reading, in units (bytes, lines, messages) a second, with a burst let through at
/// once: a token bucket.
pub(crate) struct Pace {
    per_second: f64,
    burst: f64,
    /// Units that may be read now; below zero, how far reading is ahead of the rate.
    credit: f64,
    last: Instant,
}

/// The shortest wait: the timer's resolution. Less is owed until it adds up.
const WAIT_MIN: Duration = Duration::from_millis(1);

impl Pace {
    /// `per_second` units a second, `burst` of them at once (and to begin with). What a wait
    /// earns past its end (the timer rounds up to [`WAIT_MIN`]) is kept whatever the burst, or
    /// every wait would lose it.
    pub(crate) fn new(per_second: u64, burst: u64) -> Self {
        let per_second = per_second as f64;
        Self {
            per_second,
            burst: (burst as f64).max(per_second * WAIT_MIN.as_secs_f64()),
            credit: burst as f64,
            last: Instant::now(),
        }
    }

    /// Counts `units` read; how long to wait before reading on, if reading is ahead of the rate.
    pub(crate) fn owed(&mut self, units: usize) -> Option<Duration> {
        let now = Instant::now();
        let earned = now.duration_since(self.last).as_secs_f64() * self.per_second;
        self.last = now;
        self.credit = (self.credit + earned).min(self.burst) - units as f64;
        let wait = Duration::from_secs_f64((-self.credit).max(0.0) / self.per_second);
        (wait >= WAIT_MIN).then_some(wait)
    }

    /// Counts `units` read, and waits until reading is back within the rate.
    pub(crate) async fn take(&mut self, units: usize) {
        if let Some(wait) = self.owed(units) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// A [`Pace`] several readers share: what they read in all is held to its rate (a server's
/// connections, one per turn for a stdio server, and its event streams). Each reader that reads
/// ahead of the rate waits until the debt of all of them is paid.
pub(crate) type Shared = Arc<Mutex<Pace>>;

/// A [`Shared`] pace of `per_second` units a second, `burst` at once.
pub(crate) fn shared(per_second: u64, burst: u64) -> Shared {
    Arc::new(Mutex::new(Pace::new(per_second, burst)))
}

/// A [`Pace`] for what is read by polling (an `AsyncRead`, a `Stream`): the wait is kept between
/// polls, so a reader polled again, or dropped and made again, waits it out once.
pub(crate) struct Paced {
    pace: Shared,
    wait: Option<Pin<Box<Sleep>>>,
}

impl Paced {
    /// Read through `pace`, which other readers may share.
    pub(crate) fn sharing(pace: &Shared) -> Self {
        Self {
            pace: pace.clone(),
            wait: None,
        }
    }

    /// Ready once reading may go on.
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(wait) = self.wait.as_mut() {
            ready!(wait.as_mut().poll(cx));
            self.wait = None;
        }
        Poll::Ready(())
    }

    /// Waits until reading may go on.
    pub(crate) async fn ready(&mut self) {
        std::future::poll_fn(|cx| self.poll_ready(cx)).await;
    }

    /// Counts `units` read; reading waits, if it is ahead of the rate, at the next
    /// [`Paced::poll_ready`].
    pub(crate) fn count(&mut self, units: usize) {
        let owed = crate::locks::lock(&self.pace).owed(units);
        if let Some(wait) = owed {
            self.wait = Some(Box::pin(tokio::time::sleep(wait)));
        }
    }
}

/// A reader read no faster than a rate of bytes.
pub(crate) struct PacedRead<R> {
    inner: R,
    pace: Paced,
}

impl<R> PacedRead<R> {
    /// `inner`, read at `per_second` bytes a second past a burst of as many.
    #[cfg(test)]
    pub(crate) fn new(inner: R, per_second: u64) -> Self {
        Self::sharing(inner, &shared(per_second, per_second))
    }

    /// `inner`, read through `pace` (bytes), which other readers may share.
    pub(crate) fn sharing(inner: R, pace: &Shared) -> Self {
        Self {
            inner,
            pace: Paced::sharing(pace),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for PacedRead<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.pace.poll_ready(cx));
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        this.pace.count(buf.filled().len() - before);
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the test's paused clock, which moves only when something waits.
    #[tokio::test(start_paused = true)]
    async fn a_burst_passes_at_once_and_the_rest_at_the_rate() {
        let started = Instant::now();
        let mut pace = Pace::new(1_000, 100);
        for _ in 0..100 {
            pace.take(1).await;
        }
        assert_eq!(started.elapsed(), Duration::ZERO);
        for _ in 0..2_000 {
            pace.take(1).await;
        }
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(1_999) && took <= Duration::from_millis(2_001),
            "{took:?}"
        );
        // Idle, it earns no more than its burst.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let rested = Instant::now();
        for _ in 0..1_100 {
            pace.take(1).await;
        }
        let took = rested.elapsed();
        assert!(took >= Duration::from_millis(999), "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_is_read_at_the_pace_past_a_burst() {
        use tokio::io::AsyncReadExt;
        let flood = tokio::io::repeat(b'x').take(3 * 1024 * 1024);
        let mut reader = PacedRead::new(flood, 1024 * 1024);
        let started = Instant::now();
        let read = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await;
        assert_eq!(read.ok(), Some(3 * 1024 * 1024));
        let took = started.elapsed().as_millis();
        assert!((1_998..=2_001).contains(&took), "{took} ms");
    }

    /// Two readers sharing a pace read, together, at its rate.
    #[tokio::test(start_paused = true)]
    async fn readers_that_share_a_pace_read_at_its_rate_together() {
        let pace = shared(1_000, 100);
        let (mut one, mut other) = (Paced::sharing(&pace), Paced::sharing(&pace));
        let started = Instant::now();
        for _ in 0..1_050 {
            one.ready().await;
            one.count(1);
            other.ready().await;
            other.count(1);
        }
        let took = started.elapsed().as_millis();
        assert!((1_995..=2_005).contains(&took), "{took} ms");
    }
}
