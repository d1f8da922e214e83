//! Where the commands on events, deliveries and the ledger read and change the state: the state
//! itself, or, for a user who may not read it (a member of the daemon's group, who may use its
//! control socket, mode 0660), the running daemon over its control socket. Either way the
//! command prints the same.

use super::control::{self, ControlAnswer, DaemonClient, path_segment};
use super::state::StateAccess;
use crate::config::ConfigSource;
use crate::exit::Failure;
use crate::ingress::api::EventsPage;
use crate::store::{
    DeliveryRow, DeliveryState, EventDetail, EventFilter, EventRow, Ledger, RetryTarget,
};

pub(super) enum Access {
    State(StateAccess),
    /// A user who cannot read the state: the daemon answers for it.
    Daemon(DaemonClient),
}

impl Access {
    pub(super) fn open(source: &ConfigSource) -> Result<Access, Failure> {
        let daemon = DaemonClient::new(source)?;
        Ok(if daemon.state_unreadable() {
            Access::Daemon(daemon)
        } else {
            drop(daemon);
            Access::State(StateAccess::open(source)?)
        })
    }

    /// Events by `filter`, newest first.
    pub(super) fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, Failure> {
        match self {
            Access::State(state) => Ok(state
                .query(async |store| store.events(filter).await)?
                .unwrap_or_default()),
            Access::Daemon(daemon) => {
                let mut path = format!("/v1/events?limit={}", filter.limit);
                for (name, value) in [
                    ("status", filter.status.map(|status| status.to_string())),
                    ("route", filter.route),
                    ("session", filter.session),
                    ("before", filter.before),
                ] {
                    if let Some(value) = value {
                        path.push_str(&format!("&{name}={}", path_segment(&value)));
                    }
                }
                let page: Option<EventsPage> = document(ask(daemon, http::Method::GET, &path)?)?;
                Ok(page.map(|page| page.events).unwrap_or_default())
            }
        }
    }

    /// One event with its turns and delivery (usage priced); `None` when there is none.
    pub(super) fn event(&self, id: &str) -> Result<Option<EventDetail>, Failure> {
        match self {
            Access::State(state) => {
                let detail = state.query(async |store| store.event(id).await)?.flatten();
                Ok(detail.map(|mut detail| {
                    detail.usage = detail.usage.priced(state.price.as_ref());
                    detail
                }))
            }
            Access::Daemon(daemon) => {
                let path = format!("/v1/events/{}", path_segment(id));
                document(ask(daemon, http::Method::GET, &path)?)
            }
        }
    }

    /// A copy of event `id` accepted as a new event: its id, `None` when there is no such event.
    pub(super) fn replay(&self, id: &str) -> Result<Option<String>, Failure> {
        match self {
            Access::State(state) => Ok(state
                .query(async |store| store.replay_event(id).await)?
                .flatten()),
            Access::Daemon(daemon) => {
                #[derive(serde::Deserialize)]
                struct Replayed {
                    copy: String,
                }
                let path = format!("/v1/events/{}/replay", path_segment(id));
                let replayed: Option<Replayed> = document(ask(daemon, http::Method::POST, &path)?)?;
                Ok(replayed.map(|replayed| replayed.copy))
            }
        }
    }

    /// The outbox, newest first; only deliveries in `state` when given.
    pub(super) fn deliveries(
        &self,
        state: Option<DeliveryState>,
        limit: i64,
    ) -> Result<Vec<DeliveryRow>, Failure> {
        match self {
            Access::State(access) => Ok(access
                .query(async |store| store.deliveries(state, limit).await)?
                .unwrap_or_default()),
            Access::Daemon(daemon) => {
                let filter = match state {
                    Some(state) => format!("&state={state}"),
                    None => String::new(),
                };
                let path = format!("/v1/deliveries?limit={limit}{filter}");
                Ok(document(ask(daemon, http::Method::GET, &path)?)?.unwrap_or_default())
            }
        }
    }

    /// Queues the deliveries of `target` again; returns how many.
    pub(super) fn retry(&self, target: RetryTarget) -> Result<u64, Failure> {
        match self {
            Access::State(state) => Ok(state
                .query(async |store| store.retry_deliveries(target).await)?
                .unwrap_or(0)),
            Access::Daemon(daemon) => {
                #[derive(serde::Deserialize)]
                struct Queued {
                    queued: u64,
                }
                let query = match &target {
                    RetryTarget::One(id) => format!("event={}", path_segment(id)),
                    RetryTarget::AllFailed => "failed".to_string(),
                    RetryTarget::Pending { .. } => "pending".to_string(),
                };
                let answer = ask(
                    daemon,
                    http::Method::POST,
                    &format!("/v1/deliveries/retry?{query}"),
                )?;
                if answer.status == http::StatusCode::CONFLICT {
                    return Ok(0);
                }
                let queued: Option<Queued> = document(answer)?;
                Ok(queued.map_or(0, |queued| queued.queued))
            }
        }
    }

    /// The retry ledger as the next resume will see it.
    pub(super) fn ledger(&self) -> Result<Ledger, Failure> {
        match self {
            Access::State(state) => Ok(state
                .query(async |store| store.resume_ledger().await)?
                .unwrap_or_default()),
            Access::Daemon(daemon) => {
                let answer = ask(daemon, http::Method::GET, "/v1/ledger")?;
                let Some(text) = document::<serde_json::Value>(answer)? else {
                    return Ok(Ledger::default());
                };
                crate::store::ledger::parse(text.to_string().as_bytes()).map_err(|reason| {
                    Failure::runtime(format!("the daemon answered a ledger that is {reason}"))
                })
            }
        }
    }

    /// After a change: files a root-run command created go back to the state's owner.
    pub(super) fn changed(&self) -> Result<(), Failure> {
        match self {
            Access::State(state) => state.restore_ownership(),
            Access::Daemon(_) => Ok(()),
        }
    }
}

/// `method path` on the daemon's control socket; a failure when no daemon answers.
fn ask(daemon: &DaemonClient, method: http::Method, path: &str) -> Result<ControlAnswer, Failure> {
    daemon
        .request(method, path)?
        .ok_or_else(control::no_daemon_for_unreadable_state)
}

/// The document of a successful answer; `None` for `404` (nothing by that name); the daemon's
/// message as the failure otherwise.
fn document<T: serde::de::DeserializeOwned>(answer: ControlAnswer) -> Result<Option<T>, Failure> {
    if answer.status == http::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !answer.status.is_success() {
        return Err(Failure::unavailable(answer.message()));
    }
    answer.document().map(Some)
}
