//! Delivery of terminal results from the outbox: to the journal, an HTTP endpoint (signed with
//! Standard Webhooks headers, `webhook-id` = the event id on every attempt) or a command.
//!
//! Attempts back off exponentially and survive restarts (the schedule lives in the store). After
//! `MAX_ATTEMPTS` a delivery is marked failed and kept, visible in `status`, never dropped.
//!
//! The body's wire format is `body.rs`; the store renders it into the outbox row in the
//! transaction that ends the turn, and this module sends it byte for byte.

pub(crate) mod body;

use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;

use crate::telemetry::{self, SpanStart};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use tracing::Instrument;

use crate::agent::process::{Aborted, Child, Limits};
use crate::agent::sandbox::confine;
use crate::config::{DeliverSettings, HiddenPaths, Sandboxing, Settings, Shared, redacted_url};
use crate::locks::lock;
use crate::logging;
use crate::metrics;
use crate::signature::standard_signature;
use crate::store::{DeliveryAttempt, PendingDelivery, RetryTarget, Store};

/// Attempts before a delivery is marked failed (about 1.5 hours of retries).
pub(crate) const MAX_ATTEMPTS: u32 = 16;
const BACKOFF_CAP: Duration = Duration::from_secs(600);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);
/// What of a deliver command's stderr is kept for its error.
const COMMAND_STDERR_CAP: usize = 4096;
/// Due deliveries fetched per round.
const BATCH: usize = 64;
/// Delivery attempts in flight at most, over every target.
const MAX_IN_FLIGHT: usize = 256;
/// Immediate retries of an attempt that failed before any answer (a pooled connection the
/// receiver had closed): the receiver saw nothing, so trying again at once is safe, and waiting
/// a backoff for it is what made connection-closing receivers slow.
const TRANSPORT_RETRIES: u32 = 2;
/// How often the outbox is read when nothing rings the deliverer (for deliveries whose retry
/// time came), unless `AGENTGATE_OUTBOX_POLL` says otherwise.
const POLL_INTERVAL: Duration = Duration::from_secs(1);
const POLL_VARIABLE: &str = "AGENTGATE_OUTBOX_POLL";
/// A route's repeated failures are logged at most this often, with how many were left out.
const FAILURE_LINE_EVERY: Duration = Duration::from_secs(10);

/// The deliverer's handle: whoever queues a result in the outbox rings it, so the result goes
/// out now rather than at the next poll.
#[derive(Clone, Default)]
pub(crate) struct DeliveryHandle(Arc<Notify>);

impl DeliveryHandle {
    /// A result was queued in the outbox.
    pub(crate) fn result_queued(&self) {
        self.0.notify_one();
    }
}

/// The deliverer task.
pub(crate) struct Deliverer {
    store: Store,
    settings: Arc<Shared<Settings>>,
    client: reqwest::Client,
    wake: DeliveryHandle,
    poll: Duration,
    /// Each route's "will retry" lines, at most one every `FAILURE_LINE_EVERY`.
    failure_lines: logging::RepeatedLines,
}

impl Deliverer {
    pub(crate) fn new(store: Store, settings: Arc<Shared<Settings>>) -> Result<Deliverer, String> {
        let client = crate::tls::http_client()?
            .timeout(ATTEMPT_TIMEOUT)
            .build()
            .map_err(|err| format!("cannot build the delivery HTTP client: {err}"))?;
        let poll = match std::env::var(POLL_VARIABLE) {
            Ok(text) => humantime::parse_duration(&text)
                .map_err(|err| err.to_string())
                .and_then(|poll| {
                    (!poll.is_zero())
                        .then_some(poll)
                        .ok_or_else(|| "it must be more than 0".to_string())
                })
                .map_err(|err| format!("{POLL_VARIABLE}={text:?}: {err}"))?,
            Err(_) => POLL_INTERVAL,
        };
        Ok(Deliverer {
            store,
            settings,
            client,
            wake: DeliveryHandle::default(),
            poll,
            failure_lines: logging::RepeatedLines::new(FAILURE_LINE_EVERY),
        })
    }

