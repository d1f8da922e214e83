//! `what-if`: recorded events run again under another config, side-effect free, compared with
//! what they did (docs/reference.md, "what-if").
//!
//! The events are read from a snapshot of the state that `backup` makes into a private
//! temporary directory, so the live database is only ever read (in one read transaction, as a
//! backup reads it) and the command runs beside a serving daemon. The turns themselves are run by
//! `session::whatif`, which starts no tool and commits nothing.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::args::WhatIfArgs;
use crate::agent::model::Model;
use crate::config::{self, ConfigSource, SecretCheck, Settings, StoreSettings};
use crate::exit::Failure;
use crate::output::outln;
use crate::session::whatif::{self, CallResult, Run, Trial};
use crate::store::{self, EventFilter, EventStatus, StateDir, Store};
use crate::untrusted::for_terminal;
use crate::usage::Price;

/// `--limit` when it is not given.
const DEFAULT_LIMIT: usize = 20;
/// Events read per page while selecting a route's latest.
const SELECT_PAGE: i64 = 500;

/// One event's two runs.
#[derive(Serialize)]
struct EventReport {
    event_id: String,
    /// Its route and session, for the text report.
    #[serde(skip)]
    route: String,
    #[serde(skip)]
    session: String,
    changed: bool,
    recorded: Run,
    new: Run,
}

#[derive(Serialize)]
struct Summary {
    events: usize,
    changed: usize,
    calls_not_run: usize,
    tokens_delta: i64,
    /// `null` when either config has no `[model] price`.
    cost_delta_usd: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    events: Vec<EventReport>,
    summary: Summary,
}

impl Report {
    fn of(events: Vec<EventReport>) -> Report {
        let tokens = |run: &Run| i64::try_from(run.tokens()).unwrap_or(i64::MAX);
        let cost_delta_usd = events.iter().try_fold(0.0, |sum, event| {
            Some(sum + event.new.usage.cost_usd? - event.recorded.usage.cost_usd?)
        });
        let summary = Summary {
            events: events.len(),
            changed: events.iter().filter(|event| event.changed).count(),
            calls_not_run: events
                .iter()
                .flat_map(|event| &event.new.tool_calls)
                .filter(|call| call.result == CallResult::NotRun)
                .count(),
            tokens_delta: events
                .iter()
                .map(|event| tokens(&event.new) - tokens(&event.recorded))
                .sum(),
            cost_delta_usd,
        };
        Report { events, summary }
    }
}

/// `agentgate what-if`.
pub(super) fn what_if(arguments: &WhatIfArgs) -> Result<(), Failure> {
    let live = ConfigSource::resolve(arguments.live_config.as_deref());
    let location = config::state_location(&live).map_err(Failure::config)?;
    if matches!(location.store, StoreSettings::Postgres(_)) {
        return Err(Failure::config(
            "what-if reads a snapshot of SQLite state; with [store] backend = \"postgres\" it is \
             not available (docs/operations.md, \"Trying a config on recorded events\")",
        ));
    }
    let new_config = super::load_config(
        &ConfigSource::File(arguments.config.clone()),
        SecretCheck::Required,
    )?;
    let settings = Settings::new(new_config.config).map_err(Failure::config)?;
    let model = Model::new(&settings.config.model, None).map_err(|err| {
        Failure::config(format!("{}: [model]: {err}", arguments.config.display()))
    })?;
    if !StateDir::new(&location.state_dir).database().exists() {
        return Err(Failure::runtime(format!(
            "no events are recorded in {} yet",
            location.state_dir.display()
        )));
    }
    let snapshot = tempfile::Builder::new()
        .prefix("agentgate-what-if-")
        .tempdir()
        .map_err(|err| Failure::runtime(format!("cannot create a temporary directory: {err}")))?;
    let copy = snapshot.path().join("state");
    store::backup(&location.state_dir, &copy).map_err(|err| {
        Failure::runtime(format!(
            "cannot snapshot {}: {err}",
            location.state_dir.display()
        ))
    })?;
    let runtime = super::runtime()?;
    let store = runtime
        .block_on(Store::attach(&StoreSettings::Sqlite, &copy))
        .map_err(Failure::from)?
        .ok_or_else(|| Failure::runtime("the snapshot has no database"))?;
    let ids = match &arguments.route {
        Some(route) => runtime.block_on(latest_of(&store, route, arguments))?,
        None => arguments.events.clone(),
    };
    let trial = runtime.block_on(async { Trial::start(settings, model) });
    let events = runtime.block_on(compare(&store, &trial, ids, arguments, location.price));
    runtime.block_on(trial.close());
    let report = Report::of(events?);
    if arguments.json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => outln!("{text}"),
            Err(err) => return Err(Failure::runtime(format!("cannot render JSON: {err}"))),
        }
    } else {
        print_report(&report, &arguments.config);
    }
    if arguments.save {
        save(&report, &location.state_dir, &arguments.config)?;
    }
    let Summary {
        events, changed, ..
    } = report.summary;
    if arguments.fail_on_change && changed > 0 {
        return Err(Failure::runtime(format!(
            "{changed} of {events} events changed"
        )));
    }
    Ok(())
}

