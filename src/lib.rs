//! ddpjob: data-parallel training jobs for Candle, driven by TOML job files — what torchrun and
//! DistributedDataParallel do for PyTorch, in one binary.
//!
//! `ddpjob run job.toml` is the launcher ([`launch`]): it validates the config into a
//! [`config::JobSpec`], creates the job directory ([`jobdir`]), hosts the rendezvous [`store`]
//! and spawns one [`worker`] process per slot. Each worker loads the data ([`data`]) and trains
//! ([`train`]) with gradients averaged through a [`comm::Communicator`] once per optimizer step:
//! `local` for one worker, the `tcp` ring between CPU worker processes.

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod config;
pub mod data;
pub mod device;
pub mod fault;
pub mod generate;
pub mod heartbeat;
pub mod jobdir;
pub mod kernels;
pub mod launch;
pub mod models;
pub mod numerics;
pub mod optim;
pub mod progress;
pub mod registry;
pub mod report;
pub mod rng;
pub mod store;
pub mod task;
pub mod train;
pub mod worker;

pub use std::process::ExitCode;

pub use models::{Mode, Model, ParamStore, Params};
pub use registry::{BuildError, DataContext, ModelContext, Registry};
pub use task::{BatchSource, ModelInput, Task};
