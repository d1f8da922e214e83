//! The control socket (Unix, mode 0660): metrics, status and operator overrides for a running
//! daemon. It is a separate listener so that operator access is governed by file permissions,
//! never by the webhook port.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, StatusCode};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::AcceptBackoff;
use super::http::{HttpResponse, error, json_response};
use crate::session::Sessions;
use crate::store::{StatusSummary, Store};

pub(crate) struct Control {
    pub store: Store,
    pub sessions: Arc<Sessions>,
}

impl Control {
    async fn summary(&self) -> Result<StatusSummary, String> {
        self.store
            .status_summary()
            .await
            .map_err(|err| err.to_string())
    }

    async fn answer(&self, request: Request<hyper::body::Incoming>) -> HttpResponse {
        let path = request.uri().path().to_string();
        let method = request.method().clone();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let result = match (&method, segments.as_slice()) {
            (&Method::GET, ["metrics"]) => self.metrics().await,
            (&Method::GET, ["v1", "status"]) => self.status().await,
            (&Method::GET, ["v1", "sessions"]) => self
                .store
                .sessions()
                .await
                .map(|sessions| json_response(StatusCode::OK, &json!(sessions)))
                .map_err(|err| err.to_string()),
            (&Method::POST, ["v1", "sessions", key, action @ ("resume" | "suspend")]) => {
                self.override_session(&percent_decode(key), action).await
            }
            _ => Ok(error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("no control endpoint {method} {path}"),
            )),
        };
        result.unwrap_or_else(|message| {
            error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", &message)
        })
    }

    async fn status(&self) -> Result<HttpResponse, String> {
        let summary = self.summary().await?;
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "daemon": {"running": true, "pid": std::process::id(), "writable": self.store.is_writable()},
                "events": summary.events,
                "sessions": summary.sessions,
                "turns": {"running": self.sessions.running_count()},
                "deliveries": summary.deliveries,
                "nodes": summary.nodes,
            }),
        ))
    }

    async fn metrics(&self) -> Result<HttpResponse, String> {
        let summary = self.summary().await?;
        let mut text = String::new();
        text.push_str(
            "# HELP agentgate_events Accepted events by status.\n# TYPE agentgate_events gauge\n",
        );
        for (status, count) in &summary.events.by_status {
            text.push_str(&format!(
                "agentgate_events{{status=\"{status}\"}} {count}\n"
            ));
        }
        text.push_str(
            "# HELP agentgate_sessions Sessions by state.\n# TYPE agentgate_sessions gauge\n",
        );
        for (state, count) in &summary.sessions.by_state {
            text.push_str(&format!(
                "agentgate_sessions{{state=\"{state}\"}} {count}\n"
            ));
        }
        text.push_str(&format!(
            "# HELP agentgate_turns_running Turns running now.\n# TYPE agentgate_turns_running gauge\nagentgate_turns_running {}\n",
            self.sessions.running_count()
        ));
        text.push_str(&format!(
            "# HELP agentgate_deliveries Outbox rows not yet delivered.\n# TYPE agentgate_deliveries gauge\nagentgate_deliveries{{status=\"pending\"}} {}\nagentgate_deliveries{{status=\"failed\"}} {}\n",
            summary.deliveries.pending, summary.deliveries.failed
        ));
        text.push_str(&format!(
            "# HELP agentgate_store_writable 1 while events can be made durable.\n# TYPE agentgate_store_writable gauge\nagentgate_store_writable {}\n",
            u8::from(self.store.is_writable())
        ));
        let mut response = http::Response::new(http_body_util::Full::new(bytes::Bytes::from(text)));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; version=0.0.4"),
        );
        Ok(response)
    }

    async fn override_session(&self, key: &str, action: &str) -> Result<HttpResponse, String> {
        let before = if action == "resume" {
            self.store.operator_resume(key).await
        } else {
            self.store.operator_suspend(key).await
        }
        .map_err(|err| err.to_string())?;
        self.sessions.wake();
        Ok(match before {
            None => error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("no session {key:?}"),
            ),
            Some(previous) => json_response(
                StatusCode::OK,
                &json!({"session": key, "action": action, "previous_state": previous}),
            ),
        })
    }
}

/// Decodes `%XX` escapes (session keys such as `acme/web#7` travel as `acme%2Fweb%237`).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = (bytes[index] == b'%')
            .then(|| bytes.get(index + 1..index + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        if let Some(byte) = escaped {
            decoded.push(byte);
            index += 3;
        } else {
            decoded.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

/// Serves the control socket until `shutdown`.
pub(crate) async fn serve(
    listener: std::os::unix::net::UnixListener,
    control: Arc<Control>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let mut backoff = AcceptBackoff::default();
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    backoff.failed("control", &err).await;
                    continue;
                }
            },
        };
        backoff.succeeded();
        let control = control.clone();
        let service = service_fn(move |request| {
            let control = control.clone();
            async move { Ok::<_, Infallible>(control.answer(request).await) }
        });
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
