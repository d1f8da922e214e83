//! The HTTP client of MCP servers on the streamable HTTP transport: rmcp's own reqwest client,
//! which also sends a request's `traceparent` (the one a tool call carries in `_meta`) as an
//! HTTP header, so that the server's HTTP layer, and any proxy before it, joins the trace
//! (docs/reference.md, "Traces"), whose errors do not carry the server's URL (a `url` may
//! hold a token: the errors reach the journal, `status` and the model), and which reads the
//! event streams a server sends through its paces (`mcp_bounds.rs`: events, bytes, and the
//! time their reading takes): a server that floods events of any size, or comments, is slowed
//! by its socket, not parsed at a core's speed.
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

use super::mcp_bounds::ServerPaces;
use super::pace::Paced;

/// rmcp's reqwest client, with the trace header, reading the server's event streams through
/// its paces.
#[derive(Clone)]
pub(crate) struct TracedClient {
    pub(crate) client: reqwest::Client,
    pub(crate) paces: ServerPaces,
}

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

/// A server's event stream, read through its paces: of events (each one, with data or
/// without, costs its handling), of bytes, and of the time reading takes.
struct PacedEvents {
    inner: BoxStream<'static, Result<Sse, SseError>>,
    events: Paced,
    bytes: Paced,
    reading: Paced,
}

impl Stream for PacedEvents {
    type Item = Result<Sse, SseError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        ready!(this.events.poll_ready(cx));
        ready!(this.bytes.poll_ready(cx));
        ready!(this.reading.poll_ready(cx));
        let began = std::time::Instant::now();
        let polled = this.inner.as_mut().poll_next(cx);
        let micros = usize::try_from(began.elapsed().as_micros()).unwrap_or(usize::MAX);
        this.reading.count(micros);
        let event = ready!(polled);
        if let Some(Ok(event)) = &event {
            let length = |field: &Option<String>| field.as_ref().map_or(0, String::len);
            this.events.count(1);
            this.bytes
                .count(length(&event.data) + length(&event.event) + length(&event.id));
        }
        Poll::Ready(event)
    }
}

impl TracedClient {
    /// `events`, read through the server's paces of events, bytes and reading time
    /// (`mcp_bounds.rs`), which its other streams share.
    fn paced(
        &self,
        events: BoxStream<'static, Result<Sse, SseError>>,
    ) -> BoxStream<'static, Result<Sse, SseError>> {
        Box::pin(PacedEvents {
            inner: events,
            events: Paced::sharing(&self.paces.lines),
            bytes: Paced::sharing(&self.paces.bytes),
            reading: Paced::sharing(&self.paces.reading),
        })
    }

    /// `response`, its event stream (if it is one) paced.
    fn paced_response(&self, response: StreamableHttpPostResponse) -> StreamableHttpPostResponse {
        if let StreamableHttpPostResponse::Sse(events, session) = response {
            return StreamableHttpPostResponse::Sse(self.paced(events), session);
        }
        response
    }
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
        self.client
            .post_message(uri, message, session_id, auth_header, headers)
            .await
            .map(|response| self.paced_response(response))
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
        self.client
            .post_message_with_max_sse_event_size(
                uri,
                message,
                session_id,
                auth_header,
                headers,
                max_sse_event_size,
            )
            .await
            .map(|response| self.paced_response(response))
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
        self.client
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                headers,
                limits,
            )
            .await
            .map(|response| self.paced_response(response))
            .map_err(without_url)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<reqwest::Error>> {
        self.client
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
        self.client
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
            .map(|events| self.paced(events))
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
        self.client
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
            .map(|events| self.paced(events))
            .map_err(without_url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::mcp_bounds::MESSAGE_MAX;
    use futures::StreamExt;

    fn client() -> TracedClient {
        TracedClient {
            client: crate::tls::http_client()
                .and_then(|builder| builder.build().map_err(|err| err.to_string()))
                .expect("an HTTP client"),
            paces: ServerPaces::default(),
        }
    }

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
        assert_eq!(client().paced(events).count().await, 24);
        let took = started.elapsed().as_millis();
        assert!((1_998..=2_001).contains(&took), "{took} ms");
    }

    /// A stream whose every poll takes a millisecond of work (as a flood of comment lines does,
    /// which the parser reads past without returning) is read for at most 2.5 % of the time.
    #[tokio::test]
    async fn an_event_stream_is_read_for_a_bounded_share_of_the_time() {
        let busy = futures::stream::repeat_with(|| {
            let began = std::time::Instant::now();
            while began.elapsed() < std::time::Duration::from_millis(1) {
                std::hint::spin_loop();
            }
            Ok(Sse::default())
        })
        .take(75)
        .boxed();
        let started = std::time::Instant::now();
        assert_eq!(client().paced(busy).count().await, 75);
        // 25 ms of reading at once, then 25 ms a second: the other 50 take 2 s.
        let took = started.elapsed().as_millis();
        assert!(took >= 1_900, "{took} ms");
    }
}
