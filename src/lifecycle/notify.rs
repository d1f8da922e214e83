//! sd_notify: tells systemd when agentgate is ready, what it is doing, that it is alive, and that it
//! is stopping. Outside systemd (`NOTIFY_SOCKET` unset) every call does nothing.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// The notify socket, opened once at startup.
pub(crate) struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET` (a path, or `@name` for an abstract socket).
    pub(crate) fn from_environment() -> Notifier {
        let target = std::env::var("NOTIFY_SOCKET")
            .ok()
            .filter(|path| !path.is_empty())
            .and_then(|path| {
                let address = match path.strip_prefix('@') {
                    Some(name) => SocketAddr::from_abstract_name(name.as_bytes()).ok()?,
                    None => SocketAddr::from_pathname(&path).ok()?,
                };
                Some((UnixDatagram::unbound().ok()?, address))
            });
        Notifier { target }
    }

    fn send(&self, message: &str) {
        if let Some((socket, address)) = &self.target
            && let Err(err) = socket.send_to_addr(message.as_bytes(), address)
        {
            tracing::debug!(error = %err, "sd_notify failed");
        }
    }

    pub(crate) fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={status}"));
    }

    pub(crate) fn status(&self, status: &str) {
        self.send(&format!("STATUS={status}"));
    }

    pub(crate) fn watchdog(&self) {
        self.send("WATCHDOG=1");
    }

    pub(crate) fn reloading(&self) {
        let monotonic_usec = monotonic_micros();
        self.send(&format!(
            "RELOADING=1\nMONOTONIC_USEC={monotonic_usec}\nSTATUS=reloading the config"
        ));
    }

    pub(crate) fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=draining: finishing in-flight requests and running turns");
    }

    /// Pushes systemd's current (stop) timeout out to now + `by`.
    pub(crate) fn extend_timeout(&self, by: Duration) {
        self.send(&format!("EXTEND_TIMEOUT_USEC={}", by.as_micros()));
    }
}

/// The watchdog interval systemd expects pings within, if it watches this process.
pub(crate) fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    let for_us = std::env::var("WATCHDOG_PID")
        .ok()
        .and_then(|pid| pid.parse::<u32>().ok())
        .is_none_or(|pid| pid == std::process::id());
    (for_us && usec > 0).then(|| Duration::from_micros(usec))
}

fn monotonic_micros() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64) * 1_000_000 + (now.tv_nsec as u64) / 1_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_reach_the_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).expect("bind");
        let notifier = Notifier {
            target: Some((
                UnixDatagram::unbound().expect("socket"),
                SocketAddr::from_pathname(&path).expect("address"),
            )),
        };
        notifier.ready("serving");
        notifier.extend_timeout(Duration::from_secs(5));
        let mut buffer = [0u8; 256];
        let n = listener.recv(&mut buffer).expect("recv");
        assert_eq!(&buffer[..n], b"READY=1\nSTATUS=serving");
        let n = listener.recv(&mut buffer).expect("recv");
        assert_eq!(&buffer[..n], b"EXTEND_TIMEOUT_USEC=5000000");
    }
}
