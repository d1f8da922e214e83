//! Locks taken as they are after a panic elsewhere.
//!
//! A task that panics while it holds one of the daemon's locks poisons it. What those locks
//! guard (counts, small maps, the time of a last log line, the settings in effect) holds no
//! invariant a half-done update could break, so the next user takes the lock as it is instead
//! of panicking in turn and taking more of the daemon down with it.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// `mutex`, locked.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `lock`, locked for reading.
pub(crate) fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

/// `lock`, locked for writing.
pub(crate) fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
