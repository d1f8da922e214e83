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
