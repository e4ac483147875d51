//! The task seam (`ddpjob-seam`'s [`Task`], its metrics and batches), and how a job opens its
//! task: by the dataset's name, through the installed registry.

use crate::config::JobSpec;
use crate::jobdir::JobDir;
use crate::registry::{DataContext, Registry};

pub use ddpjob_seam::task::*;

/// Opens the dataset `spec` names, through the registry. What the data keeps in the job
/// directory is read from `job` (text data's vocabulary: a resumed job encodes exactly as it
/// did).
pub fn load(spec: &JobSpec, job: Option<&JobDir>) -> Result<Box<dyn Task>, ddpjob_seam::DataError> {
    let cx = DataContext::of(spec, job.map(|j| j.root.as_path()));
    Registry::current().open_dataset(&spec.data, &cx)
}
