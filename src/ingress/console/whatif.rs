//! The console's what-if pages: the reports `agentgate what-if --save` kept in the state
//! directory, listed and shown read-only (docs/reference.md, "What-if"). The console never runs
//! a what-if itself: that costs model requests, and is the operator's decision on the host.

use minijinja::{Value, context};

use super::{Console, Door};
use crate::ingress::control::not_found;
use crate::ingress::response::HttpResponse;
use crate::store::StateDir;

/// Reports the list shows at most, the newest.
const REPORTS_SHOWN: usize = 50;

impl Console {
    /// `GET /console/what-if`: the saved reports, newest first, with their summaries.
    pub(super) async fn what_if_list(&self, door: Door) -> HttpResponse {
        let state = StateDir::new(&self.ops.settings.get().config.state_dir);
        let read = tokio::task::spawn_blocking(move || {
            let names = state.saved_reports(REPORTS_SHOWN)?;
            let reports: Vec<Value> = names
                .into_iter()
                .map(|name| {
                    let report = state
                        .saved_report(&name)
                        .ok()
                        .flatten()
                        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
                        .unwrap_or_default();
                    context! {
                        name,
                        created_at => report.get("created_at"),
                        config => report.get("config"),
                        summary => report.get("summary"),
                    }
                })
                .collect();
            Ok::<_, std::io::Error>(reports)
        })
        .await;
        match read {
            Ok(Ok(reports)) => self.render("whatif_list.html", context! { reports }, door),
            Ok(Err(err)) => self.unreadable(&err.to_string(), door),
            Err(err) => self.unreadable(&err.to_string(), door),
        }
    }

    /// `GET /console/what-if/{name}`: one saved report.
    pub(super) async fn what_if_report(&self, name: &str, door: Door) -> HttpResponse {
        let state = StateDir::new(&self.ops.settings.get().config.state_dir);
        let wanted = name.to_string();
        let read = tokio::task::spawn_blocking(move || state.saved_report(&wanted)).await;
        let bytes = match read {
            Ok(Ok(Some(bytes))) => bytes,
            Ok(Ok(None)) => {
                return not_found(&http::Method::GET, &format!("/console/what-if/{name}"));
            }
            Ok(Err(err)) => return self.unreadable(&err.to_string(), door),
            Err(err) => return self.unreadable(&err.to_string(), door),
        };
        match serde_json::from_slice::<serde_json::Value>(&bytes) {
            Ok(report) => {
                let values = context! { name, ..Value::from_serialize(&report) };
                self.render("whatif.html", values, door)
            }
            Err(err) => self.unreadable(&format!("the report is not JSON: {err}"), door),
        }
    }

    fn unreadable(&self, problem: &str, door: Door) -> HttpResponse {
        let message = format!("the saved what-if reports cannot be read: {problem}");
        self.refused_page(http::StatusCode::SERVICE_UNAVAILABLE, &message, door)
    }
}
