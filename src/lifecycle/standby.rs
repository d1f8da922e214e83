//! Standing by: the daemon holds its sockets and answers `503` + `Retry-After` while it cannot
//! serve, instead of leaving senders without an answer or handing the sockets back to systemd.
//!
//! [`Standby`] covers the waits of a start (a full state file system, a database server that is
//! not up yet): the first wait says `READY=1` with the reason in `STATUS=`, so that systemd
//! does not fail the start while it waits, and pings the watchdog from then on. [`hold`] covers
//! a config error under socket activation: the process stays, answers, and says in `STATUS=`
//! what is wrong, until it is stopped; after the fix, `systemctl restart agentgate` starts it
//! at once. Exiting instead would let the next connection start the service again, in a loop
//! that ends with systemd taking the sockets down (docs/reference.md, "systemd").

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::notify;
use super::signals::StopSignals;
use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::ingress::Listeners;
use crate::ingress::standby::answer_unavailable;
use crate::store::DaemonLock;

/// How often the watchdog is pinged without a watchdog interval to follow (`STATUS=` only).
const STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// Answers 503 on copies of the daemon's sockets while a start waits.
pub(super) struct Standby {
    copies: Option<Listeners>,
    reason: watch::Sender<String>,
    stop: CancellationToken,
    answering: Option<tokio::task::JoinHandle<()>>,
}

impl Standby {
    /// Ready to answer on copies of `listeners`; it answers nothing until a wait begins.
    pub(super) fn new(listeners: &Listeners) -> Standby {
        let copies = listeners
            .try_clone()
            .inspect_err(|err| {
                tracing::warn!(error = %err,
                    "cannot copy the listening sockets; waits before READY will not answer 503");
            })
            .ok();
        Standby {
            copies,
            reason: watch::channel(String::new()).0,
            stop: CancellationToken::new(),
            answering: None,
        }
    }

    /// The daemon cannot serve, for the reason `status` gives: answers 503 from now on (the
    /// first time: `READY=1`, so that a wait does not fail the unit's start) and shows `status`
    /// in `STATUS=` and on the control socket.
    pub(super) fn waiting(&mut self, status: &str) {
        let status = status.to_string();
        self.reason.send_replace(status.clone());
        if self.answering.is_some() {
            notify::status(&status);
            return;
        }
        let Some(copies) = self.copies.take() else {
            notify::status(&status);
            return;
        };
        notify::ready(&status);
        let (reason, stop) = (self.reason.subscribe(), self.stop.clone());
        self.answering = Some(tokio::spawn(async move {
            tokio::join!(
                answer_unavailable(copies, reason, stop.clone()),
                ping_watchdog(&stop)
            );
        }));
    }

    /// The daemon serves now: the copies are closed before this returns, so that the daemon's
    /// own listeners take every connection from here on.
    pub(super) async fn end(self) {
        self.stop.cancel();
        if let Some(answering) = self.answering {
            let _ = answering.await;
        }
    }
}

/// Pings the watchdog until `stop`, as the health task does once the daemon serves.
async fn ping_watchdog(stop: &CancellationToken) {
    let interval = notify::watchdog_interval().map_or(STATUS_INTERVAL, |w| w / 3);
    loop {
        notify::watchdog();
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// A start refused by `failure` (a config error) under socket activation: holds the sockets,
/// answers 503 with the reason on the control socket, and says it in `STATUS=` and the
/// journal, until SIGTERM or SIGINT. Exits 0 then: the unit was stopped, not failed again.
pub(crate) fn hold(
    listeners: Listeners,
    failure: &Failure,
    source: &ConfigSource,
) -> Result<(), Failure> {
    // The state's lock, where the config still names the state: `agentgate status` then knows
    // that a daemon runs and asks it why it does not serve, which it would not do otherwise
    // (under socket activation a connection starts a stopped daemon).
    let _lock = crate::config::state_location(source)
        .ok()
        .and_then(|location| DaemonLock::acquire(&location.state_dir).ok());
    let status = format!(
        "not serving: {failure}; fix it, then run systemctl restart agentgate (check-config shows the findings)"
    );
    tracing::error!(error = %failure,
        "cannot start; holding the sockets and answering 503 until the config is fixed and the service restarted");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))?;
    runtime.block_on(async {
        let mut signals = StopSignals::install()?;
        let mut standby = Standby::new(&listeners);
        drop(listeners);
        standby.waiting(&status);
        signals.unless_stopped(std::future::pending::<()>()).await;
        notify::stopping();
        standby.end().await;
        Ok(())
    })
}