/// Each event's recorded run and its new one under `trial`.
async fn compare(
    store: &Store,
    trial: &Trial,
    ids: Vec<String>,
    arguments: &WhatIfArgs,
    price: Option<Price>,
) -> Result<Vec<EventReport>, Failure> {
    let mut events = Vec::with_capacity(ids.len());
    for id in ids {
        let recording = match whatif::recording(store, &id, price.as_ref())
            .await
            .map_err(Failure::from)?
            .ok_or_else(|| Failure::runtime(format!("no event {id:?}")))?
        {
            Ok(recording) => recording,
            // An event chosen by --route that ran in another's turn (coalesced) has none of
            // its own: it is left out, and said so.
            Err(problem) if arguments.route.is_some() => {
                eprintln!("agentgate: left out: {problem}");
                continue;
            }
            Err(problem) => return Err(Failure::runtime(problem)),
        };
        let recorded = recording.run();
        let new = trial.rerun(&recording).await;
        events.push(EventReport {
            event_id: id,
            route: recording.event.route.clone(),
            session: recording.event.session_key.clone(),
            changed: recorded.differs_from(&new),
            recorded,
            new,
        });
    }
    Ok(events)
}

/// A report as `--save` keeps it: when, and with which config.
#[derive(Serialize)]
struct Saved<'a> {
    created_at: String,
    config: String,
    #[serde(flatten)]
    report: &'a Report,
}

/// `--save`: keeps `report` in the state directory for the console, and says where on stderr
/// (stdout is the report).
fn save(report: &Report, state_dir: &Path, new_config: &Path) -> Result<(), Failure> {
    let now = store::now_millis();
    let saved = Saved {
        created_at: store::rfc3339(now),
        config: new_config.display().to_string(),
        report,
    };
    let bytes = serde_json::to_vec_pretty(&saved)
        .map_err(|err| Failure::runtime(format!("cannot render the report: {err}")))?;
    let path = StateDir::new(state_dir)
        .save_report(&bytes, now)
        .map_err(|err| {
            Failure::runtime(format!(
                "cannot save the report in {}: {err}",
                state_dir.display()
            ))
        })?;
    eprintln!("agentgate: report saved as {}", path.display());
    Ok(())
}

/// The newest recorded events of `route` (completed or failed) that `--since` and `--limit`
/// allow, newest first.
async fn latest_of(
    store: &Store,
    route: &str,
    arguments: &WhatIfArgs,
) -> Result<Vec<String>, Failure> {
    let limit = arguments.limit.unwrap_or(DEFAULT_LIMIT);
    let since = arguments
        .since
        .map(|since| store::now_millis() - i64::try_from(since.as_millis()).unwrap_or(i64::MAX));
    let mut selected = Vec::new();
    let mut before = None;
    while selected.len() < limit {
        let page = store
            .events(EventFilter {
                status: None,
                route: Some(route.to_string()),
                session: None,
                limit: SELECT_PAGE,
                before: before.take(),
                ..EventFilter::default()
            })
            .await
            .map_err(Failure::from)?;
        let Some(last) = page.last() else {
            break;
        };
        before = Some(last.id.clone());
        for event in page {
            if since.is_some_and(|since| event.received_at < since) {
                return Ok(selected);
            }
            if matches!(event.status, EventStatus::Completed | EventStatus::Failed)
                && selected.len() < limit
            {
                selected.push(event.id);
            }
        }
    }
    Ok(selected)
}

fn print_report(report: &Report, new_config: &Path) {
    for event in &report.events {
        print_event(event);
        outln!();
    }
    let Summary {
        events,
        changed,
        calls_not_run,
        tokens_delta,
        cost_delta_usd,
    } = &report.summary;
    let cost = match cost_delta_usd {
        Some(delta) => format!("{delta:+.6} USD"),
        None => "unknown (no [model] price)".to_string(),
    };
    let answers = report
        .events
        .iter()
        .filter(|event| event.recorded.answer != event.new.answer)
        .count();
    outln!(
        "{events} event(s) under {}: {changed} changed ({answers} answer(s)), {calls_not_run} \
         call(s) not run, tokens {tokens_delta:+}, cost {cost}",
        new_config.display()
    );
}

