//! [`Coordination`] on SQLite: one node, so nothing is shared; the store's health is the
//! writer thread's.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::SqliteStore;
use crate::store::{Coordination, StoreError};

#[async_trait::async_trait]
impl Coordination for SqliteStore {
    async fn answers(&self) -> bool {
        self.write(|_| Ok(())).await.is_ok()
    }

    async fn request_interrupt(&self, _session_key: &str) -> Result<(), StoreError> {
        Ok(())
    }

    async fn interrupts_requested(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }

    async fn release(&self) {}

    fn is_writable(&self) -> bool {
        self.writable.load(Ordering::Acquire)
    }

    fn failover_interval(&self) -> Option<Duration> {
        None
    }

    fn lease_at_risk(&self, _session_key: &str) -> bool {
        false
    }
}
