//! Turns: claims, transcript steps and ends, interrupted sessions and the operator's overrides.

use super::*;

/// Ends a turn's rows: the turn, its event's terminal status, its session (lease released) and
/// its delivery, as one part of the caller's transaction.
/// The event in the seven columns from `first` on: id, route, session key, type, delivery id,
/// headers, payload.
fn event_from(row: &tokio_postgres::Row, first: usize) -> Event {
    Event {
        id: row.get(first),
        route: row.get(first + 1),
        session_key: row.get(first + 2),
        event_type: row.get(first + 3),
        delivery_id: row.get(first + 4),
        headers: row.get(first + 5),
        payload: row.get(first + 6),
    }
}

async fn finish_rows(
    tx: &deadpool_postgres::Transaction<'_>,
    end: &TurnEnd,
    render: RenderDelivery,
) -> Result<(), StoreError> {
    let now = now_millis();
    tx.run(
        "UPDATE turns SET status = $2, reason = $3, output = $4, error = $5, steps = $6, finished_at = $7
         WHERE id = $1",
        &[
            &end.turn_id,
            &end.turn_status.sql(),
            &end.reason.map(StopReason::sql),
            &end.output,
            &end.error,
            &i64::from(end.steps),
            &now,
        ],
    )
    .await?;
    tx.run(
        "UPDATE events SET status = $2, updated_at = $3 WHERE id = $1",
        &[&end.event_id, &end.event_status.sql(), &now],
    )
    .await?;
    // An operator's suspension made while the turn ran stays in force.
    tx.run(
        concatcp!(
            "UPDATE sessions SET state = CASE WHEN state = ",
            SUSPENDED,
            " THEN ",
            SUSPENDED,
            " ELSE $2 END,
             reason = CASE WHEN state = ",
            SUSPENDED,
            " THEN reason ELSE $3 END, updated_at = $4,
             lease_owner = NULL, lease_expires_at = NULL
         WHERE key = $1"
        ),
        &[
            &end.session_key,
            &end.session_state().sql(),
            &end.reason.map(StopReason::sql),
            &now,
        ],
    )
    .await?;
    let body =
        render(end).map_err(|err| StoreError::Unavailable(format!("delivery body: {err}")))?;
    tx.run(
        concatcp!("INSERT INTO deliveries (event_id, route, session_key, body, status, attempts, next_attempt_at,
                                 created_at, updated_at)
         VALUES ($1, $2, $3, $4, ", PENDING, ", 0, $5, $5, $5)
         ON CONFLICT (event_id) DO UPDATE SET body = EXCLUDED.body, status = ", PENDING, ", attempts = 0,
             next_attempt_at = EXCLUDED.next_attempt_at, updated_at = EXCLUDED.updated_at,
             lease_owner = NULL, lease_expires_at = NULL"),
        &[&end.event_id, &end.route, &end.session_key, &body, &now],
    )
    .await?;
    Ok(())
}

/// Puts an interrupted session's event back at the head of its queue, marked as a resume.
async fn requeue_rows(
    tx: &deadpool_postgres::Transaction<'_>,
    event_id: &str,
    session_key: &str,
    reason: ResumeReason,
) -> Result<(), StoreError> {
    let now = now_millis();
    tx.run(
        concatcp!(
            "UPDATE events SET status = ",
            QUEUED,
            ", resume_reason = $2, updated_at = $3 WHERE id = $1"
        ),
        &[&event_id, &reason.sql(), &now],
    )
    .await?;
    tx.run(
        concatcp!(
            "UPDATE sessions SET state = ",
            IDLE,
            ", updated_at = $2 WHERE key = $1"
        ),
        &[&session_key, &now],
    )
    .await?;
    Ok(())
}

