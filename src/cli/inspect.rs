//! `list` and `show`: what the jobs under a jobs directory are doing, read without touching them.

use std::path::Path;

use anyhow::anyhow;

use super::CliResult;
use crate::jobdir::now_unix;
use crate::report::{self, JobView, show};

pub(super) fn list(jobs_dir: &Path, json: bool) -> CliResult {
    if let Some(what) = crate::jobdir::not_a_directory(jobs_dir) {
        return Err((
            2,
            anyhow!(
                "the jobs directory `{}` {what}; pass --jobs-dir the directory your runs were \
                 made in",
                jobs_dir.display()
            ),
        ));
    }
    let views = JobView::load_all(jobs_dir).map_err(|e| {
        (
            1,
            anyhow!("cannot read jobs directory `{}`: {e}", jobs_dir.display()),
        )
    })?;
    if json {
        // No jobs is an empty array: a script reads the same shape either way.
        outln!("{}", report::json::list(&views));
        return Ok(());
    }
    if views.is_empty() {
        match jobs_dir.exists() {
            true => outln!("no jobs in {}", jobs_dir.display()),
            false => outln!("no jobs in {} (it does not exist)", jobs_dir.display()),
        }
        return Ok(());
    }
    out!("{}", show::list(&views, now_unix()));
    Ok(())
}

pub(super) fn show(jobs_dir: &Path, name: &str, json: bool) -> CliResult {
    match JobView::load(jobs_dir, name) {
        Some(view) if json => {
            outln!("{}", report::json::job(&view));
            Ok(())
        }
        Some(view) => {
            out!("{}", show::show(&view, now_unix()));
            Ok(())
        }
        None if jobs_dir.join(name).exists() => Err((
            2,
            anyhow!(
                "`{}` has no readable state.json, so it is not a ddpjob job",
                jobs_dir.join(name).display()
            ),
        )),
        None => Err((
            2,
            anyhow!(
                "no job `{name}` in `{}`; `ddpjob list{}` shows the jobs there",
                jobs_dir.display(),
                crate::jobdir::jobs_dir_option(jobs_dir)
            ),
        )),
    }
}
