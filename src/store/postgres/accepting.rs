//! [`Accepting`] on PostgreSQL: group commit of accepted events (writer tasks take whatever
//! arrived meanwhile and insert it in one transaction; each event's answer waits for that
//! COMMIT), internal events, and retention.

use std::sync::Arc;

use const_format::concatcp;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::connect::{Cached, bounded};
use super::{ACCEPT_BATCH, AcceptJob, InTx, PostgresStore};
use crate::store::model::{AcceptOutcome, DedupWindow, Event, NewEvent};
use crate::store::row::StoredRow;
use crate::store::sql::{
    DELETE_EVENT_SQL, ORIGINAL_SQL, PRUNABLE_EVENTS_SQL, PRUNE_BATCH, PRUNE_DEDUP_SQL,
    PRUNE_SESSIONS_SQL,
};
use crate::store::states::{BACKGROUND, IDLE, QUEUED};
use crate::store::turns;
use crate::store::{Accepting, StoreError, now_millis};

/// `$1` route, `$2` delivery id, `$3` event id, `$4` now, `$5` the start of the dedup window:
/// the delivery id is this event's, unless an event within the window has it (no row returned).
pub(super) const REMEMBER_DELIVERY_SQL: &str =
    "INSERT INTO dedup (route, delivery_id, event_id, seen_at) VALUES ($1, $2, $3, $4)
     ON CONFLICT (route, delivery_id) DO UPDATE
         SET event_id = EXCLUDED.event_id, seen_at = EXCLUDED.seen_at
         WHERE dedup.seen_at < $5
     RETURNING event_id";

/// `$1` route, `$2` delivery id: the event first accepted with it.
pub(super) const FIRST_ACCEPTED_SQL: &str =
    "SELECT event_id FROM dedup WHERE route = $1 AND delivery_id = $2";

/// A batch of events, in their order of arrival: `$1`..`$7` and `$10` the columns as arrays,
/// `$8` now, `$9` this node.
pub(super) const INSERT_EVENTS_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, node, trace_parent)
     SELECT id, route, session_key, event_type, delivery_id, headers, payload, $8, ",
    QUEUED,
    ", $8, $9, trace_parent
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                 $7::bytea[], $10::text[])
         WITH ORDINALITY AS e(id, route, session_key, event_type, delivery_id, headers, payload,
                              trace_parent, arrival)
     ORDER BY arrival"
);

/// `$1` id, `$2` route, `$3` session key, `$4` event type, `$5` payload, `$6` now, `$7` this
/// node.
pub(super) const INSERT_INTERNAL_SQL: &str = concatcp!(
    "INSERT INTO events (id, route, session_key, event_type, delivery_id, headers, payload,
                         received_at, status, updated_at, origin, node)
     VALUES ($1, $2, $3, $4, NULL, '{}', $5, $6, ",
    QUEUED,
    ", $6, ",
    BACKGROUND,
    ", $7)"
);

/// The batch's sessions that are new: `$1` keys, `$2` routes, `$3` now.
pub(super) const INSERT_SESSIONS_SQL: &str = concatcp!(
    "INSERT INTO sessions (key, route, state, created_at, updated_at)
     SELECT DISTINCT ON (key) key, route, ",
    IDLE,
    ", $3, $3
     FROM unnest($1::text[], $2::text[]) AS s(key, route)
     ORDER BY key
     ON CONFLICT (key) DO NOTHING"
);

