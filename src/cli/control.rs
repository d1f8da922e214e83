//! A client for the running daemon's control socket. Operator actions that change what the
//! daemon does (resume, suspend, cancel, reload) go through it while the daemon runs, so that the
//! daemon itself acts at once, logs the action to the journal and counts it.

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use crate::exit::Failure;
use crate::ingress::api::ErrorBody;

/// One answer of the control socket: the status code and the JSON body.
pub(super) struct ControlAnswer {
    pub(super) status: http::StatusCode,
    pub(super) body: serde_json::Value,
}

impl ControlAnswer {
    /// The daemon's one-line message for a refusal (`{"error", "message"}`).
    pub(super) fn message(&self) -> String {
        match self.document::<ErrorBody>() {
            Ok(refusal) => refusal.message,
            Err(_) => self.body.to_string(),
        }
    }

    /// The body as the document the control API defines for it (`ingress::api`).
    pub(super) fn document<T: serde::de::DeserializeOwned>(&self) -> Result<T, Failure> {
        serde_json::from_value(self.body.clone()).map_err(|err| {
            Failure::runtime(format!(
                "the daemon answered a document this agentgate does not read ({err}); is it \
                 another version?"
            ))
        })
    }
}

/// Sends `method path` to the control socket at `socket` and waits for the answer. A socket that
/// cannot be reached is `Ok(None)`: the caller decides whether that means "no daemon".
async fn request(
    socket: &Path,
    method: http::Method,
    path: &str,
    body: Bytes,
) -> Result<Option<ControlAnswer>, Failure> {
    let Ok(stream) = tokio::net::UnixStream::connect(socket).await else {
        return Ok(None);
    };
    let unreachable = |err: &dyn std::fmt::Display| {
        Failure::unavailable(format!("control socket {}: {err}", socket.display()))
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|err| unreachable(&err))?;
    tokio::spawn(connection);
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, "control")
        .body(Full::new(body))
        .map_err(|err| unreachable(&err))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|err| unreachable(&err))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|err| unreachable(&err))?
        .to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&bytes).trim().to_string())
    });
    Ok(Some(ControlAnswer { status, body }))
}

/// A command's way to the daemon of its config: the config's locations read once, and one
/// runtime for every request the command makes.
pub(super) struct DaemonClient {
    pub(super) location: crate::config::StateLocation,
    runtime: tokio::runtime::Runtime,
}

impl DaemonClient {
    pub(super) fn new(source: &crate::config::ConfigSource) -> Result<DaemonClient, Failure> {
        Ok(DaemonClient {
            location: crate::config::state_location(source).map_err(Failure::config)?,
            runtime: super::runtime()?,
        })
    }

    /// Whether a daemon holds the state directory's lock. Ask the daemon only then (or when
    /// the state is unreadable): under socket activation a connection starts a stopped daemon.
    pub(super) fn runs(&self) -> bool {
        crate::store::DaemonLock::is_held(&self.location.state_dir)
    }

    /// Whether the state exists but this user may not use it. Then `sessions`, `events` and
    /// `status` ask the daemon instead: members of the `_agentgate` group may use its socket.
    /// The packaged state directory is group-readable (0750) but its database is the service's
    /// alone (0600), and a reader of a WAL database writes its shared-memory file: so the
    /// database must be readable and writable here, not only the directory listable.
    pub(super) fn state_unreadable(&self) -> bool {
        use nix::unistd::{AccessFlags, access};
        let state_dir = &self.location.state_dir;
        let database = state_dir.join("agentgate.db");
        if database.exists() {
            return access(&database, AccessFlags::R_OK | AccessFlags::W_OK).is_err();
        }
        matches!(std::fs::read_dir(state_dir),
            Err(err) if err.kind() == std::io::ErrorKind::PermissionDenied)
    }

    /// `method path` on the control socket: `Ok(None)` when no daemon answers.
    pub(super) fn request(
        &self,
        method: http::Method,
        path: &str,
    ) -> Result<Option<ControlAnswer>, Failure> {
        self.block_on(request(
            &self.location.control_socket,
            method,
            path,
            Bytes::new(),
        ))
    }

    /// `POST path` with `body` on the control socket: `Ok(None)` when no daemon answers.
    pub(super) fn post(&self, path: &str, body: Vec<u8>) -> Result<Option<ControlAnswer>, Failure> {
        self.block_on(request(
            &self.location.control_socket,
            http::Method::POST,
            path,
            Bytes::from(body),
        ))
    }

    pub(super) fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }
}

/// The failure when the state is not readable and no daemon answers for it.
pub(super) fn no_daemon_for_unreadable_state() -> Failure {
    Failure::state(
        "the state directory is not readable by this user, and no daemon answers on the control \
         socket",
    )
}

pub(super) use crate::ingress::query::path_segment;
