//! Experiment tracking: a job's run in an MLflow tracking server, as Lightning's loggers,
//! Accelerate's trackers and TRL's `report_to` give one. The run is fed from what the job
//! already writes (`metrics.jsonl`, `state.json`, `summary.json`, `curves.svg`), so the same code
//! follows a job live from its launcher (`live`) and uploads a finished or offline one
//! afterwards (`ddpjob sync`, `run::Tracker::finish`), and the workers never wait on a server.
//! It depends on the job directory's records (`ddpjob-storage`) and nothing of training; the
//! REST calls are `mlflow`'s, MLflow's request limits `batch`'s.

pub mod batch;
pub mod live;
pub mod mlflow;
pub mod run;

pub use live::{Live, Note, Say};
pub use run::{KEPT, Target, Tracker, run_of};