impl PostgresStore {
    /// Takes every pending accept (up to a batch), commits them in one transaction, answers each.
    pub(super) async fn accept_writer(
        self,
        receiver: Arc<Mutex<mpsc::UnboundedReceiver<AcceptJob>>>,
    ) {
        let mut batch = Vec::with_capacity(ACCEPT_BATCH);
        loop {
            {
                let mut receiver = receiver.lock().await;
                match receiver.recv().await {
                    Some(job) => batch.push(job),
                    None => return,
                }
                while batch.len() < ACCEPT_BATCH {
                    match receiver.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
            }
            let events: Vec<&NewEvent> = batch.iter().map(|(event, _)| event).collect();
            let committed = bounded(self.commit_accepts(&events)).await;
            self.set_writable(committed.is_ok());
            match committed {
                Ok(outcomes) => {
                    for ((_, reply), outcome) in batch.drain(..).zip(outcomes) {
                        let _ = reply.send(Ok(outcome));
                    }
                }
                Err(err) => {
                    let message = err.to_string();
                    for (_, reply) in batch.drain(..) {
                        let _ = reply.send(Err(StoreError::Unavailable(message.clone())));
                    }
                }
            }
        }
    }

    /// One transaction for the whole batch: the delivery ids first (each needs its own answer),
    /// then every new event and session in one multi-row insert each. Rows are locked in key
    /// order, so batches of different nodes that share keys wait for each other, never deadlock.
    pub(super) async fn commit_accepts(
        &self,
        events: &[&NewEvent],
    ) -> Result<Vec<AcceptOutcome>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let now = now_millis();
        let mut outcomes = vec![AcceptOutcome::Accepted; events.len()];
        let mut with_ids: Vec<(usize, &String)> = events
            .iter()
            .enumerate()
            .filter_map(|(index, new)| new.event.delivery_id.as_ref().map(|id| (index, id)))
            .collect();
        with_ids
            .sort_by(|a, b| (&events[a.0].event.route, a.1).cmp(&(&events[b.0].event.route, b.1)));
        for (index, delivery_id) in with_ids {
            let (event, dedup_since) =
                (&events[index].event, events[index].dedup_window.start(now));
            let fresh = tx
                .maybe_row(
                    REMEMBER_DELIVERY_SQL,
                    &[&event.route, delivery_id, &event.id, &now, &dedup_since],
                )
                .await?;
            if fresh.is_none() {
                let row = tx
                    .row(FIRST_ACCEPTED_SQL, &[&event.route, delivery_id])
                    .await?;
                outcomes[index] = AcceptOutcome::Duplicate {
                    original: row.column("event_id")?,
                };
            }
        }
        let accepted: Vec<&Event> = events
            .iter()
            .zip(&outcomes)
            .filter(|(_, outcome)| **outcome == AcceptOutcome::Accepted)
            .map(|(new, _)| &new.event)
            .collect();
        if !accepted.is_empty() {
            let column = |field: fn(&Event) -> &str| -> Vec<&str> {
                accepted.iter().map(|event| field(event)).collect()
            };
            let (routes, session_keys) = (column(|e| &e.route), column(|e| &e.session_key));
            let delivery_ids: Vec<Option<&str>> = accepted
                .iter()
                .map(|event| event.delivery_id.as_deref())
                .collect();
            let payloads: Vec<&[u8]> = accepted.iter().map(|event| &event.payload[..]).collect();
            let trace_parents: Vec<Option<&str>> = accepted
                .iter()
                .map(|event| event.trace_parent.as_deref())
                .collect();
            tx.run(
                INSERT_EVENTS_SQL,
                &[
                    &column(|e| &e.id),
                    &routes,
                    &session_keys,
                    &column(|e| &e.event_type),
                    &delivery_ids,
                    &column(|e| &e.headers),
                    &payloads,
                    &now,
                    &self.shared.node_name,
                    &trace_parents,
                ],
            )
            .await?;
            tx.run(INSERT_SESSIONS_SQL, &[&session_keys, &routes, &now])
                .await?;
        }
        tx.commit().await?;
        Ok(outcomes)
    }
}

#[async_trait::async_trait]
impl Accepting for PostgresStore {
    async fn accept(&self, event: NewEvent) -> Result<AcceptOutcome, StoreError> {
        let accepts = self.shared.accepts.as_ref().ok_or_else(|| {
            StoreError::Unavailable("this store handle does not accept events".into())
        })?;
        let (reply, answer) = oneshot::channel();
        accepts
            .send((event, reply))
            .map_err(|_| StoreError::Stopped("the accept writers".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Stopped("the accept writers".into()))?
    }

    async fn enqueue_internal(
        &self,
        session_key: &str,
        route: &str,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Result<String, StoreError> {
        // One statement: on the pooled connection, as its own transaction.
        bounded(async {
            let client = self.client().await?;
            let on = InTx {
                tx: &client,
                store: self,
            };
            turns::enqueue_internal(&on, session_key, route, event_type, &payload).await
        })
        .await
    }

    async fn original_of(
        &self,
        route: &str,
        delivery_id: &str,
        window: DedupWindow,
    ) -> Result<Option<String>, StoreError> {
        let since = window.start(now_millis());
        self.fetch_optional(ORIGINAL_SQL, &[&route, &delivery_id, &since], |row| {
            row.column("event_id")
        })
        .await
    }

    async fn prune_finished(&self, before: i64) -> Result<usize, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let ids = tx
                .rows(PRUNABLE_EVENTS_SQL, &[&before, &PRUNE_BATCH])
                .await?
                .iter()
                .map(|row| row.column::<String>("id"))
                .collect::<Result<Vec<_>, _>>()?;
            for id in &ids {
                for sql in DELETE_EVENT_SQL {
                    tx.run(sql, &[id]).await?;
                }
            }
            tx.run(PRUNE_SESSIONS_SQL, &[&before, &PRUNE_BATCH]).await?;
            tx.commit().await?;
            Ok(ids.len())
        })
        .await
    }

    async fn prune_dedup(&self, window: DedupWindow) -> Result<usize, StoreError> {
        let before = window.start(now_millis());
        let pruned = self.execute_one(PRUNE_DEDUP_SQL, &[&before]).await?;
        Ok(pruned as usize)
    }
}
