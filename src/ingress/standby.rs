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
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Listeners;
use super::listener::{self, Accepted, Listener, Serve, Socket, Tls};
use super::response::{HttpResponse, unavailable_for};
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
/// change while it waits) is what the control socket says, the others say only
/// [`PUBLIC_REASON`]. The listeners are the caller's copies: once `stop` fires and this
/// returns, the sockets are the daemon's again.
pub(crate) async fn answer_unavailable(
    listeners: Listeners,
    reason: watch::Receiver<String>,
    stop: CancellationToken,
) {
    let answered = Arc::new(AtomicU64::new(0));
    let public = watch::channel(PUBLIC_REASON.to_string()).1;
    // One request per connection, its head within HEADER_TIMEOUT.
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(false);
    let unavailable = |reason: &watch::Receiver<String>| Unavailable {
        reason: reason.clone(),
        answered: answered.clone(),
        http: http.clone(),
    };
    let tcp = |socket: Option<std::net::TcpListener>, name: &'static str| {
        let (unavailable, stop) = (unavailable(&public), stop.clone());
        async move {
            if let Some(socket) = socket {
                answer(listener::tcp(socket), name, unavailable, stop).await;
            }
        }
    };
    let control = async {
        if let Some(socket) = listeners.control {
            answer(
                listener::unix(socket),
                "control",
                unavailable(&reason),
                stop.clone(),
            )
            .await;
        }
    };
    tokio::join!(
        tcp(Some(listeners.webhook), "webhook"),
        tcp(listeners.metrics, "metrics"),
        tcp(listeners.console, "console"),
        control,
        report(&answered, &stop)
    );
}

/// Answers on `socket` until `stop`.
async fn answer<S: Socket>(
    socket: std::io::Result<S>,
    name: &'static str,
    unavailable: Unavailable,
    stop: CancellationToken,
) {
    match socket {
        Ok(socket) => {
            let listener = Listener {
                socket,
                name,
                max_connections: MAX_CONNECTIONS,
                tls: Tls::Plain,
            };
            listener.run(&unavailable, stop).await;
        }
        Err(err) => tracing::warn!(error = %err, "cannot answer on the {name} socket"),
    }
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

/// What a listener of a daemon that cannot serve answers: 503, with `reason`.
struct Unavailable {
    reason: watch::Receiver<String>,
    answered: Arc<AtomicU64>,
    http: http1::Builder,
}

impl<S: Socket> Serve<S> for &Unavailable {
    fn connection(
        &self,
        accepted: Accepted<S::Stream>,
        _peer: S::Peer,
    ) -> impl Future<Output = ()> + Send + 'static {
        let (reason, answered) = (self.reason.clone(), self.answered.clone());
        let service = service_fn(move |_request| {
            answered.fetch_add(1, Ordering::Relaxed);
            metrics::refusal("", 503, "not_serving");
            let response: HttpResponse = unavailable_for(&reason.borrow(), RETRY_AFTER_SECONDS);
            async move { Ok::<_, std::convert::Infallible>(response) }
        });
        let http = self.http.clone();
        async move {
            let Accepted {
                stream,
                registration,
                ..
            } = accepted;
            tokio::select! {
                _ = http.serve_connection(TokioIo::new(stream), service) => {}
                () = registration.close.cancelled() => {}
            }
        }
    }
}