#[async_trait::async_trait]
impl Turns for PostgresStore {
    async fn claim_turns(&self, limit: usize) -> Result<Vec<ClaimedTurn>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            // The idle sessions with queued events, oldest head first (one partial index;
            // sessions that cannot run are never read); sessions another node is claiming right
            // now are skipped, not waited for.
            let sessions = tx
                .rows(
                    concatcp!("SELECT s.key FROM sessions s
                     WHERE s.state = ", IDLE, " AND s.queue_head IS NOT NULL
                     ORDER BY s.queue_head LIMIT $1
                     FOR UPDATE OF s SKIP LOCKED"),
                    &[&(limit as i64)],
                )
                .await?;
            let mut claimed = Vec::with_capacity(sessions.len());
            for session in sessions {
                let session_key: String = session.get(0);
                let Some(row) = tx
                    .maybe_row(
                        concatcp!("SELECT id, route, session_key, event_type, delivery_id, headers, payload, resume_reason,
                                origin <> 'webhook'
                         FROM events WHERE session_key = $1 AND status = ", QUEUED, " ORDER BY seq LIMIT 1"),
                        &[&session_key],
                    )
                    .await?
                else {
                    continue;
                };
                let event = event_from(&row, 0);
                let resume_reason = row.get::<_, Option<&str>>(7).map(ResumeReason::from_sql);
                let internal: bool = row.get(8);
                let turn_id = uuid::Uuid::now_v7().to_string();
                let now = now_millis();
                tx.run(
                    concatcp!("UPDATE events SET status = ", EVENT_RUNNING, ", resume_reason = NULL, updated_at = $2 WHERE id = $1"),
                    &[&event.id, &now],
                )
                .await?;
                tx.run(
                    concatcp!("INSERT INTO turns (id, session_key, event_id, status, started_at, node)
                     VALUES ($1, $2, $3, ", TURN_RUNNING, ", $4, $5)"),
                    &[&turn_id, &event.session_key, &event.id, &now, &self.shared.node_name],
                )
                .await?;
                tx.run(
                    concatcp!("UPDATE sessions SET state = ", SESSION_RUNNING, ", reason = NULL, last_turn_id = $2, updated_at = $3,
                         lease_owner = $4, lease_expires_at = agentgate_now_ms() + $5,
                         interrupt_requested = false
                     WHERE key = $1"),
                    &[
                        &event.session_key,
                        &turn_id,
                        &now,
                        &self.shared.node_id,
                        &self.shared.lease_ttl_ms,
                    ],
                )
                .await?;
                claimed.push(ClaimedTurn {
                    turn_id,
                    event,
                    resume_reason,
                    internal,
                });
            }
            tx.commit().await?;
            Ok(claimed)
        })
        .await
    }

    async fn append_transcript(
        &self,
        session_key: &str,
        turn_id: &str,
        entries: Vec<(&'static str, String)>,
        steps: u32,
    ) -> Result<(), StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, session_key).await?;
            let now = now_millis();
            for (kind, body) in &entries {
                tx.run(
                    "INSERT INTO transcript (session_key, seq, turn_id, kind, body, created_at)
                     VALUES ($1, COALESCE((SELECT max(seq) FROM transcript WHERE session_key = $1), 0) + 1,
                             $2, $3, $4, $5)",
                    &[&session_key, &turn_id, kind, body, &now],
                )
                .await?;
            }
            tx.run(
                "UPDATE turns SET steps = $2 WHERE id = $1",
                &[&turn_id, &i64::from(steps)],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn finish_turn(&self, end: TurnEnd, render: RenderDelivery) -> Result<(), StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, &end.session_key).await?;
            finish_rows(&tx, &end, render).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn interrupt_for_resume(
        &self,
        turn_id: &str,
        session_key: &str,
        reason: ResumeReason,
        steps: u32,
    ) -> Result<(), StoreError> {
        let reason = StopReason::Resume(reason).sql();
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            self.hold_lease(&tx, session_key).await?;
            let now = now_millis();
            tx.run(
                concatcp!(
                    "UPDATE turns SET status = ",
                    TURN_INTERRUPTED,
                    ", reason = $2, steps = $3, finished_at = $4 WHERE id = $1"
                ),
                &[&turn_id, &reason, &i64::from(steps), &now],
            )
            .await?;
            // The lease goes with it: another node resumes the session at once. An operator's
            // suspension stays in force: the interrupted event waits for `sessions resume`.
            tx.run(
                concatcp!(
                    "UPDATE sessions SET state = CASE WHEN state = ",
                    SUSPENDED,
                    " THEN state ELSE ",
                    RESUME_PENDING,
                    " END, reason = CASE WHEN state = ",
                    SUSPENDED,
                    " THEN reason ELSE $2 END, updated_at = $3,
                     lease_owner = NULL, lease_expires_at = NULL
                 WHERE key = $1"
                ),
                &[&session_key, &reason, &now],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn event_has_transcript(&self, event_id: &str) -> Result<bool, StoreError> {
        Ok(self
            .select_one(
                "SELECT EXISTS (SELECT 1 FROM transcript t JOIN turns u ON u.id = t.turn_id
                                WHERE u.event_id = $1)",
                &[&event_id],
            )
            .await?
            .get(0))
    }

    async fn transcript(&self, session_key: &str) -> Result<Vec<TranscriptRow>, StoreError> {
        let rows = self
            .select(&transcript_query("$1", "$2"), &[&session_key, &EVENT_ENTRY])
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                let event = row.get::<_, Option<String>>(5).map(|_| event_from(&row, 5));
                TranscriptRow::new(
                    row.get(0),
                    row.get(1),
                    row.get(2),
                    row.get(3),
                    row.get(4),
                    event,
                )
            })
            .collect())
    }
}

