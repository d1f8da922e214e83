//! Signals: SIGTERM and SIGINT stop the daemon, SIGHUP reloads it.

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use super::reload::Reloader;
use crate::exit::Failure;
use crate::ingress::control::ReloadRequest;

/// SIGTERM and SIGINT stop the daemon; SIGHUP reloads. Installed before READY, so a signal that
/// arrives early is never lost; after the first stop signal, further ones change nothing (the
/// drain's commits always happen).
pub(super) struct StopSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl StopSignals {
    pub(super) fn install() -> Result<StopSignals, Failure> {
        let install = |kind| {
            signal(kind).map_err(|err| Failure::runtime(format!("cannot handle signals: {err}")))
        };
        Ok(StopSignals {
            terminate: install(SignalKind::terminate())?,
            interrupt: install(SignalKind::interrupt())?,
            hangup: install(SignalKind::hangup())?,
        })
    }

    /// Runs `work` unless a stop signal arrives first. For the waits before READY (a database
    /// server or a writable state to come back): nothing is accepted yet, so a stop then has
    /// nothing to drain and ends the process at once.
    pub(super) async fn unless_stopped<F: Future>(&mut self, work: F) -> Option<F::Output> {
        tokio::select! {
            output = work => Some(output),
            _ = self.terminate.recv() => None,
            _ = self.interrupt.recv() => None,
        }
    }

    /// Waits for a stop signal, carrying out reloads (SIGHUP, or a request from the control
    /// socket that waits for the report) meanwhile.
    pub(super) async fn wait(
        mut self,
        reloader: &Reloader,
        mut reloads: mpsc::Receiver<ReloadRequest>,
    ) {
        loop {
            tokio::select! {
                _ = self.terminate.recv() => return,
                _ = self.interrupt.recv() => return,
                _ = self.hangup.recv() => {
                    reloader.reload();
                }
                Some(requester) = reloads.recv() => {
                    // The requester may have given up waiting; the reload happened anyway.
                    let _ = requester.send(reloader.reload());
                }
            }
        }
    }
}
