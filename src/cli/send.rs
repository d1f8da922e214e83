//! `send`: signs a payload the way a route verifies it and POSTs it (an HTTP client of its own).

use super::output::outln;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::config::{ConfigSource, SecretCheck};
use crate::exit::Failure;
use crate::signature;

use super::*;

pub(super) struct SendRequest {
    pub(super) route: String,
    pub(super) data: Option<String>,
    pub(super) url: Option<String>,
    pub(super) delivery_id: Option<String>,
    pub(super) event_type: Option<String>,
}

pub(super) fn send(source: &ConfigSource, request: &SendRequest) -> Result<(), Failure> {
    let config = load_config(source, SecretCheck::Required)?.config;
    let route = config
        .routes
        .iter()
        .find(|r| r.name == request.route)
        .ok_or_else(|| {
            let known: Vec<_> = config.routes.iter().map(|r| r.name.as_str()).collect();
            Failure::config(format!(
                "no route {:?} in {source} (routes: {})",
                request.route,
                known.join(", ")
            ))
        })?;
    let body = match request.data.as_deref() {
        None => b"{}".to_vec(),
        Some(data) => match data.strip_prefix('@') {
            Some(path) => std::fs::read(path)
                .map_err(|err| Failure::runtime(format!("--data @{path}: {err}")))?,
            None => data.as_bytes().to_vec(),
        },
    };
    let base = request
        .url
        .clone()
        .unwrap_or_else(|| format!("http://{}", config.server.listen));
    let url = format!("{}{}", base.trim_end_matches('/'), route.path);
    let delivery_id = request
        .delivery_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("idempotency-key", &delivery_id);
    for (name, value) in signature::sign(&route.verify, &body, now, &delivery_id) {
        builder = builder.header(name, value);
    }
    let event_type = request
        .event_type
        .clone()
        .or_else(|| route.events.as_ref().and_then(|e| e.first().cloned()));
    if let (Some(header), Some(event_type)) = (
        signature::event_type_header(route.verify.scheme),
        event_type,
    ) {
        builder = builder.header(header, event_type);
    }
    let http_request = builder
        .body(Full::new(Bytes::from(body)))
        .map_err(|err| Failure::config(format!("--url {base}: {err}")))?;
    let runtime = runtime()?;
    let (status, text) = runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let response = client
            .request(http_request)
            .await
            .map_err(|err| Failure::unavailable(format!("POST {url}: {err}")))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|err| Failure::unavailable(format!("POST {url}: reading the answer: {err}")))?
            .to_bytes();
        Ok::<_, Failure>((status, String::from_utf8_lossy(&bytes).into_owned()))
    })?;
    outln!("{} {}", status.as_u16(), text.trim_end());
    if status.is_success() {
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "POST {url} answered {}",
            status.as_u16()
        )))
    }
}
