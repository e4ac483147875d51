//! The launcher's side of experiment tracking (`[logging] mlflow`, see `ddpjob_track`): where
//! the run goes, checked before a job exists (no server named: exit 2), and node 0's launcher
//! following the job while its workers train, ending the run as the job ended once
//! `state.json` says how. The workers know nothing of it.

use std::path::Path;
use std::time::Duration;

use super::RunError;
use crate::config::JobSpec;
use crate::jobdir::JobDir;
use ddpjob_track::{Live, Note, Target, Tracker, run_of};

/// How long the end of a run may wait on a server that does not answer.
const PATIENCE: Duration = Duration::from_secs(20);

/// Where `spec`'s run goes: `None` without `logging.mlflow`; the URI from `logging.mlflow_uri`,
/// `MLFLOW_TRACKING_URI`, or the run `job` already has; refused (exit 2) without one.
pub(crate) fn target(spec: &JobSpec, job: &Path) -> Result<Option<Target>, RunError> {
    let logging = &spec.logging;
    if !logging.mlflow {
        return Ok(None);
    }
    let uri = (logging.mlflow_uri.clone())
        .or_else(|| std::env::var("MLFLOW_TRACKING_URI").ok())
        .filter(|u| !u.is_empty())
        .or_else(|| run_of(job).map(|(uri, _)| uri));
    let Some(uri) = uri else {
        return Err(RunError::Usage(
            "logging.mlflow = true needs a tracking server: set logging.mlflow_uri = \
             \"http://host:5000\" or MLFLOW_TRACKING_URI (or drop logging.mlflow and upload the \
             job later with `ddpjob sync NAME --mlflow-uri URI`)"
                .into(),
        ));
    };
    let target = Target {
        uri,
        experiment: logging.mlflow_experiment.clone(),
        log_model: logging.mlflow_log_model,
    };
    // The URI's form is checked now, before anything is made.
    ddpjob_track::mlflow::Client::new(&target.uri, ddpjob_track::mlflow::Auth::None)
        .map_err(RunError::Usage)?;
    Ok(Some(target))
}

/// Follows `job` (training on `world_size` workers) when `spec` asks for a run.
pub(crate) fn follow(job: &JobDir, spec: &JobSpec, world_size: usize) -> Option<Live> {
    let target = match target(spec, &job.root) {
        Ok(target) => target?,
        Err(e) => {
            errln!("warning: {e}");
            return None;
        }
    };
    let tracker = match Tracker::new(job.clone(), target) {
        Ok(tracker) => tracker,
        Err(e) => {
            errln!("warning: {e}");
            return None;
        }
    };
    let say = Box::new(|note: Note| match note {
        Note::Info(line) => errln!("{line}"),
        Note::Warning(line) => errln!("warning: {line}"),
    });
    Some(Live::start(tracker, world_size, say))
}

/// Runs `train` with the job followed, and ends the run once `record` has written how the
/// job ended.
pub(crate) fn followed<T>(
    job: &JobDir,
    spec: &JobSpec,
    world_size: usize,
    train: impl FnOnce() -> Result<(), RunError>,
    record: impl FnOnce(Result<(), RunError>) -> Result<T, RunError>,
) -> Result<T, RunError> {
    let live = follow(job, spec, world_size);
    let recorded = record(train());
    if let Some(live) = live {
        live.finish(PATIENCE);
    }
    recorded
}
