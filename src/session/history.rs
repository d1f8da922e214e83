//! What of a session's earlier turns the model sees (`history = { max_turns, max_bytes }`).
//!
//! Without a bound, every turn sends the whole transcript: a session that lives for days (an
//! issue thread, an alert group) grows until the model refuses it, and one large event weighs on
//! every later turn. The model sees the newest earlier turns that fit both limits, whole (a tool
//! call is never separated from its result); the system text says that older turns may be left
//! out (`session::prompt`).
//!
//! Old turns are dropped in blocks, not one at a time: local model servers (vLLM, llama.cpp)
//! reuse the cache of a prompt prefix they have seen, and everything after the point where a
//! request first differs from the one before is computed again. A cut that moved on every turn
//! would leave each turn's first request only the system text from the cache; the cut moves
//! only when a whole block no longer fits, so the turns in between start with the bytes of the
//! request before. A block is half the bound, and at least two turns (when the bound allows
//! two): with `max_turns = 2` the model sees one or two earlier turns, and the cut moves every
//! other turn.
//!
//! Nothing marks the cut itself: the first turn shown follows the system text directly. A note
//! there ("N earlier turns are not shown") would change with every move of the cut and stand
//! between the system text and the turns kept, so a server that reuses cached chunks found
//! further on (llama.cpp's `--cache-reuse`) could not match the kept turns after it.
//!
//! Single messages are bounded too: an event or tool output larger than half of `max_bytes` is
//! cut, with a marker that says how much.

use crate::agent::message::Message;
use crate::config::HistoryLimits;

/// The messages of one earlier turn, in order.
pub(crate) struct PastTurn {
    pub messages: Vec<Message>,
}

/// The earlier turns to show, oldest first. `turns` are the session's earlier turns from its
/// `skipped`-th on: those before it need not be read, since the turn bound leaves them out
/// whatever they hold ([`never_shown`]).
pub(crate) fn select(turns: Vec<PastTurn>, limits: HistoryLimits, skipped: usize) -> Vec<Message> {
    let sizes: Vec<usize> = turns.iter().map(turn_bytes).collect();
    let cut = first_shown(&sizes, limits, skipped);
    turns
        .into_iter()
        .skip(cut)
        .flat_map(|turn| turn.messages)
        .collect()
}

/// How many of a session's `total` earlier turns the turn bound leaves out: whole blocks of
/// them, from the oldest, so that the cut stays put across consecutive requests until a whole
/// block must go.
pub(crate) fn never_shown(total: usize, limits: HistoryLimits) -> usize {
    let step = turn_block(limits.max_turns);
    if total > limits.max_turns {
        (total - limits.max_turns).div_ceil(step) * step
    } else {
        0
    }
}

/// The index, in `sizes` (the byte sizes of the session's earlier turns from its `skipped`-th
/// on), of the first turn shown: past the turn bound's cut, and past the byte bound's, which
/// drops whole steps of half `max_bytes`, measured from the turn bound's cut, so that it too
/// lands on the same turn for every request until the next step is needed.
fn first_shown(sizes: &[usize], limits: HistoryLimits, skipped: usize) -> usize {
    let by_turns = never_shown(skipped + sizes.len(), limits)
        .saturating_sub(skipped)
        .min(sizes.len());
    let kept = sizes.get(by_turns..).unwrap_or_default();
    by_turns + first_within_bytes(kept, limits.max_bytes)
}

/// The index of the first of `sizes` shown within `max_bytes`, in steps of half of it from
/// the first; all of them (none shown) when the newest alone is larger than the budget.
fn first_within_bytes(sizes: &[usize], max_bytes: usize) -> usize {
    let bytes_from = |cut: usize| sizes.get(cut..).unwrap_or_default().iter().sum::<usize>();
    if bytes_from(0) <= max_bytes {
        return 0;
    }
    let step = (max_bytes / 2).max(1);
    let (mut running, mut next_step) = (0, step);
    for (index, size) in sizes.iter().enumerate() {
        running += size;
        if running >= next_step {
            next_step += step;
            if bytes_from(index + 1) <= max_bytes {
                return index + 1;
            }
        }
    }
    sizes.len()
}

/// How many turns the cut drops at once under `max_turns`: half of it, and at least two when
/// it allows two, so that the cut never moves on two turns in a row.
fn turn_block(max_turns: usize) -> usize {
    (max_turns / 2).max(max_turns.min(2)).max(1)
}

fn turn_bytes(turn: &PastTurn) -> usize {
    turn.messages.iter().map(message_bytes).sum()
}

fn message_bytes(message: &Message) -> usize {
    message.content.as_ref().map_or(0, String::len)
        + message
            .tool_calls
            .iter()
            .map(|call| call.function.name.len() + call.function.arguments.len())
            .sum::<usize>()
}

