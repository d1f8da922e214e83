//! The man pages agentgate(8) and agentgate.toml(5), rendered from docs/reference.md at build
//! time. The reference is the contract; the pages are the same text, so they cannot drift from it.
//!
//! The Markdown is parsed with `pulldown-cmark` and written as man(7) roff: `##` headings are
//! sections, `###` subsections, tables become tagged paragraphs (the first column is the tag),
//! code is bold, and links keep their text.

use pulldown_cmark::{Event, HeadingLevel, Options, Parser, Tag, TagEnd};

/// The reference, as the project ships it.
const REFERENCE: &str = include_str!("../../docs/reference.md");

/// One page: which top-level sections of the reference it carries, under which man section names.
struct Page {
    file: &'static str,
    title: &'static str,
    section: &'static str,
    name_line: &'static str,
    /// (heading in the reference, section name in the page)
    sections: &'static [(&'static str, &'static str)],
}

const PAGES: [Page; 2] = [
    Page {
        file: "agentgate.8",
        title: "AGENTGATE",
        section: "8",
        name_line: "agentgate \\- durable gateway from webhooks to AI agent turns",
        sections: &[
            ("Commands", "COMMANDS"),
            ("Exit statuses", "EXIT STATUS"),
            ("Environment", "ENVIRONMENT"),
            ("Signals", "SIGNALS"),
            ("HTTP", "HTTP"),
            ("States", "STATES"),
            ("State directory", "FILES"),
            ("Resume", "RESUME"),
            ("Stop sequence", "STOP SEQUENCE"),
            ("Reconcile", "RECONCILE"),
            ("systemd", "SYSTEMD"),
            ("Journal", "JOURNAL"),
            ("Metrics", "METRICS"),
            ("Threat model", "SECURITY"),
        ],
    },
    Page {
        file: "agentgate.toml.5",
        title: "AGENTGATE.TOML",
        section: "5",
        name_line: "agentgate.toml \\- agentgate configuration file",
        sections: &[("Configuration", "DESCRIPTION"), ("MCP tools", "MCP TOOLS")],
    },
];

/// The pages, as (file name, roff text).
pub(super) fn pages() -> Vec<(&'static str, String)> {
    PAGES.iter().map(|page| (page.file, render(page))).collect()
}

fn render(page: &Page) -> String {
    let mut out = format!(
        ".TH {} {} \"\" \"agentgate {}\" \"agentgate\"\n.SH NAME\n{}\n",
        page.title,
        page.section,
        crate::VERSION,
        page.name_line
    );
    if page.section == "8" {
        out.push_str(
            ".SH SYNOPSIS\n\\fBagentgate\\fR \\fICOMMAND\\fR [\\fB\\-\\-config\\fR \\fIPATH\\fR] [\\fIOPTIONS\\fR]\n",
        );
    }
    for (heading, name) in page.sections {
        if let Some(markdown) = section(REFERENCE, heading) {
            out.push_str(&format!(".SH {name}\n"));
            out.push_str(&roff(markdown));
        }
    }
    out.push_str(&format!(
        ".SH SEE ALSO\n{}\n",
        if page.section == "8" {
            "\\fBagentgate.toml\\fR(5), \\fBagentgate\\-serve\\fR(1), \\fBsystemd.socket\\fR(5), \\fBjournalctl\\fR(1); /usr/share/doc/agentgate/"
        } else {
            "\\fBagentgate\\fR(8); /usr/share/doc/agentgate/"
        }
    ));
    out
}

/// The body of the `## heading` section of `markdown`, up to the next `##` heading.
fn section<'a>(markdown: &'a str, heading: &str) -> Option<&'a str> {
    let start = markdown.find(&format!("\n## {heading}\n"))?;
    let body = &markdown[start + heading.len() + 5..];
    let end = body.find("\n## ").map_or(body.len(), |end| end + 1);
    Some(&body[..end])
}

/// Text for roff: backslashes and minus signs escaped.
fn escape(text: &str) -> String {
    text.replace('\\', "\\e").replace('-', "\\-")
}

/// Markdown to man(7) roff.
fn roff(markdown: &str) -> String {
    let mut writer = RoffWriter::default();
    for event in Parser::new_ext(markdown, Options::ENABLE_TABLES) {
        writer.event(event);
    }
    writer.flush();
    writer.out
}

/// The roff being written, the line being built and the table being collected.
#[derive(Default)]
struct RoffWriter {
    out: String,
    line: String,
    /// Rows of cells.
    table: Vec<Vec<String>>,
    cell: Option<String>,
    in_code_block: bool,
    list_depth: usize,
}

impl RoffWriter {
    /// Writes the line built so far; a line that starts with a dot or a quote would be a request.
    fn flush(&mut self) {
        for text_line in self.line.trim().lines() {
            if text_line.starts_with('.') || text_line.starts_with('\'') {
                self.out.push_str("\\&");
            }
            self.out.push_str(text_line.trim_start());
            self.out.push('\n');
        }
        self.line.clear();
    }

    /// Where inline text goes: the table cell being collected, or the line.
    fn target(&mut self) -> &mut String {
        self.cell.as_mut().unwrap_or(&mut self.line)
    }