#[async_trait::async_trait]
impl Recovery for PostgresStore {
    async fn mark_crashed_turns(&self) -> Result<usize, StoreError> {
        let now = now_millis();
        let lost = self
            .execute_one(
                concatcp!(
                    "WITH lost AS (
                     UPDATE sessions SET state = ",
                    RESUME_PENDING,
                    ", reason = ",
                    CRASHED,
                    ", updated_at = $1,
                         lease_owner = NULL, lease_expires_at = NULL
                     WHERE state = ",
                    SESSION_RUNNING,
                    " AND lease_expires_at < agentgate_now_ms()
                     RETURNING last_turn_id)
                 UPDATE turns SET status = ",
                    TURN_INTERRUPTED,
                    ", reason = ",
                    CRASHED,
                    ", finished_at = $1
                 FROM lost WHERE turns.id = lost.last_turn_id AND turns.status = ",
                    TURN_RUNNING
                ),
                &[&now],
            )
            .await?;
        Ok(lost as usize)
    }

    async fn interrupted_sessions(&self) -> Result<Vec<InterruptedSession>, StoreError> {
        let rows = self
            .select(
                concatcp!(
                    "SELECT s.key, s.route, COALESCE(s.reason, ",
                    CRASHED,
                    "), t.id, t.event_id, t.steps, t.started_at
                 FROM sessions s JOIN turns t ON t.id = s.last_turn_id
                 WHERE s.state = ",
                    RESUME_PENDING,
                    " AND s.lease_owner IS NULL
                 ORDER BY t.started_at"
                ),
                &[],
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| InterruptedSession {
                session_key: row.get(0),
                route: row.get(1),
                reason: ResumeReason::from_sql(row.get(2)),
                turn_id: row.get(3),
                event_id: row.get(4),
                steps: u32::try_from(row.get::<_, i64>(5)).unwrap_or(u32::MAX),
                started_at: row.get(6),
            })
            .collect())
    }

    async fn settle_interrupted(
        &self,
        session: &InterruptedSession,
        settlement: Settlement,
        render: RenderDelivery,
    ) -> Result<Settled, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            // Whoever locks the session settles it; the others skip it.
            let still_interrupted = tx
                .maybe_row(
                    concatcp!("SELECT 1 FROM sessions
                     WHERE key = $1 AND state = ", RESUME_PENDING, " AND last_turn_id = $2
                     FOR UPDATE SKIP LOCKED"),
                    &[&session.session_key, &session.turn_id],
                )
                .await?;
            if still_interrupted.is_none() {
                return Ok(Settled::NotInterrupted);
            }
            let max_attempts = match settlement {
                Settlement::Abandon => {
                    finish_rows(&tx, &session.abandoned(), render).await?;
                    tx.commit().await?;
                    return Ok(Settled::Abandoned);
                }
                Settlement::Admit { max_attempts } => max_attempts,
            };
            // The count, under the ledger row's lock, in the transaction that queues the resume.
            let attempt: i64 = tx
                .row(
                    "INSERT INTO resume_ledger (session_key, attempts, last_attempt) VALUES ($1, 1, $2)
                     ON CONFLICT (session_key) DO UPDATE
                         SET attempts = resume_ledger.attempts + 1, last_attempt = EXCLUDED.last_attempt
                     RETURNING attempts",
                    &[&session.session_key, &now_rfc3339()],
                )
                .await?
                .get(0);
            let attempt = u64::try_from(attempt).unwrap_or(u64::MAX);
            if attempt > u64::from(max_attempts) {
                finish_rows(&tx, &session.suspended(max_attempts), render).await?;
                tx.run(
                    "DELETE FROM resume_ledger WHERE session_key = $1",
                    &[&session.session_key],
                )
                .await?;
                tx.commit().await?;
                return Ok(Settled::Suspended);
            }
            requeue_rows(&tx, &session.event_id, &session.session_key, session.reason).await?;
            tx.commit().await?;
            Ok(Settled::Resumed { attempt })
        })
        .await
    }

    async fn clear_resume_count(&self, session_key: &str) -> Result<(), StoreError> {
        self.execute_one(
            "DELETE FROM resume_ledger WHERE session_key = $1",
            &[&session_key],
        )
        .await?;
        Ok(())
    }

    async fn resume_ledger(&self) -> Result<Ledger, StoreError> {
        let mut ledger = Ledger::default();
        for row in self
            .select(
                "SELECT session_key, attempts, last_attempt FROM resume_ledger ORDER BY session_key",
                &[],
            )
            .await?
        {
            let key: String = row.get(0);
            let attempts = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
            ledger.insert(&key, attempts, row.get(2));
        }
        Ok(ledger)
    }
}

