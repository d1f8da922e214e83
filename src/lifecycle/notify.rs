//! sd_notify: tells systemd when agentgate is ready, what it is doing, that it is alive, and that it
//! is stopping. Outside systemd (`NOTIFY_SOCKET` unset) every call does nothing.
//!
//! The protocol itself is the `sd-notify` crate's; this module only decides which states go
//! together in one datagram, so that systemd never sees READY without the status that explains it.

use std::time::Duration;

use sd_notify::NotifyState;

fn send(states: &[NotifyState<'_>]) {
    if let Err(err) = sd_notify::notify(states) {
        tracing::debug!(error = %err, "sd_notify failed");
    }
}

pub(crate) fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

pub(crate) fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

pub(crate) fn watchdog() {
    send(&[NotifyState::Watchdog]);
}

/// `RELOADING=1` needs the monotonic time of the reload (systemd 253 and newer reject it
/// without one).
pub(crate) fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[
            NotifyState::Reloading,
            now,
            NotifyState::Status("reloading the config"),
        ]),
        Err(err) => tracing::debug!(error = %err, "cannot read the monotonic clock"),
    }
}

pub(crate) fn stopping() {
    send(&[
        NotifyState::Stopping,
        NotifyState::Status("draining: finishing in-flight requests and running turns"),
    ]);
}

/// Pushes systemd's current (stop) timeout out to now + `by`.
pub(crate) fn extend_timeout(by: Duration) {
    let micros = u32::try_from(by.as_micros()).unwrap_or(u32::MAX);
    send(&[NotifyState::ExtendTimeoutUsec(micros)]);
}

/// Whether a service manager waits for this process's notifications (`NOTIFY_SOCKET` is set).
pub(crate) fn supervised() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// The watchdog interval systemd expects pings within, if it watches this process.
pub(crate) fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled().filter(|interval| !interval.is_zero())
}
