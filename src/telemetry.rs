//! Traces of every run, exported over OTLP/HTTP (docs/reference.md, "Traces").
//!
//! An event is one trace: the webhook request, each turn, each model request, each tool call and
//! each delivery attempt are its spans. The trace outlives the process: the request span's
//! context is stored with the event (`traceparent`), so a turn that runs after a restart, or
//! resumes after a crash, is a child of the same request. Spans are batched on a thread of
//! their own and sent in the background; a collector that is down or slow costs spans
//! (counted), never work, and the accept path and the turns never wait on it.
//!
//! With no `otlp_endpoint` every function here returns a span that does nothing.
//!
//! These spans are made here directly, not from the `tracing` spans of the journal through a
//! layer: why is written in `session::runner::spans`.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData,
    SpanExporter, SpanProcessor,
};

use crate::config::TelemetrySettings;
use crate::metrics;

/// The W3C Trace Context header, read from webhooks and sent with deliveries and MCP requests.
pub(crate) const TRACEPARENT: &str = "traceparent";

/// Spans waiting for the exporter at most; more are dropped and counted.
const QUEUE: usize = 4096;
/// How long one export may take before it counts as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a failing collector is reported in the journal at most.
const FAILURE_LINE_EVERY: Duration = Duration::from_secs(60);

/// The tracer, once `[telemetry] otlp_endpoint` started it.
struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    capture_content: bool,
}

static TRACING: OnceLock<Tracing> = OnceLock::new();

/// Why traces could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("traces cannot be exported to {endpoint}: {reason}")]
pub(crate) struct TelemetryError {
    endpoint: String,
    reason: String,
}

/// Starts the exporter when `settings` name a collector. Once per process: the endpoint applies
/// at restart.
pub(crate) fn start(settings: &TelemetrySettings) -> Result<(), TelemetryError> {
    let Some(endpoint) = &settings.otlp_endpoint else {
        return Ok(());
    };
    let failed = |reason: String| TelemetryError {
        endpoint: crate::config::redacted_url(endpoint),
        reason,
    };
    let client = crate::tls::blocking_http_client(EXPORT_TIMEOUT).map_err(failed)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(format!("{endpoint}/v1/traces"))
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        // Its message may repeat the endpoint, which may hold a secret.
        .map_err(|err| failed(err.to_string().replace(endpoint.as_str(), "the endpoint")))?;
    let batches = BatchConfigBuilder::default()
        .with_max_queue_size(QUEUE)
        .build();
    let processor = BatchSpanProcessor::builder(Counted::new(exporter))
        .with_batch_config(batches)
        .build();
    let resource = Resource::builder()
        .with_service_name("agentgate")
        .with_attribute(KeyValue::new("service.version", crate::VERSION))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Ended)
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "agentgate");
    let _ = TRACING.set(Tracing {
        provider,
        tracer,
        capture_content: settings.capture_content,
    });
    tracing::info!(
        endpoint = %crate::config::redacted_url(endpoint),
        sample_ratio = settings.sample_ratio,
        capture_content = settings.capture_content,
        "traces are exported over OTLP/HTTP"
    );
    Ok(())
}

/// Sends what is queued, waiting at most `limit`; at the end of a drain.
pub(crate) fn stop(limit: Duration) {
    if let Some(tracing) = TRACING.get()
        && let Err(err) = tracing.provider.shutdown_with_timeout(limit)
    {
        tracing::warn!(error = %err, "traces not exported at shutdown");
    }
}

/// Whether messages, tool arguments and results become span attributes
/// (`[telemetry] capture_content`).
pub(crate) fn captures_content() -> bool {
    TRACING.get().is_some_and(|tracing| tracing.capture_content)
}

/// What a span is, made only when traces are on: its name, kind and attributes.
pub(crate) struct SpanStart {
    pub name: String,
    pub kind: SpanKind,
    pub attributes: Vec<KeyValue>,
}

/// A span being recorded, ended when dropped. Does nothing when traces are off.
pub(crate) struct Span {
    context: Context,
}

impl Span {
    /// A span that records nothing and has no parent to give.
    pub(crate) fn off() -> Span {
        Span {
            context: Context::new(),
        }
    }

    /// The span `describe` says under `parent`; `describe` runs only when traces are on.
    fn start(parent: impl FnOnce() -> Context, describe: impl FnOnce() -> SpanStart) -> Span {
        let Some(tracing) = TRACING.get() else {
            return Span::off();
        };
        let (
            parent,
            SpanStart {
                name,
                kind,
                attributes,
            },
        ) = (parent(), describe());
        let span = tracing.tracer.build_with_context(
            opentelemetry::trace::SpanBuilder::from_name(name)
                .with_kind(kind)
                .with_attributes(attributes),
            &parent,
        );
        Span {
            context: parent.with_span(span),
        }
    }

    /// A span under this one.
    pub(crate) fn child(&self, describe: impl FnOnce() -> SpanStart) -> Span {
        Span::start(|| self.context.clone(), describe)
    }

