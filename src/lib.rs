//! ddpjob: data-parallel training jobs for Candle, driven by TOML job files — what torchrun and
//! DistributedDataParallel do for PyTorch, in one binary.
//!
//! `ddpjob run job.toml` validates the config into a [`config::JobSpec`], creates the job
//! directory ([`jobdir`]), loads the data ([`data`]) and trains ([`train`]) with gradients averaged
//! through a [`comm::Communicator`] once per optimizer step. This version runs one CPU worker
//! (the `local` communicator); the trainer is already written against the communicator seam so
//! multi-process workers plug in without changing the loop.

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod config;
pub mod data;
pub mod jobdir;
pub mod launch;
pub mod models;
pub mod optim;
pub mod progress;
pub mod rng;
pub mod store;
pub mod train;
pub mod worker;