    #[expect(
        clippy::wildcard_enum_match_arm,
        reason = "pulldown-cmark's events the reference does not use add nothing to the page"
    )]
    fn event(&mut self, event: Event<'_>) {
        match event {
            Event::Start(tag) => self.start(tag),
            Event::End(tag) => self.end(tag),
            Event::Code(code) => {
                let target = self.target();
                target.push_str("\\fB");
                target.push_str(&escape(&code));
                target.push_str("\\fR");
            }
            Event::Text(text) if self.in_code_block => {
                for code_line in text.lines() {
                    if code_line.starts_with('.') || code_line.starts_with('\'') {
                        self.out.push_str("\\&");
                    }
                    self.out.push_str(&escape(code_line));
                    self.out.push('\n');
                }
            }
            Event::Text(text) => self.target().push_str(&escape(&text)),
            Event::SoftBreak | Event::HardBreak => self.target().push(' '),
            // Nothing else occurs in the reference (no HTML, footnotes, rules or math).
            _ => {}
        }
    }

    #[expect(
        clippy::wildcard_enum_match_arm,
        reason = "pulldown-cmark's tags the reference does not use add no markup"
    )]
    fn start(&mut self, tag: Tag<'_>) {
        match tag {
            Tag::Heading { level, .. } => {
                self.flush();
                self.out.push_str(if level == HeadingLevel::H2 {
                    ".SH "
                } else {
                    ".SS "
                });
            }
            Tag::Paragraph if self.list_depth == 0 => {
                self.flush();
                self.out.push_str(".PP\n");
            }
            Tag::List(_) => {
                self.flush();
                if self.list_depth > 0 {
                    self.out.push_str(".RS\n");
                }
                self.list_depth += 1;
            }
            Tag::Item => {
                self.flush();
                self.out.push_str(".IP \\(bu 2\n");
            }
            Tag::CodeBlock(_) => {
                self.flush();
                self.out.push_str(".PP\n.RS 4\n.nf\n");
                self.in_code_block = true;
            }
            Tag::Table(_) => {
                self.flush();
                self.table.clear();
            }
            Tag::TableHead | Tag::TableRow => self.table.push(Vec::new()),
            Tag::TableCell => self.cell = Some(String::new()),
            Tag::Strong | Tag::Emphasis => self.target().push_str("\\fB"),
            // Links keep their text; the rest adds no markup.
            _ => {}
        }
    }

    #[expect(
        clippy::wildcard_enum_match_arm,
        reason = "pulldown-cmark's tags the reference does not use add no markup"
    )]
    fn end(&mut self, tag: TagEnd) {
        match tag {
            TagEnd::Heading(_) => {
                self.out.push_str(self.line.trim());
                self.out.push('\n');
                self.line.clear();
            }
            TagEnd::Paragraph if self.list_depth == 0 => self.flush(),
            TagEnd::Paragraph => self.line.push(' '),
            TagEnd::List(_) => {
                self.flush();
                self.list_depth = self.list_depth.saturating_sub(1);
                if self.list_depth > 0 {
                    self.out.push_str(".RE\n");
                }
            }
            TagEnd::Item => self.flush(),
            TagEnd::CodeBlock => {
                self.out.push_str(".fi\n.RE\n");
                self.in_code_block = false;
            }
            TagEnd::TableCell => {
                if let (Some(text), Some(row)) = (self.cell.take(), self.table.last_mut()) {
                    row.push(text.trim().to_string());
                }
            }
            TagEnd::Table => self.out.push_str(&table_roff(&self.table)),
            TagEnd::Strong | TagEnd::Emphasis => self.target().push_str("\\fR"),
            _ => {}
        }
    }
}

/// A table as tagged paragraphs: the first column is the tag; the other columns follow, each
/// named by its header unless it is the last (the description).
fn table_roff(rows: &[Vec<String>]) -> String {
    let Some((header, body)) = rows.split_first() else {
        return String::new();
    };
    let mut out = String::new();
    for row in body {
        let Some((tag, rest)) = row.split_first() else {
            continue;
        };
        out.push_str(".TP\n");
        out.push_str(tag);
        out.push('\n');
        let last = rest.len().saturating_sub(1);
        let parts: Vec<String> = rest
            .iter()
            .enumerate()
            .filter(|(_, text)| !text.is_empty())
            .map(|(index, text)| match header.get(index + 1) {
                Some(name) if index < last => format!("{name}: {text}."),
                _ => text.clone(),
            })
            .collect();
        let text = parts.join(" ");
        if text.starts_with('.') || text.starts_with('\'') {
            out.push_str("\\&");
        }
        out.push_str(&text);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_section_a_page_names_is_in_the_reference() {
        for page in &PAGES {
            for (heading, _) in page.sections {
                assert!(
                    section(REFERENCE, heading).is_some(),
                    "{}: no \"## {heading}\" in docs/reference.md",
                    page.file
                );
            }
        }
    }

    #[test]
    fn markdown_becomes_roff() {
        let text = roff(
            "Intro with `a-b` and **bold**.\n\n| key | default | meaning |\n|---|---|---|\n| `x` | `1` | what x is |\n\n- one\n- two\n\n```toml\n.dot = 1\n```\n",
        );
        assert!(
            text.contains(".PP\nIntro with \\fBa\\-b\\fR and \\fBbold\\fR."),
            "{text}"
        );
        assert!(
            text.contains(".TP\n\\fBx\\fR\ndefault: \\fB1\\fR. what x is\n"),
            "{text}"
        );
        assert!(text.contains(".IP \\(bu 2\none\n"), "{text}");
        assert!(text.contains(".nf\n\\&.dot = 1\n"), "{text}");
    }
}
