//! The answer of a daemon that holds its sockets but cannot serve: `503` with `Retry-After`.
//!
//! Two situations need it. While a start waits before it can accept (the state not yet
//! writable, the database server not yet reachable), senders would otherwise get no answer at
//! all. And a config error under socket activation: exiting hands the sockets back to systemd,
//! whose next connection starts the service again at once, so one bad config became a start
//! loop, then `service-start-limit-hit`, and the port refused every connection until an operator
//! ran `reset-failed`. Holding the sockets and answering keeps the endpoint up and senders
//! retrying (docs/reference.md, "systemd").
//!
//! The webhook listener says only that agentgate cannot accept now: the reason may name files
//! and keys, and webhook senders are strangers. The control socket, which only the service's
//! group reaches, gives the reason in full. Both serve HTTP/1.1 without keep-alive, a bounded
//! number of connections at a time, each with a deadline for its request head.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use super::response::{HttpResponse, unavailable_for};
use super::{AcceptBackoff, Listeners};
use crate::metrics;

/// Connections answered at once per listener; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 64;
/// A request head must arrive within this, or the connection is closed.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long senders are asked to wait before they try again.
const RETRY_AFTER_SECONDS: u64 = 30;
/// What a webhook sender is told.
const PUBLIC_REASON: &str = "agentgate cannot accept events now; retry later";
/// How often the journal says how many requests were answered so.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// Answers every request on `listeners` with 503 until `stop` fires; `reason` (which may
/// change while it waits) is what the control socket says. The listeners are the caller's
/// copies: once `stop` fires and this returns, the sockets are the daemon's again.
pub(crate) async fn answer_unavailable(
    listeners: Listeners,
    reason: watch::Receiver<String>,
    stop: CancellationToken,
) {
    let answered = Arc::new(AtomicU64::new(0));
    let webhook = async {
        let listener = listeners.webhook;
        match listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
        {
            Ok(listener) => {
                let public = watch::channel(PUBLIC_REASON.to_string()).1;
                serve(&listener, public, "webhook", &answered, &stop).await;
            }
            Err(err) => tracing::warn!(error = %err, "cannot answer on the webhook socket"),
        }
    };
    let control = async {
        let Some(control) = listeners.control else {
            return;
        };
        match control
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(control))
        {
            Ok(listener) => serve(&listener, reason.clone(), "control", &answered, &stop).await,
            Err(err) => tracing::warn!(error = %err, "cannot answer on the control socket"),
        }
    };
    tokio::join!(webhook, control, report(&answered, &stop));
}

/// Logs how many requests were answered 503 since the last line, at most every
/// `REPORT_EVERY`, so that a flood of retries is one line, not one per request.
async fn report(answered: &AtomicU64, stop: &CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REPORT_EVERY) => {}
        }
        let count = answered.swap(0, Ordering::Relaxed);
        if count > 0 {
            tracing::warn!(
                count,
                "answered requests with 503: agentgate is not serving (see STATUS=)"
            );
        }
    }
}

/// A listening socket of either kind.
trait Accept {
    type Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<tokio::net::TcpStream> {
        tokio::net::TcpListener::accept(self)
            .await
            .map(|(stream, _)| stream)
    }
}

impl Accept for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<tokio::net::UnixStream> {
        tokio::net::UnixListener::accept(self)
            .await
            .map(|(stream, _)| stream)
    }
}

async fn serve(
    listener: &impl Accept,
    reason: watch::Receiver<String>,
    name: &'static str,
    answered: &Arc<AtomicU64>,
    stop: &CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut backoff = AcceptBackoff::default();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(false);
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(stream) => stream,
                Err(err) => {
                    backoff.failed(name, &err).await;
                    continue;
                }
            },
        };
        backoff.succeeded();
        let (reason, answered, http) = (reason.clone(), answered.clone(), http.clone());
        tokio::spawn(async move {
            let service = service_fn(move |_request| {
                answered.fetch_add(1, Ordering::Relaxed);
                metrics::refusal("", 503, "not_serving");
                let response: HttpResponse = unavailable_for(&reason.borrow(), RETRY_AFTER_SECONDS);
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let _ = http.serve_connection(TokioIo::new(stream), service).await;
            drop(slot);
        });
    }
}
