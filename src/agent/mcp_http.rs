//! The HTTP client of MCP servers on the streamable HTTP transport: rmcp's own reqwest client,
//! which also sends a request's `traceparent` (the one a tool call carries in `_meta`) as an
//! HTTP header, so that the server's HTTP layer, and any proxy before it, joins the trace
//! (docs/reference.md, "Traces"), whose errors do not carry the server's URL (a `url` may
//! hold a token: the errors reach the journal, `status` and the model), and which reads each
//! event stream a server sends no faster than `BYTES_PER_SECOND` (`mcp_bounds.rs`): a server
//! that floods events of any size is slowed by its socket, not parsed at a core's speed.
//! Everything else, the response limits included, is rmcp's.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::BoxStream;
use http::{HeaderName, HeaderValue};
use rmcp::model::ClientJsonRpcMessage;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};
use sse_stream::Sse;

use super::mcp_bounds::BYTES_PER_SECOND;
use super::pace::Paced;

/// rmcp's reqwest client, with the trace header.
#[derive(Clone)]
pub(crate) struct TracedClient(pub(crate) reqwest::Client);

/// `custom_headers` with `message`'s `_meta.traceparent`, when it has one.
fn with_traceparent(
    mut custom_headers: HashMap<HeaderName, HeaderValue>,
    message: &ClientJsonRpcMessage,
) -> HashMap<HeaderName, HeaderValue> {
    let traceparent = serde_json::to_value(message).ok().and_then(|value| {
        let text = value
            .pointer("/params/_meta/traceparent")?
            .as_str()?
            .to_string();
        HeaderValue::from_str(&text).ok()
    });
    if let Some(traceparent) = traceparent {
        custom_headers.insert(HeaderName::from_static("traceparent"), traceparent);
    }
    custom_headers
}

/// `error` without the URL reqwest puts in its text.
fn without_url(error: StreamableHttpError<reqwest::Error>) -> StreamableHttpError<reqwest::Error> {
    if let StreamableHttpError::Client(error) = error {
        return StreamableHttpError::Client(error.without_url());
    }
    error
}

/// A server's event stream, read through a pace.
struct PacedEvents {
    inner: BoxStream<'static, Result<Sse, SseError>>,
    pace: Paced,
}

impl Stream for PacedEvents {
    type Item = Result<Sse, SseError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        ready!(this.pace.poll_ready(cx));
        let event = ready!(this.inner.as_mut().poll_next(cx));
        if let Some(Ok(event)) = &event {
            let length = |field: &Option<String>| field.as_ref().map_or(0, String::len);
            this.pace
                .count(length(&event.data) + length(&event.event) + length(&event.id));
        }
        Poll::Ready(event)
    }
}

/// `events`, read no faster than [`BYTES_PER_SECOND`].
fn paced(
    events: BoxStream<'static, Result<Sse, SseError>>,
) -> BoxStream<'static, Result<Sse, SseError>> {
    Box::pin(PacedEvents {
        inner: events,
        pace: Paced::new(BYTES_PER_SECOND, BYTES_PER_SECOND),
    })
}

/// `response`, its event stream (if it is one) paced.
fn paced_response(response: StreamableHttpPostResponse) -> StreamableHttpPostResponse {
    if let StreamableHttpPostResponse::Sse(events, session) = response {
        return StreamableHttpPostResponse::Sse(paced(events), session);
    }
    response
}

impl StreamableHttpClient for TracedClient {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        let headers = with_traceparent(custom_headers, &message);
        self.0
            .post_message(uri, message, session_id, auth_header, headers)
            .await
            .map(paced_response)
            .map_err(without_url)
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        let headers = with_traceparent(custom_headers, &message);
        self.0
            .post_message_with_max_sse_event_size(
                uri,
                message,
                session_id,
                auth_header,
                headers,
                max_sse_event_size,
            )
            .await
            .map(paced_response)
            .map_err(without_url)
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        let headers = with_traceparent(custom_headers, &message);
        self.0
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                headers,
                limits,
            )
            .await
            .map(paced_response)
            .map_err(without_url)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<reqwest::Error>> {
        self.0
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
            .map_err(without_url)
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<reqwest::Error>>
    {
        self.0
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
            .map(paced)
            .map_err(without_url)
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<reqwest::Error>>
    {
        self.0
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
            .map(paced)
            .map_err(without_url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::mcp_bounds::MESSAGE_MAX;
    use futures::StreamExt;

    /// On the test's paused clock, which moves only when something waits.
    #[tokio::test(start_paused = true)]
    async fn event_streams_are_read_at_the_pace_past_a_burst() {
        // Eight a second.
        let event = Sse {
            data: Some("x".repeat(MESSAGE_MAX)),
            ..Sse::default()
        };
        let events = futures::stream::iter((0..24).map(move |_| Ok(event.clone()))).boxed();
        let started = tokio::time::Instant::now();
        assert_eq!(paced(events).count().await, 24);
        let took = started.elapsed().as_millis();
        assert!((1_998..=2_001).contains(&took), "{took} ms");
    }
}
