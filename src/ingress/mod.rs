//! Ingress: the listening sockets and the HTTP server on them.
//!
//! Sockets come from systemd (socket activation, looked up by name in `LISTEN_FDNAMES`) or are
//! bound from the config. They are taken in `main` before the async runtime starts, because the
//! activation protocol is process-global state that must be read before any thread exists.

mod acknowledge;
pub(crate) mod api;
mod approval_link;
mod approvals;
mod body;
pub(crate) mod capacity;
mod connection;
mod console;
pub(crate) mod control;
pub(crate) mod control_listener;
mod follow;
mod http;
mod listener;
mod operations;
mod payload;
pub(crate) mod query;
mod ratelimit;
mod response;
pub(crate) mod standby;
mod unread;
mod webhook_listener;

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::path::Path;

pub(crate) use self::http::Ingress;
use crate::config::{Config, VerifyScheme};
pub(crate) use body::BodySlots;
pub(crate) use console::Console;
pub(crate) use operations::Operations;
pub(crate) use webhook_listener::WebhookListener;

/// Body parsing, for the `request` fuzz target.
#[cfg(feature = "fuzzing")]
pub(crate) fn parse_for_fuzzing(headers: &::http::HeaderMap, body: bytes::Bytes) {
    let _ = self::payload::parse_payload(headers, body, VerifyScheme::Slack);
}

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

/// The URL at which this machine reaches a listener on `addr`: an unspecified address (all
/// addresses, as the packaged socket listens) as the loopback address of its family.
pub(crate) fn local_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip @ (std::net::IpAddr::V4(_) | std::net::IpAddr::V6(_)) => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

pub(crate) use api::ListenerAnswer;

/// How long `agentgate send` waits for the listener's answer.
const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Posts `body` to `url` as a webhook that `route` accepts, signed with its secret (see
/// `signature::webhook_headers`): what `agentgate send` does, from the command with `--url` and
/// from the daemon otherwise. HTTPS is verified against the public web roots.
pub(crate) async fn post_signed_webhook(
    url: String,
    route: &crate::config::RouteSettings,
    body: bytes::Bytes,
    delivery_id: &str,
    event_type: Option<&str>,
) -> Result<ListenerAnswer, String> {
    let client = crate::tls::http_client()?
        .timeout(SEND_TIMEOUT)
        .build()
        .map_err(|err| format!("HTTP client: {err}"))?;
    let mut post = client.post(&url);
    // Without one given, the route's first `events` entry.
    let event_type = event_type.or_else(|| {
        route
            .events
            .as_ref()
            .and_then(|events| events.first())
            .map(String::as_str)
    });
    for (name, value) in
        crate::signature::webhook_headers(&route.verify, &body, delivery_id, event_type)
    {
        post = post.header(name, value);
    }
    let response = post.body(body).send().await.map_err(|err| {
        let failure = crate::tls::request_failure(&err, "no answer in time");
        format!("POST {url}: {failure}")
    })?;
    let status = response.status().as_u16();
    let body = response
        .text()
        .await
        .map_err(|err| format!("POST {url}: reading the answer: {err}"))?;
    Ok(ListenerAnswer { url, status, body })
}

/// The listening sockets, passed by systemd (or a test) or bound from the config.
pub(crate) struct Listeners {
    pub webhook: std::net::TcpListener,
    /// `None` when it was neither passed nor could be bound (logged; the daemon runs without it).
    pub control: Option<std::os::unix::net::UnixListener>,
    /// The sockets passed for the metrics and console listeners (`FileDescriptorName=metrics`,
    /// `console`); when `None`, `server.metrics_listen` and `console.listen` are bound.
    pub metrics: Option<std::net::TcpListener>,
    pub console: Option<std::net::TcpListener>,
    pub activated: bool,
}

impl Listeners {
    /// Copies of the same sockets (close-on-exec), for answering on while the daemon cannot.
    pub(crate) fn try_clone(&self) -> std::io::Result<Listeners> {
        let tcp = |socket: &Option<std::net::TcpListener>| {
            socket
                .as_ref()
                .map(std::net::TcpListener::try_clone)
                .transpose()
        };
        Ok(Listeners {
            webhook: self.webhook.try_clone()?,
            control: self
                .control
                .as_ref()
                .map(std::os::unix::net::UnixListener::try_clone)
                .transpose()?,
            metrics: tcp(&self.metrics)?,
            console: tcp(&self.console)?,
            activated: self.activated,
        })
    }
}

/// The sockets systemd passed (`inherited_sockets`), or else binds `server.listen` and the
/// control socket. Call before any thread exists.
pub(crate) fn take_listeners(
    config: &Config,
    inherited: Option<Listeners>,
) -> Result<Listeners, ListenError> {
    let listeners = if let Some(inherited) = inherited {
        inherited
    } else {
        let addr = config.server.listen;
        let webhook = std::net::TcpListener::bind(addr)
            .map_err(|source| ListenError::Bind { addr, source })?;
        Listeners {
            webhook,
            control: bind_control_socket(&config.server.control_socket),
            metrics: None,
            console: None,
            activated: false,
        }
    };
    let addr = listeners
        .webhook
        .local_addr()
        .map_err(|err| ListenError::Activation(format!("webhook socket has no address: {err}")))?;
    refuse_unsigned_off_loopback(config, addr)?;
    Ok(listeners)
}

/// `verify = none` is refused unless the webhook listener at `addr` is on a loopback address.
/// Checked at start and again by every reload.
pub(crate) fn refuse_unsigned_off_loopback(
    config: &Config,
    addr: SocketAddr,
) -> Result<(), ListenError> {
    match config
        .routes
        .iter()
        .find(|r| r.verify.scheme == VerifyScheme::None)
    {
        Some(route) if !addr.ip().is_loopback() => Err(ListenError::UnsignedOffLoopback {
            route: route.name.clone(),
            addr,
        }),
        _ => Ok(()),
    }
}

/// Binds the control socket at `path` (mode 0660), replacing a stale socket file. Failure is not
/// fatal: webhooks matter more than the control socket, so it is logged and skipped.
fn bind_control_socket(path: &Path) -> Option<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let bind = || -> std::io::Result<std::os::unix::net::UnixListener> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process answers on it",
            ));
        }
        let _ = std::fs::remove_file(path);
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
        Ok(listener)
    };
    match bind() {
        Ok(listener) => Some(listener),
        Err(err) => {
            tracing::warn!(path = %path.display(), error = %err,
                "control socket unavailable (server.control_socket); continuing without it");
            None
        }
    }
}

