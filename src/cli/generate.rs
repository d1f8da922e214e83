//! Files generated from the command-line definition for packaging: man pages, completions.

use crate::exit::Failure;

use super::args::{Cli, GenerateCommand};

pub(super) fn generate(what: GenerateCommand) -> Result<(), Failure> {
    use clap::CommandFactory;
    let mut command = Cli::command();
    let mut stdout = std::io::stdout();
    match what {
        GenerateCommand::Manpages { dir } => {
            let failed = |err: std::io::Error| {
                Failure::runtime(format!(
                    "cannot write man pages into {}: {err}",
                    dir.display()
                ))
            };
            // A page per subcommand for its options; agentgate(8) replaces the top-level one,
            // so that `man agentgate` opens the reference.
            clap_mangen::generate_to(command, &dir).map_err(failed)?;
            std::fs::remove_file(dir.join("agentgate.1")).map_err(failed)?;
            for (file, text) in super::manual::pages() {
                std::fs::write(dir.join(file), text).map_err(failed)?;
            }
            Ok(())
        }
        GenerateCommand::Completions { shell } => {
            clap_complete::generate(shell, &mut command, "agentgate", &mut stdout);
            Ok(())
        }
    }
}