/// Cuts a message's text to `max_bytes` (at a character boundary) with a marker that says how
/// much was left out.
pub(crate) fn bounded(mut message: Message, max_bytes: usize) -> Message {
    if let Some(text) = &mut message.content {
        let left_out = crate::untrusted::cut(text, max_bytes);
        if left_out > 0 {
            text.push_str(&format!("\n[agentgate: {left_out} more bytes cut here]"));
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::message::Role;

    fn turn(bytes: usize) -> PastTurn {
        PastTurn {
            messages: vec![
                Message::text(Role::User, "u".repeat(bytes / 2)),
                Message::text(Role::Assistant, "a".repeat(bytes - bytes / 2)),
            ],
        }
    }

    fn limits(max_turns: usize, max_bytes: usize) -> HistoryLimits {
        HistoryLimits {
            max_turns,
            max_bytes,
        }
    }

    #[test]
    fn everything_fits_everything_is_shown() {
        let shown = select((0..3).map(|_| turn(100)).collect(), limits(20, 10_000), 0);
        assert_eq!(shown.len(), 6);
    }

    /// The newest turns are shown, whole, with nothing before them: the first message shown is
    /// the first of a turn kept.
    #[test]
    fn the_newest_turns_within_both_limits_are_shown() {
        let turns = (0..30)
            .map(|number| PastTurn {
                messages: vec![
                    Message::text(Role::User, format!("event {number}")),
                    Message::text(Role::Assistant, "a".repeat(98)),
                ],
            })
            .collect();
        let shown = select(turns, limits(20, 1_000_000), 0);
        assert_eq!(shown.len() % 2, 0);
        let turns_shown = shown.len() / 2;
        assert!((10..=20).contains(&turns_shown), "{turns_shown}");
        let first = format!("event {}", 30 - turns_shown);
        assert_eq!(shown[0].content.as_deref(), Some(first.as_str()));

        let shown = select(
            (0..10).map(|_| turn(300_000)).collect(),
            limits(20, 1_000_000),
            0,
        );
        let bytes: usize = shown.iter().map(message_bytes).sum();
        assert!(bytes <= 1_000_000, "{bytes}");
        assert!(bytes > 0);
    }

    #[test]
    fn consecutive_requests_mostly_keep_the_same_cut() {
        let mut cuts = Vec::new();
        for total in 25..55 {
            let sizes = vec![10_000; total];
            cuts.push(first_shown(&sizes, limits(20, 1_000_000), 0));
        }
        let moves = cuts.windows(2).filter(|pair| pair[0] != pair[1]).count();
        assert!(
            moves <= 3,
            "the cut moved {moves} times in 30 requests: {cuts:?}"
        );

        let mut cuts = Vec::new();
        for total in 1..31 {
            let sizes = vec![100_000; total];
            cuts.push(first_shown(&sizes, limits(100, 1_000_000), 0));
        }
        let moves = cuts.windows(2).filter(|pair| pair[0] != pair[1]).count();
        assert!(
            moves <= 6,
            "the cut moved {moves} times in 30 requests: {cuts:?}"
        );
        for (total, cut) in (1..31).zip(&cuts) {
            assert!(
                (total - cut) * 100_000 <= 1_000_000,
                "{total} turns, cut {cut}"
            );
        }
    }

    /// With a bound of two turns, the model sees one or two earlier turns and the cut moves
    /// every other turn, never on two turns in a row: every other turn's first request starts
    /// with the bytes of the turn before.
    #[test]
    fn a_small_bound_moves_the_cut_every_other_turn() {
        assert_eq!(
            [1, 2, 3, 4, 5, 20].map(turn_block),
            [1, 2, 2, 2, 2, 10],
            "blocks of half the bound, at least two"
        );
        let cuts: Vec<usize> = (0..12)
            .map(|total| first_shown(&vec![1_000; total], limits(2, 1_000_000), 0))
            .collect();
        assert_eq!(cuts, [0, 0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10]);
        for (total, cut) in cuts.iter().enumerate() {
            assert!(
                (1..=2).contains(&(total - cut)) || total == 0,
                "{total}: {cut}"
            );
        }
        let moves: Vec<bool> = cuts.windows(2).map(|pair| pair[0] != pair[1]).collect();
        assert!(
            moves.windows(2).all(|pair| !(pair[0] && pair[1])),
            "{cuts:?}"
        );
    }

    /// A turn reads only the turns from [`never_shown`] on, and shows what it would show had it
    /// read them all, whichever bound cuts.
    #[test]
    fn turns_never_shown_need_not_be_read() {
        for (max_turns, max_bytes) in [(2, 1_000_000), (20, 50_000), (20, 1_000_000), (5, 3_000)] {
            for total in 0..60 {
                let sizes: Vec<usize> = (0..total).map(|n| 1_000 + (n * 7_919) % 9_000).collect();
                let bounds = limits(max_turns, max_bytes);
                let skip = never_shown(total, bounds);
                let read = sizes.get(skip..).unwrap_or_default();
                assert_eq!(
                    first_shown(&sizes, bounds, 0),
                    skip + first_shown(read, bounds, skip),
                    "{total} turns, {bounds:?}"
                );
                assert!(first_shown(&sizes, bounds, 0) >= skip);
            }
        }
    }

    #[test]
    fn a_huge_message_is_cut_with_a_marker() {
        let message = bounded(Message::text(Role::Tool, "é".repeat(1000)), 101);
        let text = message.content.unwrap_or_default();
        assert!(text.contains("more bytes cut here"), "{text}");
        assert!(text.len() < 200);
    }
}
