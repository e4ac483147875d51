//! `ddpjob run`, the launcher (torchrun's agent): validate, refuse to overwrite a job, host the
//! rendezvous store (node 0), make sure the data is on disk, create the job directory, spawn
//! one worker process per slot with the torchrun environment, supervise them, and record the
//! outcome in `state.json`. The launcher never trains.

pub mod supervise;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::config::{self, ConfigError, JobSpec, LoadedConfig};
use crate::data::{DataError, Dataset};
use crate::jobdir::{JobDir, JobDirError, JobState, Status, now_unix, now_unix_ms};
use crate::store::{self, StoreClient, StoreError, StoreServer};
use crate::train::Summary;
use crate::worker::{self, WorkerEnv};

use supervise::{install_signal_handlers, signal_name};

/// torchrun's default rendezvous port for multi-node jobs.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
const JOB_READY_KEY: &str = "job/ready";

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    JobDir(#[from] JobDirError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot start worker {rank}: {cause}")]
    Spawn { rank: usize, cause: std::io::Error },
    #[error("job `{name}` failed: {report}")]
    Failed { name: String, report: String },
    #[error("job `{name}` interrupted by {} (signal {signal}); the workers were stopped", signal_name(*.signal))]
    Interrupted { name: String, signal: i32 },
}

impl RunError {
    /// 2 for what the user fixes before running (config, name clash, flags, a taken port),
    /// 128 + signal for an interrupt, as a shell expects, 1 for a failed job.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Config(_) | RunError::Usage(_) => 2,
            RunError::JobDir(JobDirError::Io { .. }) => 1,
            RunError::JobDir(_) => 2,
            RunError::Store(StoreError::Bind { .. } | StoreError::Refused { .. }) => 2,
            RunError::Interrupted { signal, .. } => 128u8.saturating_add(*signal as u8),
            _ => 1,
        }
    }
}

/// Where this launcher sits among the nodes (torchrun's `--nnodes --node-rank --master-*`).
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

pub struct RunOptions {
    pub config: PathBuf,
    pub overrides: Vec<String>,
    pub jobs_dir: PathBuf,
    pub node: NodeOptions,
    pub started: Instant,
}

/// The checked node layout.
struct Layout {
    nnodes: usize,
    node_rank: usize,
    nproc: usize,
    master_addr: String,
    /// `None`: a free port chosen when the store binds (single-node jobs only).
    master_port: Option<u16>,
}

impl Layout {
    fn new(opts: &NodeOptions, spec: &JobSpec) -> Result<Self, RunError> {
        let nnodes = opts.nnodes.max(1);
        if opts.node_rank >= nnodes {
            return Err(RunError::Usage(format!(
                "--node-rank {} is outside --nnodes {nnodes}; node ranks are 0..{}",
                opts.node_rank,
                nnodes - 1
            )));
        }
        // A single-node store listens on loopback only, whatever --master-addr says.
        let master_addr = match (&opts.master_addr, nnodes) {
            (_, 1) => Ipv4Addr::LOCALHOST.to_string(),
            (Some(a), _) => a.clone(),
            (None, _) => {
                return Err(RunError::Usage(format!(
                    "--nnodes {nnodes} needs --master-addr: the address of node 0, which every \
                     node can reach (and the same --master-port on every node, default {DEFAULT_MASTER_PORT})"
                )));
            }
        };
        let master_port = match (opts.master_port, nnodes) {
            (Some(p), _) => Some(p),
            (None, 1) => None,
            (None, _) => Some(DEFAULT_MASTER_PORT),
        };
        Ok(Layout {
            nnodes,
            node_rank: opts.node_rank,
            // On CPU "auto" is one worker; the cuda build will count GPUs here.
            nproc: spec.distributed.nproc_per_node.unwrap_or(1),
            master_addr,
            master_port,
        })
    }

    fn world_size(&self) -> usize {
        self.nnodes * self.nproc
    }

    /// Single-node jobs get a fresh random token; nodes of one job derive the same one from
    /// the resolved config, so a node started with another config or name is refused.
    fn token(&self, loaded: &LoadedConfig) -> String {
        if self.nnodes == 1 {
            return store::random_token();
        }
        let mut h = Sha256::new();
        h.update(loaded.resolved_toml().as_bytes());
        h.update(format!("nnodes={} nproc={}", self.nnodes, self.nproc).as_bytes());
        crate::data::download::hex(&h.finalize())[..32].to_string()
    }
}

