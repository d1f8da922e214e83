//! Standard output for commands (the command line and `reconcile --dry-run`). A reader that stops
//! early (`agentgate sessions list | head`) closes the pipe; the command then ends quietly with
//! status 0, never with a panic, as `println!` would on a closed pipe.

use std::io::Write;

/// Writes formatted text (and a newline) to stdout; see the module doc for a closed pipe.
pub(crate) fn write_stdout(text: std::fmt::Arguments<'_>, newline: bool) {
    let mut stdout = std::io::stdout().lock();
    let written = stdout.write_fmt(text).and_then(|()| {
        if newline {
            stdout.write_all(b"\n")
        } else {
            Ok(())
        }
    });
    if let Err(err) = written {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("agentgate: cannot write the output: {err}");
        std::process::exit(1);
    }
}

/// `println!` for commands: a closed pipe ends the command quietly.
macro_rules! outln {
    () => {
        $crate::output::write_stdout(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!($($arg)*), true)
    };
}

/// `print!` for commands: a closed pipe ends the command quietly.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!($($arg)*), false)
    };
}

pub(crate) use {out, outln};

/// A list command's table: each column as wide as its widest cell, two spaces apart, the last
/// one unpadded, so that columns line up whatever the cells hold (a long route name, a session
/// key, `awaiting_approval`).
pub(crate) struct Table {
    header: Vec<&'static str>,
    /// Columns aligned right (counts).
    right: Vec<usize>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(header: &[&'static str]) -> Table {
        Table {
            header: header.to_vec(),
            right: Vec::new(),
            rows: Vec::new(),
        }
    }

    /// Aligns `columns` (by index) to the right.
    pub(crate) fn right(mut self, columns: &[usize]) -> Table {
        self.right = columns.to_vec();
        self
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Writes the header and the rows to stdout.
    pub(crate) fn print(&self) {
        for line in self.lines() {
            outln!("{line}");
        }
    }

    fn lines(&self) -> Vec<String> {
        let header: Vec<String> = self.header.iter().map(ToString::to_string).collect();
        let mut widths: Vec<usize> = header.iter().map(|name| name.chars().count()).collect();
        for row in &self.rows {
            for (column, cell) in row.iter().enumerate() {
                if let Some(width) = widths.get_mut(column) {
                    *width = (*width).max(cell.chars().count());
                }
            }
        }
        std::iter::once(&header)
            .chain(&self.rows)
            .map(|row| self.line(row, &widths))
            .collect()
    }

    fn line(&self, cells: &[String], widths: &[usize]) -> String {
        let last = cells.len().saturating_sub(1);
        let mut line = String::new();
        for (column, cell) in cells.iter().enumerate() {
            let width = widths.get(column).copied().unwrap_or(0);
            let pad = width.saturating_sub(cell.chars().count());
            if column > 0 {
                line.push_str("  ");
            }
            if self.right.contains(&column) {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                if column < last {
                    line.push_str(&" ".repeat(pad));
                }
            }
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::Table;

    #[test]
    fn columns_line_up_whatever_their_cells_hold() {
        let mut table = Table::new(&["EVENT", "STATUS", "N", "SESSION"]).right(&[2]);
        table.row(vec![
            "e1".into(),
            "awaiting_approval".into(),
            "7".into(),
            "a".into(),
        ]);
        table.row(vec![
            "e2".into(),
            "queued".into(),
            "12".into(),
            "acme/web#7".into(),
        ]);
        let lines = table.lines();
        assert_eq!(lines[0], "EVENT  STATUS              N  SESSION");
        assert_eq!(lines[1], "e1     awaiting_approval   7  a");
        assert_eq!(lines[2], "e2     queued             12  acme/web#7");
    }
}
