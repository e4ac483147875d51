//! `ddpjob bench`: measurements users run on their own hardware, in the spirit of nccl-tests —
//! the all-reduce `run` uses, and the training step of a job's model.

mod allreduce;
mod step;

use thiserror::Error;

use ddpjob_comm::CommError;
use ddpjob_store::StoreError;

pub use allreduce::{allreduce, allreduce_on_gpus, parse_sizes, table, tree_on_cpus, worker};
pub use step::{StepOptions, step, step_table};

#[derive(Debug, Error)]
pub enum BenchError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Train(#[from] crate::train::TrainError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("benchmark worker failed: {0}")]
    Worker(String),
    #[error("{what}: {cause}")]
    Io { what: String, cause: std::io::Error },
}
