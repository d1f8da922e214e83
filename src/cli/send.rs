//! `send`: posts a payload to a route, signed the way the route verifies it.
//!
//! Without `--url` the running daemon does the signing and the posting (its control socket),
//! because only it can: the route's secret is often a systemd credential that only the service
//! reads, and under socket activation only the daemon knows the socket systemd passed. With
//! `--url`, this command signs with the secrets it can read itself and posts there.

use super::control::{DaemonClient, path_segment};
use super::{load_config, runtime};
use crate::config::{ConfigSource, SecretCheck};
use crate::exit::Failure;
use crate::ingress::{ListenerAnswer, post_signed_webhook};
use crate::output::outln;

pub(super) struct SendRequest {
    pub(super) route: String,
    pub(super) data: Option<String>,
    pub(super) url: Option<String>,
    pub(super) delivery_id: Option<String>,
    pub(super) event_type: Option<String>,
}

pub(super) fn send(source: &ConfigSource, request: &SendRequest) -> Result<(), Failure> {
    let body = match request.data.as_deref() {
        None => b"{}".to_vec(),
        Some(data) => match data.strip_prefix('@') {
            Some(path) => std::fs::read(path)
                .map_err(|err| Failure::runtime(format!("--data @{path}: {err}")))?,
            None => data.as_bytes().to_vec(),
        },
    };
    let delivery_id = request
        .delivery_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let answer = match &request.url {
        Some(base) => send_signed_here(source, request, base, body, &delivery_id)?,
        None => send_through_daemon(source, request, body, &delivery_id)?,
    };
    outln!("{} {}", answer.status, answer.body.trim_end());
    if (200..300).contains(&answer.status) {
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "POST {} answered {}",
            answer.url, answer.status
        )))
    }
}

/// Asks the daemon to sign `body` with the route's secret and post it to its own listener.
fn send_through_daemon(
    source: &ConfigSource,
    request: &SendRequest,
    body: Vec<u8>,
    delivery_id: &str,
) -> Result<ListenerAnswer, Failure> {
    let client = DaemonClient::new(source)?;
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("delivery_id", delivery_id);
    if let Some(event_type) = &request.event_type {
        query.append_pair("event_type", event_type);
    }
    let path = format!(
        "/v1/routes/{}/send?{}",
        path_segment(&request.route),
        query.finish()
    );
    let Some(answer) = client.post(&path, body)? else {
        return Err(Failure::unavailable(format!(
            "no daemon answers on {}: start it, or pass --url http://HOST:PORT to post to a \
             listener yourself (signed with the route's secret, which this user must then be \
             able to read)",
            client.location.control_socket.display()
        )));
    };
    match answer.status {
        http::StatusCode::OK => answer.document::<ListenerAnswer>(),
        http::StatusCode::NOT_FOUND => Err(Failure::config(answer.message())),
        _ => Err(Failure::unavailable(answer.message())),
    }
}

/// Signs `body` with the route's secret as this user reads it, and posts it to `base`.
fn send_signed_here(
    source: &ConfigSource,
    request: &SendRequest,
    base: &str,
    body: Vec<u8>,
    delivery_id: &str,
) -> Result<ListenerAnswer, Failure> {
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
    let url = format!("{}{}", base.trim_end_matches('/'), route.path);
    runtime()?
        .block_on(post_signed_webhook(
            url,
            route,
            body.into(),
            delivery_id,
            request.event_type.as_deref(),
        ))
        .map_err(Failure::unavailable)
}
