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

/// What `send` was asked to post: ROUTE with `--data`, `--delivery-id` and `--event-type`.
pub(super) struct SendArguments {
    pub(super) route: Option<String>,
    pub(super) data: Option<String>,
    pub(super) delivery_id: Option<String>,
    pub(super) event_type: Option<String>,
}

/// What is posted: to which route, the body, its delivery id and event type.
pub(super) struct Outgoing {
    pub(super) route: String,
    pub(super) body: Vec<u8>,
    pub(super) delivery_id: String,
    pub(super) event_type: Option<String>,
}

/// Posts `outgoing` to the running daemon's listener, or to `url`.
pub(super) fn send(
    source: &ConfigSource,
    outgoing: &Outgoing,
    url: Option<&str>,
) -> Result<(), Failure> {
    let answer = match url {
        Some(base) => send_signed_here(source, outgoing, base)?,
        None => send_through_daemon(source, outgoing)?,
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

/// What `--data`, `--delivery-id` and `--event-type` say to post to ROUTE.
pub(super) fn from_arguments(request: SendArguments) -> Result<Outgoing, Failure> {
    let route = request
        .route
        .ok_or_else(|| Failure::usage("send needs a ROUTE (or --schedule NAME)"))?;
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
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    Ok(Outgoing {
        route,
        body,
        delivery_id,
        event_type: request.event_type,
    })
}

/// Asks the daemon to sign the body with the route's secret and post it to its own listener.
fn send_through_daemon(
    source: &ConfigSource,
    outgoing: &Outgoing,
) -> Result<ListenerAnswer, Failure> {
    let client = DaemonClient::new(source)?;
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("delivery_id", &outgoing.delivery_id);
    if let Some(event_type) = &outgoing.event_type {
        query.append_pair("event_type", event_type);
    }
    let path = format!(
        "/v1/routes/{}/send?{}",
        path_segment(&outgoing.route),
        query.finish()
    );
    let Some(answer) = client.post(&path, outgoing.body.clone())? else {
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

/// Signs the body with the route's secret as this user reads it, and posts it to `base`.
fn send_signed_here(
    source: &ConfigSource,
    outgoing: &Outgoing,
    base: &str,
) -> Result<ListenerAnswer, Failure> {
    let config = load_config(source, SecretCheck::Required)?.config;
    let route = config
        .routes
        .iter()
        .find(|r| r.name == outgoing.route)
        .ok_or_else(|| {
            let known: Vec<_> = config.routes.iter().map(|r| r.name.as_str()).collect();
            Failure::config(format!(
                "no route {:?} in {source} (routes: {})",
                outgoing.route,
                known.join(", ")
            ))
        })?;
    let url = format!("{}{}", base.trim_end_matches('/'), route.path);
    runtime()?
        .block_on(post_signed_webhook(
            url,
            route,
            outgoing.body.clone().into(),
            &outgoing.delivery_id,
            outgoing.event_type.as_deref(),
        ))
        .map_err(Failure::unavailable)
}
