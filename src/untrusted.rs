//! Text that comes from outside (payloads, headers, tool output) on its way to a model or a
//! terminal.
//!
//! Event data reaches the model between markers that carry a random nonce
//! (`<webhook-event-NONCE …>` … `</webhook-event-NONCE>`), drawn when the event's first turn
//! starts, after the payload was written: a payload cannot close markers whose nonce it cannot
//! know, in any spelling, so there is no list of look-alike spellings to keep complete. Should a
//! payload contain the exact closing marker anyway, it is broken. Event data and text for a
//! terminal also lose control characters (which would carry escape sequences into `sessions
//! show`) and bidirectional overrides and zero-width characters (which make text read
//! differently from what it is).

/// Cuts `text` to at most `max_bytes`, at a character boundary; returns how many bytes were
/// left out (0: none). The caller marks the cut in its own words.
pub(crate) fn cut(text: &mut String, max_bytes: usize) -> usize {
    if text.len() <= max_bytes {
        return 0;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let left_out = text.len() - end;
    text.truncate(end);
    left_out
}

/// Bidirectional overrides and isolates, and zero-width characters: they make text display
/// differently from what it is.
pub(crate) fn is_invisible_format(c: char) -> bool {
    matches!(c,
        '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2064}'
        | '\u{2066}'..='\u{2069}' | '\u{FEFF}')
}

/// Event data as the model sees it between markers that `closing` ends: hidden characters are
/// removed, then any occurrence of `closing` is broken (`</` becomes `<\/`).
pub(crate) fn inside_markers(text: &str, closing: &str) -> String {
    let visible = for_terminal(text);
    let broken = closing.replacen("</", "<\\/", 1);
    visible.replace(closing, &broken)
}

/// Text for a terminal: control characters other than newline and tab (and with them every
/// escape sequence's ESC), and invisible format characters, are removed.
pub(crate) fn for_terminal(text: &str) -> String {
    text.chars().filter(|c| !is_hidden(*c)).collect()
}

fn is_hidden(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || is_invisible_format(c)
}

/// Tool output as it is stored and shown to the model: hidden characters removed (as for a
/// terminal: NULs and escape sequences carry nothing a model can use), then cut so that what is
/// stored stays within `cap` bytes. The transcript keeps the output inside a JSON tool result,
/// itself a JSON string in the entry, so each character is counted at what it costs after both
/// escapes: a quote or backslash 4 bytes, a newline or tab 3. `truncated` says the tool's output
/// was already cut when read. The cut is marked; the flag says whether there was one.
pub(crate) fn tool_output(text: &str, truncated: bool, cap: usize) -> (String, bool) {
    let visible = for_terminal(text);
    let mut stored = 0;
    let mut end = visible.len();
    for (index, c) in visible.char_indices() {
        stored += match c {
            '"' | '\\' => 4,
            '\n' | '\t' => 3,
            _ => c.len_utf8(),
        };
        if stored > cap {
            end = index;
            break;
        }
    }
    let mut kept = visible[..end].to_string();
    let truncated = truncated || end < visible.len();
    if truncated {
        kept.push_str(&format!("\n[output truncated at {cap} bytes]"));
    }
    (kept, truncated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exact_closing_marker_is_broken_and_other_text_kept() {
        let closing = "</webhook-event-0123abcd>";
        let text = inside_markers(
            "a </webhook-event-0123abcd> b </webhook-event> c < d",
            closing,
        );
        assert!(!text.contains(closing), "{text}");
        assert_eq!(
            text,
            "a <\\/webhook-event-0123abcd> b </webhook-event> c < d"
        );
    }

    #[test]
    fn control_and_invisible_characters_are_removed() {
        assert_eq!(
            for_terminal("red \u{1b}[31mtext\u{7}\r\nnext\tline\u{202E}"),
            "red [31mtext\nnext\tline"
        );
        assert_eq!(inside_markers("a\u{0}b\u{85}c\u{2066}d", "</x>"), "abcd");
    }

    #[test]
    fn tool_output_is_capped_in_stored_bytes_without_hidden_characters() {
        let (nuls, cut) = tool_output(&"\0".repeat(200_000), false, 1000);
        assert_eq!((nuls.as_str(), cut), ("", false));
        let (quotes, cut) = tool_output(&"\"".repeat(1000), false, 1000);
        assert!(cut);
        assert!(quotes.starts_with(&"\"".repeat(250)) && !quotes.starts_with(&"\"".repeat(251)));
        let entry = serde_json::json!({"message": {"content": serde_json::json!({"stdout": quotes}).to_string()}});
        assert!(
            entry.to_string().len() < 1000 + 200,
            "{}",
            entry.to_string().len()
        );
        let (plain, cut) = tool_output("\u{1b}[2Jok\n", false, 1000);
        assert_eq!((plain.as_str(), cut), ("[2Jok\n", false));
    }
}
