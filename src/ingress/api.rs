//! The documents the control socket exchanges with the CLI (and `status --json` prints): typed
//! on both sides, so a field the daemon renames or drops is a compile error in the CLI rather
//! than a `null` an operator reads. docs/reference.md ("Control socket") lists them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::agent::catalog::ListedTool;
use crate::agent::mcp::McpServerStatus;
use crate::agent::sandbox::{self, Availability, ToolUnits};
use crate::config::BudgetLimits;
use crate::usage::{
    BudgetUse, DAY_MS, Price, UsageDay, UsageReport, UsageToday, daily_budget_use, day_start,
};

use crate::operator::Rerun;
use crate::store::RewindRequest;
use crate::store::{
    ApprovalCounts, ApprovalRow, DeliveryCounts, EventCounts, EventRow, NodeRow, SessionCounts,
    SessionRow, SessionState, StatusSummary, TranscriptRow,
};

/// `GET /v1/status`, and `agentgate status --json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StatusDocument {
    pub version: String,
    pub daemon: DaemonStatus,
    /// Where the state is (the CLI's view; the daemon leaves it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    pub events: EventCounts,
    pub sessions: SessionCounts,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<TurnCounts>,
    pub deliveries: DeliveryCounts,
    /// Whether a webhook would be accepted now, and why not.
    pub accepting: Accepting,
    /// The retry ledger as the next resume will see it (only the state holds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger: Option<LedgerStatus>,
    /// With the PostgreSQL backend: the nodes sharing the database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<NodeRow>>,
    /// The running daemon's MCP servers, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<BTreeMap<String, McpServerStatus>>,
    /// Whether the running daemon can sandbox its tools (`sandbox = "strict"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxStatus>,
    /// What model replies spent today (UTC).
    #[serde(default)]
    pub usage: UsageToday,
    /// Tool calls waiting for an operator's decision.
    #[serde(default)]
    pub approvals: ApprovalCounts,
}

/// The tool sandbox as the daemon found it at start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SandboxStatus {
    pub available: bool,
    /// `bubblewrap`.
    pub mechanism: String,
    /// Its version when available, else why it is not.
    pub detail: String,
    /// What the start found wrong with it: `writable` paths a tool unit cannot write.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl SandboxStatus {
    /// What [`sandbox::availability`] found.
    pub(crate) fn probed() -> SandboxStatus {
        let (available, mechanism, detail) = match sandbox::availability() {
            Availability::Ready { version, units, .. } => match units {
                ToolUnits::Ready(_) => (true, "systemd unit, bubblewrap", version.clone()),
                ToolUnits::NotConfigured => (true, "bubblewrap", version.clone()),
            },
            Availability::Unavailable(reason) => (false, "bubblewrap", reason.clone()),
        };
        SandboxStatus {
            available,
            mechanism: mechanism.to_string(),
            detail,
            warnings: sandbox::unwritable_paths(),
        }
    }
}

