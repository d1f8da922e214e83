//! Delivery of terminal results from the outbox: to the journal, an HTTP endpoint (signed with
//! Standard Webhooks headers, `webhook-id` = the event id on every attempt) or a command.
//!
//! Attempts back off exponentially and survive restarts (the schedule lives in SQLite). After
//! `MAX_ATTEMPTS` a delivery is marked failed and kept, visible in `status`, never dropped.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use tracing::Instrument;

use crate::config::{DeliverSettings, Settings, Shared};
use crate::logging;
use crate::metrics;
use crate::signature::standard_signature;
use crate::store::{DeliveryAttempt, PendingDelivery, Store};

/// Attempts before a delivery is marked failed (about 1.5 hours of retries).
pub(crate) const MAX_ATTEMPTS: u32 = 16;
const BACKOFF_CAP: Duration = Duration::from_secs(600);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);
const BATCH: usize = 32;
const POLL_INTERVAL: Duration = Duration::from_secs(1);

pub(crate) struct Deliverer {
    store: Store,
    settings: Arc<Shared<Settings>>,
    client: reqwest::Client,
    wake: Arc<Notify>,
}

impl Deliverer {
    pub(crate) fn new(
        store: Store,
        settings: Arc<Shared<Settings>>,
        wake: Arc<Notify>,
    ) -> Result<Deliverer, String> {
        let client = reqwest::Client::builder()
            .timeout(ATTEMPT_TIMEOUT)
            .user_agent(concat!("agentgate/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| format!("cannot build the delivery HTTP client: {err}"))?;
        Ok(Deliverer {
            store,
            settings,
            client,
            wake,
        })
    }

    /// Delivers due results until `shutdown`, then makes one last pass over what is due (the
    /// drain bounds how long that may take; whatever it cuts off stays in the outbox).
    pub(crate) async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let stopping = shutdown.is_cancelled();
            let due = match self.store.due_deliveries(BATCH).await {
                Ok(due) => due,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot read the outbox");
                    Vec::new()
                }
            };
            let full_batch = due.len() == BATCH;
            let mut attempts = JoinSet::new();
            for delivery in due {
                let deliverer = self.clone();
                let span =
                    logging::event_span(&delivery.event_id, &delivery.session_key, &delivery.route);
                attempts.spawn(async move { deliverer.deliver(delivery).await }.instrument(span));
            }
            while attempts.join_next().await.is_some() {}
            if stopping {
                return;
            }
            if full_batch {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = self.wake.notified() => {}
                () = tokio::time::sleep(POLL_INTERVAL) => {}
            }
        }
    }

    async fn deliver(&self, delivery: PendingDelivery) {
        let settings = self
            .settings
            .get()
            .route(&delivery.route)
            .map_or(DeliverSettings::Log, |route| route.deliver.clone());
        let result = match &settings {
            DeliverSettings::Log => {
                tracing::info!(result = %delivery.body, "turn result");
                Ok(())
            }
            DeliverSettings::Http { url, key } => self.post(url, key.as_ref(), &delivery).await,
            DeliverSettings::Command { argv } => {
                // The whole attempt is bounded: a command that never reads its stdin must not
                // hold the write forever.
                tokio::time::timeout(ATTEMPT_TIMEOUT, run_command(argv, &delivery))
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!(
                            "the deliver command did not finish within {ATTEMPT_TIMEOUT:?}"
                        ))
                    })
            }
        };
        let attempt = delivery.attempts + 1;
        let outcome = match result {
            Ok(()) => {
                metrics::delivery("delivered");
                tracing::info!(attempt, "result delivered");
                DeliveryAttempt::Delivered
            }
            Err(error) if attempt >= MAX_ATTEMPTS => {
                metrics::delivery("failed");
                tracing::error!(attempt, error = %error,
                    "delivery failed for good; kept in the outbox as failed");
                DeliveryAttempt::GaveUp { error }
            }
            Err(error) => {
                metrics::delivery("retry");
                let delay = backoff(attempt);
                tracing::warn!(attempt, retry_in_s = delay.as_secs(), error = %error,
                    "delivery failed; will retry");
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

    async fn post(
        &self,
        url: &str,
        key: Option<&crate::config::Secret>,
        delivery: &PendingDelivery,
    ) -> Result<(), String> {
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut request = self
            .client
            .post(url)
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
        let response = request
            .send()
            .await
            .map_err(|err| format!("POST {url}: {}", describe(&err)))?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("POST {url} answered {}", status.as_u16()))
        }
    }
}

fn describe(err: &reqwest::Error) -> String {
    if err.is_connect() {
        "cannot connect".into()
    } else if err.is_timeout() {
        "timed out".into()
    } else {
        err.to_string()
    }
}

async fn run_command(argv: &[String], delivery: &PendingDelivery) -> Result<(), String> {
    let Some((program, rest)) = argv.split_first() else {
        return Err("deliver.command is empty".into());
    };
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("cannot start {program}: {err}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(delivery.body.as_bytes()).await;
    }
    let output = child
        .wait_with_output()
        .await
        .map_err(|err| format!("{program}: {err}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// 2^attempt seconds, capped, with jitter so that many failed deliveries do not retry in lockstep.
fn backoff(attempt: u32) -> Duration {
    let base = Duration::from_secs(1u64 << attempt.min(12)).min(BACKOFF_CAP);
    base.mul_f64(0.75 + fastrand::f64() / 2.0)
}
