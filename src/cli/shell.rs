//! Shell integration from the one CLI definition: completion scripts (clap_complete) and man
//! pages (clap_mangen), so neither can drift from the real flags.

use std::io::Write;
use std::path::Path;

use anyhow::anyhow;
use clap::CommandFactory;
use clap_complete::Shell;

use super::{Cli, CliResult};

pub(super) fn completions(shell: Shell) -> CliResult {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "ddpjob", &mut out);
    write_stdout(&out)
}

/// `ddpjob.1` on stdout, or with `dir` that page and one per subcommand (`ddpjob-run.1`, ...).
pub(super) fn man(dir: Option<&Path>) -> CliResult {
    let Some(dir) = dir else {
        let mut out = Vec::new();
        clap_mangen::Man::new(Cli::command())
            .render(&mut out)
            .map_err(|e| (1, anyhow!("cannot render the man page: {e}")))?;
        return write_stdout(&out);
    };
    std::fs::create_dir_all(dir)
        .and_then(|()| clap_mangen::generate_to(Cli::command(), dir))
        .map_err(|e| {
            (
                1,
                anyhow!("cannot write man pages to `{}`: {e}", dir.display()),
            )
        })?;
    println!("man pages written to {}", dir.display());
    Ok(())
}

fn write_stdout(bytes: &[u8]) -> CliResult {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(bytes)
        .and_then(|()| stdout.flush())
        .map_err(|e| (1, anyhow!("cannot write to stdout: {e}")))
}