/// Runs a job from its config file to the end; on node 0 returns its summary.
pub fn run(opts: &RunOptions) -> Result<(JobDir, Option<Summary>), RunError> {
    let loaded = config::load(&opts.config, &opts.overrides)?;
    let spec = &loaded.spec;
    let layout = Layout::new(&opts.node, spec)?;
    let token = layout.token(&loaded);
    let job = JobDir::open(&opts.jobs_dir, &spec.name);
    // Node 0 binds the store before anything is created, so a taken port costs nothing.
    if layout.node_rank == 0 {
        job.ensure_new(&spec.name)?;
    }
    let (_store, client, port) = meet(&layout, &token, spec)?;

    Dataset::ensure_present(&spec.data)?;
    let state = if layout.node_rank == 0 {
        let state = create_job(&job, &loaded, opts, &layout)?;
        client.set(JOB_READY_KEY, b"1")?;
        Some(state)
    } else {
        let patience = Duration::from_secs(spec.distributed.timeout_s);
        client
            .wait(&[JOB_READY_KEY.to_string()], patience)
            .map_err(|e| match e {
                StoreError::Timeout { .. } => RunError::Failed {
                    name: spec.name.clone(),
                    report: format!(
                        "node 0 did not finish preparing it (data download, job directory) \
                         within {} s (distributed.timeout_s); see node 0's output",
                        patience.as_secs()
                    ),
                },
                other => other.into(),
            })?;
        join_job(&job, &loaded, opts)?;
        None
    };

    // From here on, Ctrl-C stops the workers in order instead of killing the launcher.
    install_signal_handlers();
    let outcome = spawn_and_supervise(&job, &layout, &token, port, opts);
    drop(client);
    let Some(mut state) = state else {
        return outcome.map(|()| (job, None));
    };
    if let Some(s) = job.read_state() {
        state = s;
    }
    state.updated_unix = now_unix();
    let result = outcome.and_then(|()| finish_summary(&job, opts.started, spec));
    match result {
        Ok(summary) => {
            state.status = Status::Finished;
            state.epoch = summary.epochs;
            state.step = summary.steps;
            state.last_loss = Some(summary.final_train_loss);
            job.write_state(&state)?;
            Ok((job, Some(summary)))
        }
        Err(e) => {
            state.status = match e {
                RunError::Interrupted { .. } => Status::Interrupted,
                _ => Status::Failed,
            };
            state.error = Some(e.to_string());
            // The job's own error matters more than a failure to record it.
            let _ = job.write_state(&state);
            Err(e)
        }
    }
}

/// Node 0 hosts the store (loopback and a free port for single-node jobs) and connects to it;
/// other nodes connect to node 0's. Returns the server (kept alive by the caller), a client,
/// and the store's port.
fn meet(
    layout: &Layout,
    token: &str,
    spec: &JobSpec,
) -> Result<(Option<StoreServer>, StoreClient, u16), RunError> {
    if layout.node_rank == 0 {
        let ip = if layout.nnodes == 1 {
            Ipv4Addr::LOCALHOST
        } else {
            Ipv4Addr::UNSPECIFIED
        };
        let server = StoreServer::bind(
            SocketAddr::from((ip, layout.master_port.unwrap_or(0))),
            token,
        )?;
        let port = server.addr().port();
        let client =
            StoreClient::connect(&format!("127.0.0.1:{port}"), token, Duration::from_secs(10))?;
        return Ok((Some(server), client, port));
    }
    let port = layout.master_port.unwrap_or(DEFAULT_MASTER_PORT);
    let addr = format!("{}:{port}", layout.master_addr);
    println!("node {}: joining node 0 at {addr} ...", layout.node_rank);
    let patience = Duration::from_secs(spec.distributed.timeout_s);
    let client = StoreClient::connect(&addr, token, patience)?;
    Ok((None, client, port))
}

