//! What the console keeps for the daemon's run, held by `Control`: the key of its form tokens,
//! the slots of live transcripts, and when the daemon started.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::guard::ConsoleKey;

/// Live transcripts followed at once, over every browser.
pub(super) const MAX_LIVE_STREAMS: usize = 16;

pub(crate) struct ConsoleState {
    pub(super) key: ConsoleKey,
    live: Arc<Semaphore>,
    /// When the daemon started: the overview's rates are since then.
    pub(super) started: Instant,
}

impl ConsoleState {
    pub(crate) fn new() -> Result<ConsoleState, getrandom::Error> {
        Ok(ConsoleState {
            key: ConsoleKey::generate()?,
            live: Arc::new(Semaphore::new(MAX_LIVE_STREAMS)),
            started: Instant::now(),
        })
    }

    /// A live transcript's slot, held while it streams; `None` when all are taken.
    pub(super) fn live_slot(&self) -> Option<OwnedSemaphorePermit> {
        self.live.clone().try_acquire_owned().ok()
    }
}
