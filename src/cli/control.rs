//! A client for the running daemon's control socket. Operator actions that change what the
//! daemon does (resume, suspend, cancel, reload) go through it while the daemon runs, so that the
//! daemon itself acts at once, logs the action to the journal and counts it.

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
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

/// Sends `method path` to the control socket at `socket`: the response, its body still to be
/// read. A socket that cannot be reached is `Ok(None)`: the caller decides whether that means
/// "no daemon".
async fn send(
    socket: &Path,
    method: http::Method,
    path: &str,
    body: Bytes,
) -> Result<Option<http::Response<Incoming>>, Failure> {
    let Ok(stream) = tokio::net::UnixStream::connect(socket).await else {
        return Ok(None);
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|err| unreachable(socket, &err))?;
    tokio::spawn(connection);
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, "control")
        .body(Full::new(body))
        .map_err(|err| unreachable(socket, &err))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|err| unreachable(socket, &err))?;
    Ok(Some(response))
}

fn unreachable(socket: &Path, err: &dyn std::fmt::Display) -> Failure {
    Failure::unavailable(format!("control socket {}: {err}", socket.display()))
}

/// Sends `method path` to the control socket at `socket` and waits for the whole answer.
async fn request(
    socket: &Path,
    method: http::Method,
    path: &str,
    body: Bytes,
) -> Result<Option<ControlAnswer>, Failure> {
    let Some(response) = send(socket, method, path, body).await? else {
        return Ok(None);
    };
    answer(socket, response).await.map(Some)
}

/// The answer of `response`, its body read whole.
async fn answer(
    socket: &Path,
    response: http::Response<Incoming>,
) -> Result<ControlAnswer, Failure> {
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|err| unreachable(socket, &err))?
        .to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&bytes).trim().to_string())
    });
    Ok(ControlAnswer { status, body })
}

/// How a stream of lines from the daemon ended.
pub(super) enum Streamed {
    /// No daemon answers on the control socket.
    NoDaemon,
    /// The daemon refused the request.
    Refused(ControlAnswer),
    /// The daemon ended the stream, or went away.
    Ended,
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

    /// `GET path` on the control socket, a stream of lines: each non-empty line is handed to
    /// `line` as it arrives, until the stream ends or `line` fails.
    pub(super) fn lines(
        &self,
        path: &str,
        mut line: impl FnMut(&[u8]) -> Result<(), Failure>,
    ) -> Result<Streamed, Failure> {
        let socket = &self.location.control_socket;
        self.block_on(async {
            let sent = send(socket, http::Method::GET, path, Bytes::new()).await?;
            let Some(response) = sent else {
                return Ok(Streamed::NoDaemon);
            };
            if !response.status().is_success() {
                return Ok(Streamed::Refused(answer(socket, response).await?));
            }
            let mut body = response.into_body();
            let mut pending = Vec::new();
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                pending.extend_from_slice(&data);
                while let Some(end) = pending.iter().position(|byte| *byte == b'\n') {
                    let text: Vec<u8> = pending.drain(..=end).collect();
                    if end > 0 {
                        line(&text[..end])?;
                    }
                }
            }
            Ok(Streamed::Ended)
        })
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
