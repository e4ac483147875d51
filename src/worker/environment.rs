//! The worker's environment: torchrun's variables plus ddpjob's, read by a worker and written
//! by whoever spawns one (the launcher, the benchmark), so both sides agree on every name.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::WorkerError;
use crate::jobdir::now_unix_ms;

/// Environment variables the launcher sets (**contract**, named as torchrun names them).
pub mod env {
    pub const RANK: &str = "RANK";
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    pub const NODE_RANK: &str = "NODE_RANK";
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    pub const MASTER_PORT: &str = "MASTER_PORT";
    pub const JOB_DIR: &str = "DDPJOB_JOB_DIR";
    pub const RESTART_COUNT: &str = "DDPJOB_RESTART_COUNT";
    /// The job token for the store and the ring (not a contract: internal to one job).
    pub const TOKEN: &str = "DDPJOB_STORE_TOKEN";
    /// Unix milliseconds when the launcher started, so `wall_s` covers the whole command.
    pub const STARTED_MS: &str = "DDPJOB_STARTED_MS";
    /// The checkpoint directory to continue from (set by `resume` and by restarts).
    pub const RESUME_FROM: &str = "DDPJOB_RESUME_FROM";
    /// Test-only: each rank writes the sample indices of every step to
    /// `logs/samples-rank-<r>.txt`.
    pub const TRACE_SAMPLES: &str = "DDPJOB_TRACE_SAMPLES";
    /// Set by `ddpjob verify`: rank 0 writes every step's weight digests to
    /// `logs/weights.jsonl`.
    pub const TRACE_WEIGHTS: &str = "DDPJOB_TRACE_WEIGHTS";
}

/// A worker's place in the job, read from its environment.
#[derive(Debug, Clone)]
pub struct WorkerEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub job_dir: PathBuf,
    pub restart_count: usize,
    pub token: String,
    pub started_unix_ms: Option<u128>,
    pub resume_from: Option<PathBuf>,
    /// `cpu` or `cuda:<ordinal>` ([`crate::device::ENV`]).
    pub device: String,
}

impl WorkerEnv {
    pub fn from_env() -> Result<Self, WorkerError> {
        fn var(name: &str) -> Result<String, WorkerError> {
            std::env::var(name).map_err(|_| WorkerError::Env(format!("{name} is not set")))
        }
        fn num<T: std::str::FromStr>(name: &str) -> Result<T, WorkerError> {
            let v = var(name)?;
            v.parse()
                .map_err(|_| WorkerError::Env(format!("{name}={v:?} is not a number")))
        }
        let e = WorkerEnv {
            rank: num(env::RANK)?,
            local_rank: num(env::LOCAL_RANK)?,
            world_size: num(env::WORLD_SIZE)?,
            local_world_size: num(env::LOCAL_WORLD_SIZE)?,
            node_rank: num(env::NODE_RANK)?,
            master_addr: var(env::MASTER_ADDR)?,
            master_port: num(env::MASTER_PORT)?,
            job_dir: var(env::JOB_DIR)?.into(),
            restart_count: num(env::RESTART_COUNT).unwrap_or(0),
            token: var(env::TOKEN)?,
            started_unix_ms: std::env::var(env::STARTED_MS)
                .ok()
                .and_then(|v| v.parse().ok()),
            resume_from: std::env::var_os(env::RESUME_FROM).map(PathBuf::from),
            device: std::env::var(crate::device::ENV).unwrap_or_else(|_| "cpu".into()),
        };
        if e.rank >= e.world_size || e.local_rank >= e.local_world_size {
            return Err(WorkerError::Env(format!(
                "RANK {} / WORLD_SIZE {} or LOCAL_RANK {} / LOCAL_WORLD_SIZE {} out of range",
                e.rank, e.world_size, e.local_rank, e.local_world_size
            )));
        }
        Ok(e)
    }

    /// The inverse of [`from_env`](Self::from_env): what a launcher gives a worker it spawns.
    pub fn apply(&self, cmd: &mut Command) {
        cmd.env(env::RANK, self.rank.to_string())
            .env(env::LOCAL_RANK, self.local_rank.to_string())
            .env(env::WORLD_SIZE, self.world_size.to_string())
            .env(env::LOCAL_WORLD_SIZE, self.local_world_size.to_string())
            .env(env::NODE_RANK, self.node_rank.to_string())
            .env(env::MASTER_ADDR, &self.master_addr)
            .env(env::MASTER_PORT, self.master_port.to_string())
            .env(env::JOB_DIR, &self.job_dir)
            .env(env::RESTART_COUNT, self.restart_count.to_string())
            .env(env::TOKEN, &self.token)
            .env(crate::device::ENV, &self.device);
        if let Some(ms) = self.started_unix_ms {
            cmd.env(env::STARTED_MS, ms.to_string());
        }
        match &self.resume_from {
            Some(dir) => cmd.env(env::RESUME_FROM, dir),
            None => cmd.env_remove(env::RESUME_FROM),
        };
    }

    /// The store's address, `MASTER_ADDR:MASTER_PORT`.
    pub fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }

    /// Time since the launcher started (or since this worker started, if unknown).
    pub(super) fn since_launch(&self, fallback: Instant) -> Instant {
        let Some(ms) = self.started_unix_ms else {
            return fallback;
        };
        let ago = Duration::from_millis(now_unix_ms().saturating_sub(ms) as u64);
        Instant::now().checked_sub(ago).unwrap_or(fallback)
    }
}
