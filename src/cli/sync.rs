//! `ddpjob sync NAME`: uploads a job to an MLflow tracking server after it ran, offline or
//! while its server was down: the same run a live one makes (see `ddpjob_track`), continued
//! where the job's `mlflow.json` says one exists, so syncing twice sends nothing twice.

use std::path::PathBuf;

use anyhow::anyhow;
use clap::Args;

use super::{CliResult, existing_job};
use ddpjob_track::{Target, Tracker, run_of};

#[derive(Debug, Args)]
pub(super) struct SyncArgs {
    /// The job's name (its directory under --jobs-dir).
    name: String,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// The tracking server (default: the job's logging.mlflow_uri, MLFLOW_TRACKING_URI, or the
    /// server its run is on).
    #[arg(long, value_name = "URI")]
    mlflow_uri: Option<String>,
    /// The experiment (default: the job's logging.mlflow_experiment, MLFLOW_EXPERIMENT_NAME,
    /// or the job's name).
    #[arg(long, value_name = "NAME")]
    experiment: Option<String>,
    /// Upload model.safetensors as an artifact too.
    #[arg(long)]
    log_model: bool,
}

pub(super) fn sync(args: &SyncArgs) -> CliResult {
    let job = existing_job(&args.jobs_dir, &args.name)?;
    // The job's own [logging], for what the flags leave out.
    let logging = crate::config::load(&job.job_toml(), &[])
        .map(|l| l.spec.logging.clone())
        .ok();
    let uri = (args.mlflow_uri.clone())
        .or_else(|| logging.as_ref().and_then(|l| l.mlflow_uri.clone()))
        .or_else(|| std::env::var("MLFLOW_TRACKING_URI").ok())
        .filter(|u| !u.is_empty())
        .or_else(|| run_of(&job.root).map(|(uri, _)| uri))
        .ok_or_else(|| {
            (
                2,
                anyhow!(
                    "no tracking server to sync `{}` to: give --mlflow-uri http://host:5000 (or \
                     set MLFLOW_TRACKING_URI)",
                    args.name
                ),
            )
        })?;
    let target = Target {
        uri,
        experiment: (args.experiment.clone())
            .or_else(|| logging.as_ref().and_then(|l| l.mlflow_experiment.clone())),
        log_model: args.log_model || logging.as_ref().is_some_and(|l| l.mlflow_log_model),
    };
    let mut tracker = Tracker::new(job.clone(), target).map_err(|e| (2, anyhow!(e)))?;
    let failed =
        |e: ddpjob_track::mlflow::MlflowError| (1, anyhow!("sync of `{}`: {e}", args.name));
    let sent = tracker.sync().map_err(failed)?;
    for warning in tracker.finish().map_err(failed)? {
        errln!("warning: mlflow: {warning}");
    }
    let status = job
        .read_state()
        .map_or("unknown".into(), |s| s.status.to_string());
    outln!(
        "synced job `{}` ({status}) to run {} at {}: {sent} metric values sent",
        args.name,
        tracker.run_id().unwrap_or("?"),
        tracker.uri()
    );
    Ok(())
}