#[async_trait::async_trait]
impl Operator for PostgresStore {
    async fn operator_resume(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let Some(row) = tx
                .maybe_row(
                    "SELECT state FROM sessions WHERE key = $1 FOR UPDATE",
                    &[&key],
                )
                .await?
            else {
                return Ok(None);
            };
            let state: SessionState = row.try_get(0)?;
            let now = now_millis();
            tx.run("DELETE FROM resume_ledger WHERE session_key = $1", &[&key])
                .await?;
            tx.run(REQUEUE_STOPPED_EVENT_SQL, &[&key, &now]).await?;
            tx.run(RESUME_SESSION_SQL, &[&key, &now]).await?;
            tx.commit().await?;
            Ok(Some(state))
        })
        .await
    }

    async fn operator_suspend(&self, key: &str) -> Result<Option<SessionState>, StoreError> {
        let row = self
            .select_optional(
                concatcp!(
                    "UPDATE sessions n SET state = ",
                    SUSPENDED,
                    ", reason = ",
                    OPERATOR,
                    ", updated_at = $2
                 FROM sessions o WHERE n.key = $1 AND o.key = n.key
                 RETURNING o.state"
                ),
                &[&key, &now_millis()],
            )
            .await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }

    async fn replay_event(&self, id: &str) -> Result<Option<String>, StoreError> {
        let copy = uuid::Uuid::now_v7().to_string();
        let inserted = self
            .execute_one(REPLAY_SQL, &[&id, &copy, &now_millis()])
            .await?;
        Ok((inserted == 1).then_some(copy))
    }

    async fn retry_deliveries(&self, target: RetryTarget) -> Result<u64, StoreError> {
        let event_id = match &target {
            RetryTarget::One(id) => Some(id.as_str()),
            RetryTarget::AllFailed => None,
        };
        self.execute_one(RETRY_SQL, &[&event_id, &now_millis()])
            .await
    }
}
