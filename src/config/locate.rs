//! Finds the line of a key path in the config text, for findings.

/// Maps key paths such as `routes.github.verify.secret` to line numbers in the source text.
pub(super) struct Locator {
    text: String,
    document: Option<toml_edit::ImDocument<String>>,
}

impl Locator {
    pub(super) fn new(text: &str) -> Locator {
        Locator {
            text: text.to_string(),
            document: toml_edit::ImDocument::parse(text.to_string()).ok(),
        }
    }

    pub(super) fn line_of_offset(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1
    }

    /// The line of the deepest existing key along `path` (a missing key points at its table).
    pub(super) fn line_of_key(&self, path: &str) -> Option<usize> {
        let document = self.document.as_ref()?;
        let mut table: &dyn toml_edit::TableLike = document.as_table();
        let mut span = None;
        for part in path.split('.') {
            let Some((key, item)) = table.get_key_value(part) else {
                break;
            };
            span = key.span().or_else(|| item.span()).or(span);
            match item.as_table_like() {
                Some(next) => table = next,
                None => break,
            }
        }
        span.map(|s| self.line_of_offset(s.start))
    }
}