/// Reads `LISTEN_PID`/`LISTEN_FDS`/`LISTEN_FDNAMES` and takes the sockets named `webhook`,
/// `control`, `metrics` and `console`. The names come from `sd-notify`; `listenfd` checks each
/// fd's socket type and takes ownership of it. Both read (and `listenfd` clears) process-global
/// environment, which is why this runs before any thread exists, and before the config is read:
/// a config that cannot be used still leaves the daemon its sockets to answer on (`standby`).
pub(crate) fn inherited_sockets() -> Result<Option<Listeners>, ListenError> {
    let named: Vec<(RawFd, String)> = sd_notify::listen_fds_with_names()
        .map_err(|err| ListenError::Activation(format!("LISTEN_FDS/LISTEN_FDNAMES: {err}")))?
        .collect();
    if named.is_empty() {
        return Ok(None);
    }
    let names_text = named
        .iter()
        .map(|(_, name)| name.as_str())
        .collect::<Vec<_>>()
        .join(":");
    let mut passed = listenfd::ListenFd::from_env();
    let (mut webhook, mut control, mut metrics, mut console) = (None, None, None, None);
    for (index, (fd, name)) in named.iter().enumerate() {
        let wrong_kind = |kind: &str, err: std::io::Error| {
            ListenError::Activation(format!(
                "fd {fd} named {name} is not a {kind} listening socket: {err}"
            ))
        };
        let missing = || ListenError::Activation(format!("fd {fd} ({name}) was not passed"));
        let mut tcp = || {
            passed
                .take_tcp_listener(index)
                .map_err(|err| wrong_kind("TCP", err))?
                .ok_or_else(missing)
        };
        match name.as_str() {
            "webhook" => webhook = Some(tcp()?),
            "metrics" => metrics = Some(tcp()?),
            "console" => console = Some(tcp()?),
            "control" => {
                let listener = passed
                    .take_unix_listener(index)
                    .map_err(|err| wrong_kind("Unix", err))?
                    .ok_or_else(missing)?;
                control = Some(listener);
            }
            other => {
                return Err(ListenError::Activation(format!(
                    "fd {fd} has the unknown name {other:?} (LISTEN_FDNAMES={names_text:?}); expected webhook, control, metrics or console"
                )));
            }
        }
    }
    let webhook = webhook.ok_or_else(|| {
        ListenError::Activation(format!(
            "no socket named webhook among LISTEN_FDNAMES={names_text:?}; set FileDescriptorName=webhook"
        ))
    })?;
    Ok(Some(Listeners {
        webhook,
        control,
        metrics,
        console,
        activated: true,
    }))
}