    pub(crate) fn handle(&self) -> DeliveryHandle {
        self.wake.clone()
    }

    /// Delivers due results until `shutdown`, then makes one last pass over what is due (the
    /// drain bounds how long that may take; whatever it cuts off stays in the outbox).
    ///
    /// Deliveries run concurrently, up to `deliver.concurrency` per route's target and
    /// `MAX_IN_FLIGHT` in all. A target that is slow or stuck fills only its own slots: routes
    /// whose slots are all taken are left out of the next fetch, so their backlog never hides
    /// another route's due results.
    pub(crate) async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut attempts = JoinSet::new();
        let in_flight: Arc<Mutex<HashSet<String>>> = Arc::default();
        let finished = Arc::new(Notify::new());
        let mut targets: HashMap<String, (usize, Arc<Semaphore>)> = HashMap::new();
        loop {
            let stopping = shutdown.is_cancelled();
            while attempts.try_join_next().is_some() {}
            let room = MAX_IN_FLIGHT.saturating_sub(attempts.len());
            if room > 0 {
                let settings = self.settings.get();
                let saturated: Vec<String> = targets
                    .iter()
                    .filter(|(_, (_, slots))| slots.available_permits() == 0)
                    .map(|(route, _)| route.clone())
                    .collect();
                let busy = lock(&in_flight).clone();
                let due = match self
                    .store
                    .due_deliveries(room.min(BATCH) + busy.len(), saturated)
                    .await
                {
                    Ok(due) => due,
                    Err(err) => {
                        tracing::warn!(error = %err, "cannot read the outbox");
                        Vec::new()
                    }
                };
                for delivery in due.into_iter().filter(|d| !busy.contains(&d.event_id)) {
                    let concurrency = settings
                        .route(&delivery.route)
                        .map_or(1, |route| route.deliver.concurrency());
                    let (limit, slots) =
                        targets.entry(delivery.route.clone()).or_insert_with(|| {
                            (
                                concurrency,
                                Arc::new(Semaphore::new(concurrency.min(Semaphore::MAX_PERMITS))),
                            )
                        });
                    if *limit != concurrency {
                        // A reload changed the limit: new attempts use the new one.
                        *limit = concurrency;
                        *slots = Arc::new(Semaphore::new(concurrency.min(Semaphore::MAX_PERMITS)));
                    }
                    let slots = slots.clone();
                    lock(&in_flight).insert(delivery.event_id.clone());
                    let (deliverer, in_flight, finished) =
                        (self.clone(), in_flight.clone(), finished.clone());
                    let span = logging::event_span(
                        &delivery.event_id,
                        &delivery.session_key,
                        &delivery.route,
                    );
                    attempts.spawn(
                        async move {
                            let event_id = delivery.event_id.clone();
                            if let Ok(_slot) = slots.acquire_owned().await {
                                deliverer.deliver(delivery).await;
                            }
                            lock(&in_flight).remove(&event_id);
                            finished.notify_one();
                        }
                        .instrument(span),
                    );
                }
            }
            if stopping {
                while attempts.join_next().await.is_some() {}
                return;
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = self.wake.0.notified() => {}
                () = finished.notified() => {}
                () = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    async fn deliver(&self, delivery: PendingDelivery) {
        let settings = self
            .settings
            .get()
            .route(&delivery.route)
            .map_or(DeliverSettings::Log, |route| route.deliver.clone());
        let attempt = delivery.attempts + 1;
        let span = telemetry::span_under(delivery.trace_parent.as_deref(), || {
            attempt_span(&delivery, &settings, attempt)
        });
        let result = match &settings {
            DeliverSettings::Log => {
                tracing::info!(result = %journal_body(&delivery.body), "turn result");
                Ok(())
            }
            DeliverSettings::Http { url, key, .. } => {
                self.post(url, key.as_ref(), &delivery, span.traceparent())
                    .await
            }
            DeliverSettings::Command { argv, sandbox, .. } => {
                let hidden = self.settings.get().config.hidden.clone();
                run_command(argv, sandbox, &hidden, &delivery).await
            }
        };
        if let Err(error) = &result {
            span.fail("delivery_failed", error);
        }
        let outcome = match result {
            Ok(()) => {
                metrics::delivery(metrics::DeliveryResult::Delivered);
                logging::event_line!(attempt, "result delivered");
                // It had failed, or the route's target has failed here since: the target is back.
                let failed_here = self.failure_lines.clear(&delivery.route);
                if attempt > 1 || failed_here {
                    self.target_answers_again(&delivery.route).await;
                }
                DeliveryAttempt::Delivered
            }
            Err(error) if attempt >= MAX_ATTEMPTS => {
                metrics::delivery(metrics::DeliveryResult::Failed);
                tracing::error!(attempt, error = %error,
                    "delivery failed for good; kept in the outbox as failed");
                DeliveryAttempt::GaveUp { error }
            }
            Err(error) => {
                metrics::delivery(metrics::DeliveryResult::Retry);
                let delay = backoff(attempt);
                if let Some(left_out) = self.failure_lines.due(&delivery.route) {
                    tracing::warn!(attempt, retry_in_s = delay.as_secs(), error = %error,
                        left_out, "delivery failed; will retry");
                }
                DeliveryAttempt::Retry {
                    at: crate::store::now_millis() + delay.as_millis() as i64,
                    error,
                }
            }
        };
        if let Err(err) = self
            .store
            .record_delivery_attempt(&delivery.event_id, outcome)
            .await
        {
            // The attempt is repeated later: delivery is at least once.
            tracing::warn!(error = %err, "cannot record the delivery attempt");
        }
    }

    /// A route's target answered a delivery that had failed before: its other waiting results
    /// are sent now instead of each at the end of its own backoff.
    async fn target_answers_again(&self, route: &str) {
        let target = RetryTarget::Pending {
            route: Some(route.to_string()),
        };
        match self.store.retry_deliveries(target).await {
            Ok(0) => {}
            Ok(count) => {
                tracing::info!(route = %route, count,
                    "the delivery target answers again; its waiting results are sent now");
                self.wake.result_queued();
            }
            Err(err) => tracing::warn!(route = %route, error = %err,
                "cannot bring the route's waiting deliveries forward"),
        }
    }

    async fn post(
        &self,
        url: &crate::config::Secret,
        key: Option<&crate::config::Secret>,
        delivery: &PendingDelivery,
        traceparent: Option<String>,
    ) -> Result<(), String> {
        let url = String::from_utf8_lossy(url.expose()).into_owned();
        let shown = redacted_url(&url);
        let mut retries = 0;
        loop {
            let timestamp = crate::clock::now_seconds();
            let mut request = self
                .client
                .post(&url)
                .header("content-type", "application/json")
                .header("webhook-id", &delivery.event_id)
                .header("webhook-timestamp", timestamp.to_string())
                .body(delivery.body.clone());
            if let Some(key) = key {
                let signature = standard_signature(
                    key.expose(),
                    &delivery.event_id,
                    timestamp,
                    delivery.body.as_bytes(),
                );
                request = request.header("webhook-signature", format!("v1,{signature}"));
            }
            if let Some(traceparent) = &traceparent {
                request = request.header(telemetry::TRACEPARENT, traceparent);
            }
            match request.send().await {
                Ok(response) if response.status().is_success() => return Ok(()),
                Ok(response) => {
                    return Err(format!(
                        "POST {shown} {}",
                        crate::tls::answered(response.status())
                    ));
                }
                Err(err) if !err.is_timeout() && retries < TRANSPORT_RETRIES => retries += 1,
                // Errors carry the URL; it may be the secret, so it is left out.
                Err(err) => {
                    return Err(format!(
                        "POST {shown}: {}",
                        crate::tls::request_failure(&err, "timed out")
                    ));
                }
            }
        }
    }
}

/// The span of one delivery attempt, in its event's trace: `deliver <route>`.
fn attempt_span(delivery: &PendingDelivery, settings: &DeliverSettings, attempt: u32) -> SpanStart {
    let mut attributes = vec![
        KeyValue::new("agentgate.route", delivery.route.clone()),
        KeyValue::new("agentgate.event.id", delivery.event_id.clone()),
        KeyValue::new("agentgate.delivery.attempt", i64::from(attempt)),
    ];
    let kind = match settings {
        DeliverSettings::Http { url, .. } => {
            let url = String::from_utf8_lossy(url.expose()).into_owned();
            attributes.push(KeyValue::new("http.request.method", "POST"));
            // Scheme and host only: the path of an incoming-webhook URL is its secret.
            attributes.push(KeyValue::new("server.address", redacted_url(&url)));
            SpanKind::Client
        }
        DeliverSettings::Command { .. } | DeliverSettings::Log => SpanKind::Internal,
    };
    SpanStart {
        name: format!("deliver {}", delivery.route),
        kind,
        attributes,
    }
}

/// Runs a `command` delivery with the result on stdin. The whole attempt is bounded: a command
/// that never reads its stdin or never exits is stopped at `ATTEMPT_TIMEOUT`.
async fn run_command(
    argv: &[String],
    sandbox: &Sandboxing,
    hidden: &HiddenPaths,
    delivery: &PendingDelivery,
) -> Result<(), String> {
    let Some(child) = Child::new(argv) else {
        return Err("deliver.command is empty".into());
    };
    let child = confine(child, sandbox, hidden).map_err(|not_confined| not_confined.to_string())?;
    let limits = Limits {
        timeout: ATTEMPT_TIMEOUT,
        output_cap: COMMAND_STDERR_CAP,
    };
    let input = delivery.body.clone().into_bytes();
    let finished = match child.run(input, limits, &CancellationToken::new()).await {
        Ok(finished) => finished,
        Err(Aborted::NotStarted(message)) => return Err(message),
        Err(Aborted::Cancelled) => return Err("the deliver command was stopped".into()),
    };
    let program = child.program();
    if finished.timed_out {
        return Err(format!(
            "the deliver command did not finish within {ATTEMPT_TIMEOUT:?}"
        ));
    }
    match finished.status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!(
            "{program} exited with {status}: {}",
            String::from_utf8_lossy(&finished.stderr.bytes).trim()
        )),
        Err(err) => Err(format!("{program}: {err}")),
    }
}

/// 2^attempt seconds, capped, within ±25% so that many failed deliveries do not retry in
/// lockstep.
fn backoff(attempt: u32) -> Duration {
    crate::clock::backoff(Duration::from_secs(1), BACKOFF_CAP, attempt, 0.5)
}

/// A delivery's body as `deliver = "log"` writes it to the journal: an approval request's links
/// left out (whoever holds one decides with it, and the journal is read more widely than a
/// route's target: `agentgate approvals` decides there).
fn journal_body(body: &str) -> std::borrow::Cow<'_, str> {
    let Ok(serde_json::Value::Object(mut request)) = serde_json::from_str(body) else {
        return body.into();
    };
    if request.get("kind").and_then(|kind| kind.as_str()) != Some("approval_request") {
        return body.into();
    }
    for link in ["approve_url", "deny_url"] {
        if request.get(link).is_some_and(|url| !url.is_null()) {
            request.insert(
                link.to_string(),
                "(not logged: decide with agentgate approvals)".into(),
            );
        }
    }
    serde_json::Value::Object(request).to_string().into()
}