    pub(crate) fn set(&self, key: &'static str, value: impl Into<Value>) {
        self.context.span().set_attribute(KeyValue::new(key, value));
    }

    /// Sets `key` to what `content` makes, only with `capture_content` (the text is not even
    /// made otherwise), cut to [`CONTENT_MAX`] bytes: the export queue holds thousands of spans.
    pub(crate) fn content(&self, key: &'static str, content: impl FnOnce() -> String) {
        if captures_content() && self.context.span().is_recording() {
            self.set(key, bounded(content()));
        }
    }

    /// Something that happened during the span (an approval requested, a budget warning).
    pub(crate) fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        self.context.span().add_event(name, attributes);
    }

    /// Links this span to the one `traceparent` names (the run a resumed turn continues).
    pub(crate) fn link_to(&self, traceparent: &str) {
        let earlier = parent_of(Some(traceparent));
        let context = earlier.span().span_context().clone();
        if context.is_valid() {
            self.context
                .span()
                .add_link(context, vec![KeyValue::new("agentgate.link", "continues")]);
        }
    }

    /// The span failed: `error.type` and an error status with `description`.
    pub(crate) fn fail(&self, error_type: &str, description: &str) {
        let span = self.context.span();
        span.set_attribute(KeyValue::new("error.type", error_type.to_string()));
        span.set_status(Status::error(description.to_string()));
    }

    /// The W3C `traceparent` of this span, for a request it makes or for the store; `None`
    /// when traces are off.
    pub(crate) fn traceparent(&self) -> Option<String> {
        if !self.context.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&self.context, &mut carrier);
        carrier.remove(TRACEPARENT)
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        self.context.span().end();
    }
}

/// The most of one content attribute (`capture_content`), in bytes: with the queue's 4,096
/// spans, content can hold at most about 64 MiB while the collector is slow.
pub(crate) const CONTENT_MAX: usize = 8 * 1024;

/// `text` cut to [`CONTENT_MAX`] bytes at a character boundary, saying how much was left out.
fn bounded(mut text: String) -> String {
    let left_out = crate::untrusted::cut(&mut text, CONTENT_MAX);
    if left_out > 0 {
        text.push_str(&format!("… [{left_out} more bytes]"));
    }
    text
}

/// The parent a `traceparent` names: a remote span, or none (a new trace) when it is missing or
/// malformed.
fn parent_of(traceparent: Option<&str>) -> Context {
    let Some(traceparent) = traceparent else {
        return Context::new();
    };
    let carrier = HashMap::from([(TRACEPARENT.to_string(), traceparent.to_string())]);
    TraceContextPropagator::new().extract(&carrier)
}

/// The span `describe` says, whose parent is `traceparent` (an incoming request's, or the one
/// stored with an event), or the root of a new trace without one. With traces off nothing is
/// made: not even the attributes.
pub(crate) fn span_under(traceparent: Option<&str>, describe: impl FnOnce() -> SpanStart) -> Span {
    Span::start(|| parent_of(traceparent), describe)
}

/// Counts what the collector took and what it did not, and says so in the journal at most once
/// a minute: spans are worth less than the work, so a failing collector only costs spans.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    failure_lines: std::sync::Mutex<crate::logging::OneLineEvery>,
    failed_since_line: AtomicU64,
}

impl<E> Counted<E> {
    fn new(inner: E) -> Counted<E> {
        Counted {
            inner,
            failure_lines: std::sync::Mutex::new(crate::logging::OneLineEvery::new(
                FAILURE_LINE_EVERY,
            )),
            failed_since_line: AtomicU64::new(0),
        }
    }

    fn failed(&self, spans: u64, error: &str) {
        metrics::trace_spans(metrics::SpanOutcome::Dropped, spans);
        let skipped = self.failed_since_line.fetch_add(spans, Ordering::Relaxed) + spans;
        if crate::locks::lock(&self.failure_lines).due().is_some() {
            self.failed_since_line.store(0, Ordering::Relaxed);
            tracing::warn!(error = %error, spans_dropped = skipped,
                "the trace collector did not take spans; they are dropped");
        }
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = u64::try_from(batch.len()).unwrap_or(u64::MAX);
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => metrics::trace_spans(metrics::SpanOutcome::Exported, spans),
            Err(err) => self.failed(spans, &err.to_string()),
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Counts the spans that ended (and were sampled): what was neither exported nor dropped by a
/// failed export was dropped because the queue was full, or is still queued.
#[derive(Debug)]
struct Ended;

impl SpanProcessor for Ended {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &Context) {}

    fn on_end(&self, _: SpanData) {
        metrics::trace_spans(metrics::SpanOutcome::Ended, 1);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_cut_at_a_character_boundary_and_says_how_much() {
        assert_eq!(bounded("short".to_string()), "short");
        let long = "é".repeat(CONTENT_MAX); // two bytes each
        let cut = bounded(long);
        let (kept, note) = cut.split_once('…').expect("a note");
        assert_eq!(kept.len(), CONTENT_MAX);
        assert_eq!(note, format!(" [{} more bytes]", CONTENT_MAX));
    }
}