impl StatusDocument {
    /// The document of `summary`, with the rest to fill in.
    /// The document of `summary`, its usage priced at `price`.
    pub(crate) fn of(
        summary: StatusSummary,
        daemon: DaemonStatus,
        accepting: Accepting,
        price: Option<&Price>,
    ) -> Self {
        StatusDocument {
            version: crate::VERSION.to_string(),
            daemon,
            state_dir: None,
            events: summary.events,
            sessions: summary.sessions,
            turns: None,
            deliveries: summary.deliveries,
            accepting,
            ledger: None,
            nodes: summary.nodes,
            mcp: None,
            sandbox: None,
            usage: UsageToday {
                today: summary.usage.today.priced(price),
            },
            approvals: summary.approvals,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DaemonStatus {
    pub running: bool,
    /// Why a running daemon does not serve (it holds its sockets on a config error, or its start
    /// waits for the state): every webhook gets 503 meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_serving: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Whether the store takes writes now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writable: Option<bool>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct TurnCounts {
    pub running: usize,
}

/// Whether a webhook would be accepted now (the state writable, not over `max_queued_events`,
/// not below `min_free_disk`), and why not.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Accepting {
    pub ok: bool,
    pub reason: Option<String>,
}

impl Accepting {
    pub(crate) fn refused(reason: impl Into<String>) -> Accepting {
        Accepting {
            ok: false,
            reason: Some(reason.into()),
        }
    }

    pub(crate) fn from_refusal(refusal: Option<String>) -> Accepting {
        Accepting {
            ok: refusal.is_none(),
            reason: refusal,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LedgerStatus {
    /// `false`: malformed or unreadable, and no resume is dispatched; `None`: not known to this
    /// user (the state is not readable by it).
    pub valid: Option<bool>,
    /// Sessions with resume counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `GET /v1/sessions`: a page of sessions in key order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SessionsPage {
    pub sessions: Vec<SessionRow>,
    /// The cursor of the next page (`?after=`), `None` on the last one.
    pub next: Option<String>,
}

/// `GET /v1/events`: a page of events, newest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct EventsPage {
    pub events: Vec<EventRow>,
    /// The cursor of the next page (`?before=`), `None` on the last one.
    pub next: Option<String>,
}

/// `GET /v1/sessions/{key}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SessionDocument {
    pub session: SessionRow,
    /// The session budgets against what its turns spent.
    #[serde(default)]
    pub budgets: Vec<BudgetUse>,
    pub transcript: Vec<TranscriptRow>,
}

/// `POST /v1/sessions/{key}/{resume|suspend|cancel}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OperatorAnswer {
    pub session: String,
    pub action: String,
    /// Resume and suspend: the state the session was in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_state: Option<SessionState>,
    /// Cancel: the turn cancelled, and whether its end is committed yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<bool>,
}

/// The body of `POST /v1/sessions/{key}/rewind` (`{"to": N}`) and of `POST
/// /v1/sessions/{key}/fork` (`{"at": N, "as": NEWKEY}`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RerunRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<i64>,
    #[serde(default, rename = "as", skip_serializing_if = "Option::is_none")]
    pub as_key: Option<String>,
}

impl RerunRequest {
    /// The rerun of session `key` this asks for, or what is missing or wrong.
    pub(crate) fn of(self, key: &str, rerun: Rerun) -> Result<RewindRequest, String> {
        let (entry, fork_as) = match (rerun, self) {
            (
                Rerun::Rewind,
                RerunRequest {
                    to: Some(to),
                    at: None,
                    as_key: None,
                },
            ) => (to, None),
            (
                Rerun::Fork,
                RerunRequest {
                    to: None,
                    at: Some(at),
                    as_key: Some(new_key),
                },
            ) => (at, Some(new_key)),
            (Rerun::Rewind, _) => return Err("a rewind takes {\"to\": N}".to_string()),
            (Rerun::Fork, _) => {
                return Err("a fork takes {\"at\": N, \"as\": NEWKEY}".to_string());
            }
        };
        if entry < 1 {
            return Err(format!("entries are numbered from 1, not {entry}"));
        }
        if fork_as
            .as_deref()
            .is_some_and(|new_key| new_key.trim().is_empty())
        {
            return Err("the new session's key is empty".to_string());
        }
        Ok(RewindRequest {
            session: key.to_string(),
            entry,
            fork_as,
        })
    }
}

/// What a rewind or fork queued.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RerunAnswer {
    /// The session rewound, or forked from.
    pub session: String,
    /// `rewind` or `fork`.
    pub action: String,
    pub entry: i64,
    /// The turn that reruns it (superseded entries name it), and its event.
    pub turn_id: String,
    pub event_id: String,
    /// The session the turn runs in: the same for a rewind, the new one for a fork.
    pub runs_in: String,
    /// How many entries the rewind superseded (0 for a fork).
    pub superseded: u64,
}

/// `GET /v1/approvals`: requests, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ApprovalsPage {
    pub approvals: Vec<ApprovalRow>,
}

