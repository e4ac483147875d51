//! How `run` and `resume` report their end: the human summary, the `[expect]` verdict, and for
//! CI the `--json` line (stdout holds nothing else then) and the `--junit` file.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::anyhow;
use clap::Args;
use serde_json::json;

use super::CliResult;
use crate::config::Expectation;
use crate::jobdir::JobDir;
use crate::report::{self, junit};
use crate::train::Summary;

#[derive(Debug, Args)]
pub(super) struct OutputArgs {
    /// Print the summary (summary.json's content) as JSON on the last line of stdout; all
    /// progress and messages go to stderr.
    #[arg(long)]
    json: bool,
    /// Write a JUnit XML report to FILE: one test case for the job's completion, one per
    /// [expect] threshold.
    #[arg(long, value_name = "FILE")]
    junit: Option<PathBuf>,
}

/// What the end of a run is reported about, known before it starts.
pub(super) struct Reporting {
    json_out: Option<File>,
    junit: Option<PathBuf>,
    job: String,
    expect: Vec<Expectation>,
    started: Instant,
}

/// A command that ended well: the job, its summary when this command has one (node 0 of a
/// trained job, or a job that had already finished), and a note to print instead of the
/// summary line.
pub(super) struct Done {
    pub job: JobDir,
    pub summary: Option<Summary>,
    pub note: Option<String>,
}

/// How the command ended.
pub(super) type Ending = Result<Done, (u8, anyhow::Error)>;

impl Reporting {
    /// With `--json`, points stdout (ours and the workers') at stderr from here on, keeping the
    /// real stdout for the one JSON line.
    pub(super) fn start(
        args: &OutputArgs,
        job: String,
        expect: Vec<Expectation>,
        started: Instant,
    ) -> Result<Self, (u8, anyhow::Error)> {
        let json_out = if args.json {
            Some(divert_stdout().map_err(|e| (1, anyhow!("cannot set up --json output: {e}")))?)
        } else {
            None
        };
        Ok(Reporting {
            json_out,
            junit: args.junit.clone(),
            job,
            expect,
            started,
        })
    }

    /// Prints the outcome, turns unmet expectations into exit 1, writes the JUnit file and
    /// the JSON line; returns the command's result.
    pub(super) fn finish(self, ending: Ending) -> CliResult {
        let verdict = match &ending {
            Ok(done) => {
                match (&done.note, &done.summary) {
                    (Some(note), _) => outln!("{note}"),
                    (None, Some(summary)) => print_finished(&done.job, summary),
                    (None, None) => {}
                }
                let expectations = done.summary.as_ref().map(|s| s.expectations.as_slice());
                match report::unmet_report(expectations.unwrap_or_default()) {
                    Some(unmet) => Err((1, anyhow!("job `{}` finished, but {unmet}", self.job))),
                    None => Ok(()),
                }
            }
            Err((code, e)) => Err((*code, anyhow!("{e:#}"))),
        };
        let junit_written = self.write_junit(&ending);
        if let Some(mut out) = self.json_out {
            let line = match &ending {
                Ok(Done {
                    summary: Some(summary),
                    ..
                }) => serde_json::to_string(summary).unwrap_or_default(),
                Ok(done) => json!({
                    "job": self.job, "status": "finished", "note": done.note,
                })
                .to_string(),
                Err((code, e)) => json!({
                    "job": self.job,
                    "status": match code {
                        2 => "usage_error",
                        128.. => "interrupted",
                        _ => "failed",
                    },
                    "exit_code": code,
                    "error": format!("{e:#}"),
                })
                .to_string(),
            };
            // stdout may be closed (`| head`); the exit status still tells the story.
            let _ = writeln!(out, "{line}").and_then(|()| out.flush());
        }
        match (verdict, junit_written) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) => Err((1, e)),
            (Ok(()), Ok(())) => Ok(()),
        }
    }

    fn write_junit(&self, ending: &Ending) -> anyhow::Result<()> {
        let Some(path) = &self.junit else {
            return Ok(());
        };
        let error_text = match ending {
            Err((_, e)) => format!("{e:#}"),
            Ok(done) => done.note.clone().unwrap_or_default(),
        };
        let completion = match ending {
            Ok(Done {
                summary: Some(summary),
                ..
            }) => junit::Completion::Finished(summary),
            Ok(_) => junit::Completion::Unchecked(&error_text),
            Err(_) => junit::Completion::Failed(&error_text),
        };
        let wall_s = self.started.elapsed().as_secs_f64();
        let xml = junit::render(&self.job, &self.expect, &completion, wall_s);
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        parent
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| crate::jobdir::write_atomic(path, xml.as_bytes()))
            .map_err(|e| {
            anyhow!(
                "cannot write the JUnit report `{}`: {e}; check that its directory exists and is writable",
                path.display()
            )
        })
    }
}

/// Duplicates stdout for later and makes file descriptor 1 a copy of stderr, so everything
/// printed from now on (by us or by child processes, which inherit it) lands on stderr.
fn divert_stdout() -> std::io::Result<File> {
    std::io::stdout().flush()?;
    // SAFETY: dup/dup2 on the process's own standard descriptors; the duplicate is owned by
    // the File returned and nothing else.
    unsafe {
        let saved = libc::dup(1);
        if saved < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let saved = File::from_raw_fd(saved);
        if libc::dup2(2, 1) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(saved)
    }
}

pub(super) fn print_finished(job: &JobDir, s: &Summary) {
    outln!(
        "finished: {}, final train loss {:.4}, {} steps, {:.0} samples/s, {:.1} s",
        s.describe_eval(),
        s.final_train_loss,
        s.steps,
        s.train_samples_per_s,
        s.wall_s
    );
    for r in &s.expectations {
        let mark = if r.met { "met" } else { "UNMET" };
        outln!("  expect {mark:<5} {}", r.describe());
    }
    outln!("job directory: {}", job.root.display());
    outln!("curves: {}", job.curves_path().display());
}