fn print_event(event: &EventReport) {
    let (recorded, new) = (&event.recorded, &event.new);
    let verdict = if event.changed {
        "changed"
    } else {
        "unchanged"
    };
    outln!(
        "event {} (route {}, session {}): {verdict}",
        event.event_id,
        event.route,
        for_terminal(&event.session)
    );
    outln!("  status   {} -> {}", recorded.status, new.status);
    if let Some(error) = &new.error {
        outln!("  error    {}", for_terminal(error));
    }
    print_answers(recorded.answer.as_deref(), new.answer.as_deref());
    print_calls(recorded, new);
    outln!("  steps    {} -> {}", recorded.steps, new.steps);
    outln!(
        "  tokens   {} -> {} ({:+})",
        recorded.tokens(),
        new.tokens(),
        i128::from(new.tokens()) - i128::from(recorded.tokens())
    );
    if let (Some(before), Some(after)) = (recorded.usage.cost_usd, new.usage.cost_usd) {
        outln!(
            "  cost     {before:.6} -> {after:.6} USD ({:+.6})",
            after - before
        );
    }
    for note in &new.notes {
        outln!("  note     {note}");
    }
}

fn print_answers(recorded: Option<&str>, new: Option<&str>) {
    if recorded == new {
        outln!("  answer   unchanged");
        return;
    }
    outln!("  answer   changed:");
    for (sign, line) in line_diff(recorded.unwrap_or(""), new.unwrap_or("")) {
        outln!("    {sign} {}", for_terminal(line));
    }
}

/// The calls only one of the runs made (tool and arguments; each counted as often as it was
/// made): added ones with how the new run answered them, removed ones; then how many calls were
/// answered from the recording.
fn print_calls(recorded: &Run, new: &Run) {
    let key = |name: &str, arguments: &serde_json::Value| format!("{name} with {arguments}");
    let mut left: BTreeMap<String, usize> = BTreeMap::new();
    for call in &recorded.tool_calls {
        *left.entry(key(&call.name, &call.arguments)).or_default() += 1;
    }
    let mut answered = 0;
    for call in &new.tool_calls {
        let made = key(&call.name, &call.arguments);
        let added = match left.get_mut(&made) {
            Some(count) if *count > 0 => {
                *count -= 1;
                false
            }
            Some(_) | None => true,
        };
        match call.result {
            CallResult::NotRun => {
                let sign = if added { '+' } else { ' ' };
                outln!(
                    "  calls  {sign} would call {} (not run)",
                    for_terminal(&made)
                );
            }
            CallResult::Recorded | CallResult::Ran => {
                answered += 1;
                if added {
                    outln!("  calls  + {} (recorded result)", for_terminal(&made));
                }
            }
        }
    }
    for (call, count) in left {
        for _ in 0..count {
            outln!("  calls  - {}", for_terminal(&call));
        }
    }
    if answered > 0 {
        outln!("  calls    {answered} answered from the recording");
    }
}

/// The lines of `new` against those of `old`: kept ones with ' ', removed with '-', added with
/// '+', from their longest common subsequence (texts too long for that are shown whole, as
/// removed then added).
fn line_diff<'a>(old: &'a str, new: &'a str) -> Vec<(char, &'a str)> {
    const MAX_CELLS: usize = 4_000_000;
    let old: Vec<&str> = old.lines().collect();
    let new: Vec<&str> = new.lines().collect();
    if (old.len() + 1).saturating_mul(new.len() + 1) > MAX_CELLS {
        let removed = old.iter().map(|line| ('-', *line));
        return removed.chain(new.iter().map(|line| ('+', *line))).collect();
    }
    // common[i][j]: the longest common subsequence of old[i..] and new[j..].
    let width = new.len() + 1;
    let mut common = vec![0usize; (old.len() + 1) * width];
    for i in (0..old.len()).rev() {
        for j in (0..new.len()).rev() {
            common[i * width + j] = if old[i] == new[j] {
                common[(i + 1) * width + j + 1] + 1
            } else {
                common[(i + 1) * width + j].max(common[i * width + j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut diff = Vec::new();
    while i < old.len() || j < new.len() {
        if i < old.len() && j < new.len() && old[i] == new[j] {
            diff.push((' ', old[i]));
            (i, j) = (i + 1, j + 1);
        } else if i < old.len()
            && (j == new.len() || common[(i + 1) * width + j] >= common[i * width + j + 1])
        {
            diff.push(('-', old[i]));
            i += 1;
        } else {
            diff.push(('+', new[j]));
            j += 1;
        }
    }
    diff
}

#[cfg(test)]
mod tests {
    use super::line_diff;

    #[test]
    fn a_line_diff_keeps_common_lines_and_marks_the_rest() {
        let diff = line_diff("a\nb\nc", "a\nx\nc\nd");
        assert_eq!(
            diff,
            [(' ', "a"), ('-', "b"), ('+', "x"), (' ', "c"), ('+', "d")]
        );
    }
}