/// The body of `POST /v1/approvals/{id}/{approve|deny}` (both fields optional): the operator's
/// note (approve) or reason (deny).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DecisionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `GET /v1/tools`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ToolsDocument {
    pub tools: Vec<ListedTool>,
    pub problems: Vec<String>,
}

/// `POST /v1/routes/{route}/send` (and `agentgate send --url`): what the webhook listener
/// answered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ListenerAnswer {
    pub url: String,
    pub status: u16,
    pub body: String,
}

/// Every refusal: `{"error": CODE, "message": LINE}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ErrorBody {
    pub error: String,
    pub message: String,
}

/// `agentgate usage --json` and `GET /v1/usage`: what model replies spent, by route and UTC day.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct UsageDocument {
    /// The first UTC day counted (YYYY-MM-DD).
    pub since: String,
    /// One row per route and day, oldest day first.
    pub days: Vec<UsageDayRow>,
    /// Every row summed.
    pub total: UsageReport,
    /// The daily budgets, against today (UTC).
    pub budgets: Vec<BudgetUse>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct UsageDayRow {
    /// YYYY-MM-DD (UTC).
    pub day: String,
    pub route: String,
    #[serde(flatten)]
    pub usage: UsageReport,
}

impl UsageDocument {
    /// The document of `days` (counted from `since`, unix ms), of `route` alone when given,
    /// priced at `price`, with the daily budgets against today's rows among them.
    pub(crate) fn of(
        days: Vec<UsageDay>,
        since: i64,
        route: Option<&str>,
        limits: &UsageLimits,
    ) -> UsageDocument {
        let price = limits.price.as_ref();
        let today = day_start(crate::store::now_millis()) / DAY_MS;
        let todays: Vec<UsageDay> = days
            .iter()
            .filter(|day| day.day == today)
            .cloned()
            .collect();
        let routes: Vec<(String, BudgetLimits)> = limits
            .routes
            .iter()
            .filter(|(name, _)| route.is_none_or(|route| route == name))
            .cloned()
            .collect();
        let budgets = daily_budget_use(&limits.budgets, &routes, &todays, price);
        let days: Vec<UsageDay> = days
            .into_iter()
            .filter(|day| route.is_none_or(|route| day.route == route))
            .collect();
        let total = UsageReport::of(UsageDay::total(&days), price);
        UsageDocument {
            since: utc_date(since),
            days: days
                .into_iter()
                .map(|day| UsageDayRow {
                    day: utc_date(day.day * DAY_MS),
                    route: day.route,
                    usage: UsageReport::of(day.spent, price),
                })
                .collect(),
            total,
            budgets,
        }
    }
}

/// What `usage` shows figures against: `[model] price`, `[budgets]` and each route's `budget`.
#[derive(Debug, Clone, Default)]
pub(crate) struct UsageLimits {
    pub price: Option<Price>,
    pub budgets: BudgetLimits,
    pub routes: Vec<(String, BudgetLimits)>,
}

impl UsageLimits {
    /// How much of its session budgets `session` (read with its usage) used.
    pub(crate) fn session_use(&self, session: &SessionRow) -> Vec<BudgetUse> {
        let own = self
            .routes
            .iter()
            .find(|(name, _)| *name == session.route)
            .map(|(_, limits)| *limits)
            .unwrap_or_default();
        crate::usage::session_budget_use(
            &self.budgets,
            &session.route,
            &own,
            session.spent.unwrap_or_default(),
            self.price.as_ref(),
        )
    }

    pub(crate) fn of(config: &crate::config::Config) -> UsageLimits {
        UsageLimits {
            price: config.model.price,
            budgets: config.budgets,
            routes: config
                .routes
                .iter()
                .map(|route| (route.name.clone(), route.budget))
                .collect(),
        }
    }
}

/// The UTC date (YYYY-MM-DD) of `millis` since the epoch.
fn utc_date(millis: i64) -> String {
    let stamp = crate::store::rfc3339(millis);
    stamp.get(..10).unwrap_or(&stamp).to_string()
}