/// Node 0: the job directory, the frozen config and the first `state.json`.
fn create_job(
    job: &JobDir,
    loaded: &LoadedConfig,
    opts: &RunOptions,
    layout: &Layout,
) -> Result<JobState, RunError> {
    let spec = &loaded.spec;
    job.create(&spec.name)?;
    write_job_toml(job, loaded, opts)?;
    // Rank 0 fills in total_steps once it has read the data.
    let state = JobState::running(layout.world_size(), 0);
    job.write_state(&state)?;
    Ok(state)
}

/// Nodes > 0: their own job directory (or node 0's, on a shared file system) for their logs.
fn join_job(job: &JobDir, loaded: &LoadedConfig, opts: &RunOptions) -> Result<(), RunError> {
    let logs = job.logs_dir();
    std::fs::create_dir_all(&logs).map_err(|cause| JobDirError::Io { path: logs, cause })?;
    // Always rewritten: a job.toml left by an earlier run must not configure these workers
    // (on a shared file system this is node 0's file, with the same resolved config).
    write_job_toml(job, loaded, opts)
}

fn write_job_toml(job: &JobDir, loaded: &LoadedConfig, opts: &RunOptions) -> Result<(), RunError> {
    let header = format!(
        "# Resolved config of job `{}`, frozen by `ddpjob run {}`; resume reads this file.\n\n",
        loaded.spec.name,
        opts.config.display()
    );
    job.write_file(
        &job.job_toml(),
        (header + &loaded.resolved_toml()).as_bytes(),
    )?;
    Ok(())
}

/// Threads per worker: the node's cores split evenly (as torchrun sets OMP_NUM_THREADS).
fn threads_per_worker(nproc: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nproc).max(1)
}

fn spawn_and_supervise(
    job: &JobDir,
    layout: &Layout,
    token: &str,
    port: u16,
    opts: &RunOptions,
) -> Result<(), RunError> {
    let exe = std::env::current_exe().map_err(|cause| RunError::Spawn { rank: 0, cause })?;
    let threads = threads_per_worker(layout.nproc).to_string();
    let started_ms = now_unix_ms().saturating_sub(opts.started.elapsed().as_millis());
    let job_dir = std::path::absolute(&job.root).unwrap_or_else(|_| job.root.clone());
    let name = job
        .root
        .file_name()
        .map_or("job".into(), |n| n.to_string_lossy().into_owned());
    let mut workers = Vec::new();
    for local_rank in 0..layout.nproc {
        let rank = layout.node_rank * layout.nproc + local_rank;
        let mut cmd = Command::new(&exe);
        cmd.arg("worker");
        WorkerEnv {
            rank,
            local_rank,
            world_size: layout.world_size(),
            local_world_size: layout.nproc,
            node_rank: layout.node_rank,
            master_addr: layout.master_addr.clone(),
            master_port: port,
            job_dir: job_dir.clone(),
            restart_count: 0,
            token: token.to_string(),
            started_unix_ms: Some(started_ms),
        }
        .apply(&mut cmd);
        for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(var).is_none() {
                cmd.env(var, &threads);
            }
        }
        let log = worker::log_path(&job_dir, rank);
        let spawned = supervise::spawn(cmd, rank, &log, rank == 0);
        match spawned {
            Ok(w) => workers.push(w),
            Err(cause) => {
                supervise::stop(&mut workers, false);
                return Err(RunError::Spawn { rank, cause });
            }
        }
    }
    match supervise::supervise(&mut workers) {
        supervise::Outcome::Finished => Ok(()),
        supervise::Outcome::Failed { report } => Err(RunError::Failed { name, report }),
        supervise::Outcome::Interrupted { signal } => Err(RunError::Interrupted { name, signal }),
    }
}

/// Reads rank 0's `summary.json` and sets `wall_s` to the whole command's time.
fn finish_summary(job: &JobDir, started: Instant, spec: &JobSpec) -> Result<Summary, RunError> {
    let path = job.summary_path();
    let summary: Option<Summary> = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let Some(mut summary) = summary else {
        return Err(RunError::Failed {
            name: spec.name.clone(),
            report: format!(
                "every worker exited successfully but rank 0 left no readable `{}`",
                path.display()
            ),
        });
    };
    summary.wall_s = started.elapsed().as_secs_f64();
    job.write_json(&path, &summary)?;
    Ok(summary)
}
