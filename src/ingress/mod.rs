//! Ingress: the listening sockets and the HTTP server on them.
//!
//! Sockets come from systemd (socket activation, looked up by name in `LISTEN_FDNAMES`) or are
//! bound from the config. They are taken in `main` before the async runtime starts, because the
//! activation protocol is process-global state that must be read before any thread exists.

mod http;
mod ratelimit;
pub(crate) mod verify;

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio_util::sync::CancellationToken;

pub(crate) use self::http::Ingress;
use crate::config::{Config, VerifyScheme};

/// The first fd passed by systemd.
const LISTEN_FDS_START: RawFd = 3;
/// After "stop accepting", connections accepted just before may not have sent their request yet;
/// hyper would treat them as idle and close them. Give them this long to start.
const FIRST_REQUEST_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ListenError {
    #[error("socket activation: {0}")]
    Activation(String),
    #[error("cannot listen on {addr} (server.listen): {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "route {route} has verify = none but the webhook listener {addr} is not on a loopback address"
    )]
    UnsignedOffLoopback { route: String, addr: SocketAddr },
}

/// The webhook listener, inherited or bound.
pub(crate) struct Listeners {
    pub webhook: std::net::TcpListener,
    pub activated: bool,
}

/// Takes the sockets systemd passed by name, or binds `server.listen`. Call before any thread exists.
pub(crate) fn take_listeners(config: &Config) -> Result<Listeners, ListenError> {
    let listeners = match inherited_webhook_socket()? {
        Some(webhook) => Listeners {
            webhook,
            activated: true,
        },
        None => {
            let addr = config.server.listen;
            let webhook = std::net::TcpListener::bind(addr)
                .map_err(|source| ListenError::Bind { addr, source })?;
            Listeners {
                webhook,
                activated: false,
            }
        }
    };
    let addr = listeners
        .webhook
        .local_addr()
        .map_err(|err| ListenError::Activation(format!("webhook socket has no address: {err}")))?;
    if !addr.ip().is_loopback()
        && let Some(route) = config
            .routes
            .iter()
            .find(|r| r.verify.scheme == VerifyScheme::None)
    {
        return Err(ListenError::UnsignedOffLoopback {
            route: route.name.clone(),
            addr,
        });
    }
    Ok(listeners)
}

/// Reads `LISTEN_PID`/`LISTEN_FDS`/`LISTEN_FDNAMES` and returns the socket named `webhook`.
fn inherited_webhook_socket() -> Result<Option<std::net::TcpListener>, ListenError> {
    let Some(count) = std::env::var("LISTEN_FDS").ok() else {
        return Ok(None);
    };
    let for_us = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|pid| pid.parse::<u32>().ok())
        == Some(std::process::id());
    if !for_us {
        return Ok(None);
    }
    let count: RawFd = count
        .parse()
        .map_err(|_| ListenError::Activation(format!("LISTEN_FDS={count:?} is not a number")))?;
    let names_text = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    let names: Vec<&str> = names_text.split(':').collect();
    let mut webhook = None;
    for index in 0..count {
        let fd = LISTEN_FDS_START + index;
        let name = names.get(index as usize).copied().unwrap_or("");
        // SAFETY: systemd passes these fds to this process (LISTEN_PID matched); each is wrapped
        // exactly once here and owned from now on.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        match name {
            "webhook" => {
                // SAFETY: as above; ownership of the fd moves into the listener.
                let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
                listener.local_addr().map_err(|err| {
                    ListenError::Activation(format!(
                        "fd {fd} named webhook is not a TCP listening socket: {err}"
                    ))
                })?;
                webhook = Some(listener);
            }
            "control" => {}
            other => {
                return Err(ListenError::Activation(format!(
                    "fd {fd} has the unknown name {other:?} (LISTEN_FDNAMES={names_text:?}); expected webhook or control"
                )));
            }
        }
    }
    webhook.map(Some).ok_or_else(|| {
        ListenError::Activation(format!(
            "no socket named webhook among LISTEN_FDNAMES={names_text:?}; set FileDescriptorName=webhook"
        ))
    })
}

/// Serves webhooks until `shutdown` fires, then stops accepting and lets in-flight requests finish
/// (for at most `finish_within`).
pub(crate) async fn serve(
    listener: std::net::TcpListener,
    ingress: Arc<Ingress>,
    header_timeout: Duration,
    shutdown: CancellationToken,
    finish_within: Duration,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    loop {
        let (stream, _peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let ingress = ingress.clone();
        let service = service_fn(move |request| ingress.clone().handle(request));
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // Errors here are client-side (reset, timeout); nothing is lost by dropping them.
            let _ = connection.await;
        });
    }
    drop(listener);
    tokio::time::sleep(FIRST_REQUEST_GRACE).await;
    if tokio::time::timeout(finish_within, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("in-flight requests did not finish in time; closing them");
    }
    Ok(())
}
