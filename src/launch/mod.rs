//! `ddpjob run`, the launcher (torchrun's agent): validate, refuse to overwrite a job, host the
//! rendezvous store (node 0), make sure the data is on disk, create the job directory, spawn
//! one worker process per slot with the torchrun environment, supervise them, and record the
//! outcome in `state.json`. The launcher never trains.

pub mod auto;
pub mod cluster;
mod group;
mod nodes;
mod resume;
pub mod supervise;
mod tracking;
pub mod watch;

pub use resume::{ResumeOptions, Resumed, resume, target as resume_target};

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::config::{ConfigError, JobSpec, LoadedConfig};
use crate::data::DataError;
use crate::device::{self, DeviceError, Placement};
use crate::jobdir::{JobDir, JobDirError, JobState, Status, now_unix};
use crate::registry::{DataContext, JobFile, Registry};
use crate::train::Summary;
use ddpjob_store::{self as store, Key, StoreClient, StoreError, StoreServer};

use auto::{Decision, ResumeMode};
use group::Group;
use nodes::{Followed, Nodes, Plan, follow_node0};
pub(crate) use supervise::signal_name;

/// torchrun's default rendezvous port for multi-node jobs.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

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
    Device(#[from] DeviceError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot start worker {rank}: {cause}")]
    Spawn { rank: usize, cause: std::io::Error },
    #[error("job `{name}` failed: {report}")]
    Failed { name: String, report: String },
    #[error("job `{name}` interrupted by {} (signal {signal}); {after}", signal_name(*.signal))]
    Interrupted {
        name: String,
        signal: i32,
        after: String,
    },
    #[error(
        "job `{name}` failed and was given up after {restarts} restart(s) (distributed.max_restarts = {restarts}):\n{failures}\n{report}"
    )]
    GaveUp {
        name: String,
        restarts: usize,
        failures: String,
        report: String,
    },
}

impl RunError {
    /// 2 for what the user fixes before running (config, name clash, flags, a taken port),
    /// 128 + signal for an interrupt, as a shell expects, 1 for a failed job.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Config(_) | RunError::Usage(_) | RunError::Device(_) => 2,
            // The config and its data disagree (a tokenizer larger than the model, text data
            // for an image model): fixed in the job file.
            RunError::Data(DataError::Mismatch(_)) => 2,
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
    /// The job file, named in job.toml's header.
    pub config: PathBuf,
    /// That file, loaded and validated with its `--set` overrides.
    pub loaded: LoadedConfig,
    pub jobs_dir: PathBuf,
    pub node: NodeOptions,
    /// Whether an existing job of this name is continued (`--resume auto`).
    pub resume: ResumeMode,
    pub started: Instant,
}

/// The checked node layout.
struct Layout {
    nnodes: usize,
    node_rank: usize,
    nproc: usize,
    /// This node's workers and their devices.
    placement: Placement,
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
            (Some(0), 2..) => {
                return Err(RunError::Usage(format!(
                    "--master-port 0 (any free port) cannot be found by the other nodes: give \
                     every node the same port of node 0 (default {DEFAULT_MASTER_PORT})"
                )));
            }
            (Some(p), _) => Some(p),
            (None, 1) => None,
            (None, _) => Some(DEFAULT_MASTER_PORT),
        };
        let placement = device::place(&spec.distributed)?;
        if placement.on_gpus() && spec.model.quantize().is_some() {
            return Err(RunError::Usage(
                "[model.quantize]: this node's workers would train on its GPUs \
                 (distributed.device = \"auto\"), and the 4-bit layers run on CPU workers \
                 only in this version (their CUDA kernels are not built yet); set \
                 distributed.device = \"cpu\", or leave [model.quantize] out to train LoRA \
                 over the 16-bit base on the GPU"
                    .into(),
            ));
        }
        if let Some(notice) = &placement.notice {
            errln!("note: {notice}");
        }
        cluster::check_gpus(
            &cluster::SchedulerEnv::from_process(),
            spec.distributed.nproc_per_node,
            placement.on_gpus(),
        )
        .map_err(RunError::Usage)?;
        spec.for_world_size(nnodes * placement.nproc)
            .map_err(RunError::Usage)?;
        Ok(Layout {
            nnodes,
            node_rank: opts.node_rank,
            nproc: placement.nproc,
            placement,
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
        crate::jobdir::hex(&h.finalize())[..32].to_string()
    }
}

/// How `run` ended without an error.
pub enum Ended {
    /// The workers finished; node 0 has the summary.
    Finished(JobDir, Option<Box<Summary>>),
    /// `--resume auto` found the job finished already; the message says so.
    AlreadyFinished(JobDir, String),
}

/// Runs a job from its config file to the end (or, with `--resume auto`, continues it).
pub fn run(opts: &RunOptions) -> Result<Ended, RunError> {
    let spec = &opts.loaded.spec;
    let layout = Layout::new(&opts.node, spec)?;
    let token = layout.token(&opts.loaded);
    let job = JobDir::open(&opts.jobs_dir, &spec.name);
    // Node 0 decides, and binds the store, before anything is created or changed, so a
    // refusal or a taken port costs nothing.
    let decision = match (layout.node_rank, opts.resume) {
        (0, ResumeMode::Never) => {
            job.ensure_new(&spec.name)?;
            Decision::Start
        }
        (0, ResumeMode::Auto) => auto::decide(&opts.jobs_dir, &opts.loaded)?,
        // Other nodes do what node 0 decides.
        _ => Decision::Start,
    };
    if let (Decision::AlreadyFinished(message), 1) = (&decision, layout.nnodes) {
        return Ok(Ended::AlreadyFinished(job, message.clone()));
    }
    if layout.node_rank == 0 {
        // A run asked of a tracker that is not named is refused before anything exists.
        tracking::target(spec, &job.root)?;
    }
    // Held to the end: a continued job is locked before the store binds, a new one once it
    // exists.
    let mut _lock = match decision {
        Decision::Continue(_) => Some(job.lock(&spec.name)?),
        _ => None,
    };
    let (server, client, port) = meet(&layout, &token, spec)?;
    let _claim = NodeClaim {
        client: &client,
        node: layout.node_rank,
    };
    let nodes = (layout.nnodes > 1).then(|| Nodes {
        client: &client,
        node_rank: layout.node_rank,
        nnodes: layout.nnodes,
        patience: Duration::from_secs(spec.distributed.timeout_s),
    });
    let group = |resume_from: Option<PathBuf>, nodes| {
        Group {
            job: &job,
            spec,
            layout: &layout,
            token: &token,
            port,
            started: opts.started,
            server: server.as_ref(),
            client: &client,
            nodes,
        }
        .execute(resume_from)
    };
    if layout.node_rank > 0 {
        let nodes = nodes.expect("several nodes");
        return match follow_node0(&job, opts, &nodes)? {
            Followed::Finished(message) => Ok(Ended::AlreadyFinished(job, message)),
            Followed::Train(from) => {
                group(from, Some(nodes))?;
                Ok(Ended::Finished(job, None))
            }
        };
    }

    let plan = match decision {
        Decision::Start => {
            // The data is found and checked before the job exists, so bad data creates nothing.
            let kept = prepare_data(spec, &job, false)?;
            // A job that would take no step is refused before it exists, where the data says
            // its size without being read (else the workers refuse it; 0 is "not known yet").
            let counted = crate::registry::Registry::current().train_samples(&spec.data);
            let counted = counted.filter(|&(n, _)| n > 0);
            if let Some((n, _)) = counted {
                // The batch each worker takes on this world size (train.global_batch_size's).
                let world = layout.world_size();
                let derived = spec.for_world_size(world).map_err(RunError::Usage)?;
                if let Some(why) = derived.no_steps(n, world) {
                    return Err(RunError::Usage(why));
                }
            }
            // One blank model for the checks; one that cannot be built is refused here.
            let blank = blank_model(spec, spec.train.precision).map_err(RunError::Usage)?;
            if let Some(model) = blank.as_deref() {
                frozen_counts(spec, model).map_err(RunError::Usage)?;
                check_memory(spec, &layout, model).map_err(RunError::Usage)?;
                check_full_sharding(spec, model).map_err(RunError::Usage)?;
            }
            _lock = Some(create_job(&job, opts, &layout, &kept)?);
            Plan::Start
        }
        Decision::Continue(_) => {
            // A job stopped before its first checkpoint starts again from the beginning.
            let choice = resume::choose_checkpoint(&job, &spec.name, true)?;
            resume::fits(spec, &choice, &job)?;
            resume::start_continuing(&job, spec, &choice, layout.world_size())?;
            Plan::Continue {
                from: choice.usable.map(|d| absolute(&d)),
            }
        }
        Decision::AlreadyFinished(message) => {
            let nodes = nodes.expect("several nodes");
            nodes.publish_plan(
                &absolute(&job.root),
                Plan::Finished {
                    message: message.clone(),
                },
            )?;
            if let Err(why) = nodes.await_plan_seen() {
                errln!("warning: job `{}` finished already, but {why}", spec.name);
            }
            return Ok(Ended::AlreadyFinished(job, message));
        }
    };
    let from = match &plan {
        Plan::Continue { from } => from.clone(),
        _ => None,
    };
    if let Some(nodes) = &nodes {
        nodes.publish_plan(&absolute(&job.root), plan)?;
    }
    let summary = tracking::followed(
        &job,
        spec,
        layout.world_size(),
        || group(from, nodes),
        |outcome| record_outcome(&job, spec, opts.started, outcome),
    )?;
    Ok(Ended::Finished(job, Some(Box::new(summary))))
}

/// `path` made absolute (as it is when that fails): what other processes and nodes are told.
fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Node 0: writes the final `state.json` (finished, failed or interrupted) and returns the
/// summary of a finished job.
fn record_outcome(
    job: &JobDir,
    spec: &JobSpec,
    started: Instant,
    outcome: Result<(), RunError>,
) -> Result<Summary, RunError> {
    let mut state = job.read_state().unwrap_or_else(|| JobState::running(0, 0));
    state.updated_unix = now_unix();
    let finished = outcome.and_then(|()| finish_summary(job, started, spec));
    // The last epochs (or a failed job's steps) are in the curves too.
    if let Err(warning) = crate::report::curves::draw(job) {
        errln!("warning: {warning}");
    }
    match finished {
        Ok(summary) => {
            state.status = Status::Finished;
            state.epoch = summary.epochs;
            state.step = summary.steps;
            state.last_loss = Some(summary.final_train_loss);
            state.error = None;
            job.write_state(&state)?;
            Ok(summary)
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

/// A node's claim on its `--node-rank` (see `meet`), given up when its launcher leaves the
/// job, however it leaves: a launcher that failed before its workers joined may be started
/// again while node 0 still waits.
struct NodeClaim<'a> {
    client: &'a StoreClient,
    node: usize,
}

impl Drop for NodeClaim<'_> {
    fn drop(&mut self) {
        if self.node > 0 {
            let joined = Key::NodeJoined { node: self.node };
            let _ = self.client.add(&joined.to_string(), -1);
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
    outln!("node {}: joining node 0 at {addr} ...", layout.node_rank);
    let patience = Duration::from_secs(spec.distributed.timeout_s);
    let client = StoreClient::connect(&addr, token, patience)?;
    // A second launcher given the same --node-rank would take the first one's ranks.
    let joined = Key::NodeJoined {
        node: layout.node_rank,
    };
    if client.add(&joined.to_string(), 1)? > 1 {
        // The refused launcher's count taken back: the running one's stays the only claim.
        let _ = client.add(&joined.to_string(), -1);
        return Err(RunError::Usage(format!(
            "node {} has already joined job `{}` at {addr}: another launcher with --node-rank \
             {} is running it (a duplicated pod or srun task?); give each node's launcher its \
             own --node-rank, 0 to {}",
            layout.node_rank,
            spec.name,
            layout.node_rank,
            layout.nnodes - 1
        )));
    }
    Ok((None, client, port))
}

/// Finds, downloads and checks the job's data in the launcher (see
/// [`crate::registry::DatasetOptions::prepare`]), so bad data creates no job and fails no
/// worker; what the data keeps in the job directory (text data's vocabulary, read from `job`
/// when it has one already).
pub(crate) fn prepare_data(
    spec: &JobSpec,
    job: &JobDir,
    exists: bool,
) -> Result<Vec<JobFile>, RunError> {
    let mut cx = DataContext::of(spec, exists.then_some(job.root.as_path()));
    // Beside where the job is or will be, so what the data keeps moves in without a copy.
    cx.staging = job.root.parent().map(Path::to_path_buf);
    Ok(Registry::current().prepare_data(&spec.data, &cx)?)
}

/// Builds the model once on the CPU, without its pretrained weights, to check that every
/// `model.freeze` pattern names parameters (and leaves some to train) and that LoRA's
/// `target_modules` name layers, before anything exists; nothing to do without either. How
/// many tensors are frozen, of how many.
/// Threads a CPU worker of a node with `nproc` workers gets: `RAYON_NUM_THREADS` when set,
/// else its share of the cores.
pub(crate) fn cpu_threads_per_worker(nproc: usize) -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| group::threads_per_worker(nproc))
}

pub(crate) fn check_freeze(spec: &JobSpec) -> Result<Option<Frozen>, String> {
    if !freezes(spec) {
        return Ok(None);
    }
    let precision = crate::config::Precision::F32;
    match blank_model(spec, precision)? {
        Some(model) => frozen_counts(spec, model.as_ref()),
        None => Ok(None),
    }
}

/// Whether the job freezes parameters (`model.freeze`, or LoRA's base model).
fn freezes(spec: &JobSpec) -> bool {
    !spec.model.freeze().is_empty() || spec.model.lora().is_some()
}

/// What a job freezes, for `validate`.
pub(crate) struct Frozen {
    /// Frozen parameter tensors, of all of them.
    pub frozen: usize,
    pub all: usize,
    /// The layers LoRA adapts (`model.lora.target_modules` resolved), in the model's order.
    pub adapted: Vec<String>,
}

/// [`check_freeze`] on a blank `model` of the job: its adapter (if any) loaded into it.
fn frozen_counts(
    spec: &JobSpec,
    model: &dyn crate::models::Model,
) -> Result<Option<Frozen>, String> {
    if !freezes(spec) {
        return Ok(None);
    }
    let params = model.params();
    // A job resumed after its adapter's directory moved: its checkpoint holds the adapters.
    let adapter = spec.model.lora().and_then(|l| l.adapter.as_ref());
    if let Some(dir) = adapter.filter(|d| crate::hf::peft::AdapterConfig::is_adapter_dir(d)) {
        crate::hf::peft::load_adapter(dir, params)
            .map_err(|e| format!("model.lora.adapter: {e}"))?;
    }
    let adapted = params
        .iter()
        .filter_map(|(name, _)| name.strip_suffix(".lora_A.weight").map(String::from))
        .collect();
    Ok(Some(Frozen {
        frozen: params.frozen_count(),
        all: params.len(),
        adapted,
    }))
}

/// The job's model with blank weights on the CPU (zeros, never touched: little memory), for
/// checks before launch; `None` when its input cannot be known yet (data not on disk before a
/// download: the data's own check reports that).
fn blank_model(
    spec: &JobSpec,
    precision: crate::config::Precision,
) -> Result<Option<Box<dyn crate::models::Model>>, String> {
    // The model's input without reading the data where it can be known (a pretrained
    // model's vocabulary).
    let language = spec.model.language();
    let fixed = language.as_ref().and_then(|l| {
        // Else a vocabulary taken from the data is its tokenizer's (instruction data's): known
        // without tokenising the data a second time.
        let vocab_size = l.vocab_size.or_else(|| {
            let path = Registry::current().data_tokenizer(&spec.data)?;
            Some(
                crate::data::hf_tokenizer::HfTokenizer::load(&path)
                    .ok()?
                    .size(),
            )
        })?;
        Some(crate::task::ModelInput::Tokens {
            vocab_size,
            block_size: l.block_size,
        })
    });
    let input = match Registry::current().data_input(&spec.data).or(fixed) {
        Some(input) => input,
        None => match crate::task::load(spec, None) {
            Ok(task) => task.input(),
            Err(_) => return Ok(None),
        },
    };
    let device = candle_core::Device::Cpu;
    crate::models::checked_blank(&spec.model, input, spec.seed, &device, precision)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Refused before anything is created: GPU workers when a worker's memory estimate is more
/// than a GPU's free memory, CPU workers when theirs together are more than the machine's
/// available memory (see `memory::fit`). `model`: the job's, blank.
fn check_memory(
    spec: &JobSpec,
    layout: &Layout,
    model: &dyn crate::models::Model,
) -> Result<(), String> {
    let gpus = &layout.placement.gpus;
    let checked = if gpus.is_empty() {
        let Some(available) = crate::memory::fit::available_host_memory() else {
            return Ok(());
        };
        let workers = layout.placement.nproc;
        let memory =
            crate::memory::Layout::of(spec, layout.world_size(), cpu_threads_per_worker(workers));
        crate::memory::fit::check_host(spec, model, memory, workers, available)
    } else {
        let memory = crate::memory::Layout::of(spec, layout.world_size(), 1);
        crate::memory::fit::check_gpus(spec, model, memory, gpus)
    };
    checked.map_err(|why| format!("{why} (checked before launch; see docs/src/memory.md)"))
}

/// `distributed.sharding = "full"` with a model whose registration does not say whether it has
/// blocks (validation judged those that do): refused before anything is created when the model
/// cannot gather its blocks one at a time.
fn check_full_sharding(spec: &JobSpec, model: &dyn crate::models::Model) -> Result<(), String> {
    use crate::config::Builders as _;
    let declared = crate::registry::Registry::current()
        .has_blocks(spec.model.arch())
        .is_some();
    if spec.distributed.sharding != crate::config::Sharding::Full || declared {
        return Ok(());
    }
    model.shard_parameters().map(drop).map_err(|why| {
        format!(
            "distributed.sharding = \"full\": model.arch = \"{}\" cannot gather its \
             parameters block by block: {why}; use \"gradients\"",
            spec.model.arch()
        )
    })
}

/// Node 0: the job directory, locked at once (so a launcher racing for the name says who has
/// it), the frozen config and the first `state.json`.
fn create_job(
    job: &JobDir,
    opts: &RunOptions,
    layout: &Layout,
    kept: &[JobFile],
) -> Result<crate::jobdir::JobLock, RunError> {
    let spec = &opts.loaded.spec;
    job.create_with(&spec.name, || {
        let lock = job.lock(&spec.name)?;
        write_job_toml(job, opts)?;
        for file in kept {
            keep(job, file)?;
        }
        // What an export ships, as it is now: the base may move or change later.
        crate::hf::job_tokenizer::keep(
            spec,
            Registry::current().data_tokenizer(&spec.data),
            &job.root,
        )
        .map_err(|cause| JobDirError::Io {
            path: job.root.join(crate::hf::job_tokenizer::DIR),
            cause,
        })?;
        // Rank 0 fills in total_steps once it has read the data.
        job.write_state(&JobState::running(layout.world_size(), 0))?;
        Ok(lock)
    })
}

/// Puts a file the data keeps into the job directory.
pub(super) fn keep(job: &JobDir, file: &JobFile) -> Result<(), RunError> {
    let path = job.root.join(&file.name);
    file.keep_at(&path, crate::jobdir::write_atomic)
        .map_err(|cause| JobDirError::Io { path, cause }.into())
}

/// Nodes > 0: their own job directory (or node 0's, on a shared file system) for their logs.
pub(super) fn join_job(job: &JobDir, opts: &RunOptions) -> Result<(), RunError> {
    let logs = job.logs_dir();
    std::fs::create_dir_all(&logs).map_err(|cause| JobDirError::Io { path: logs, cause })?;
    // Always rewritten: a job.toml left by an earlier run must not configure these workers
    // (on a shared file system this is node 0's file, with the same resolved config).
    write_job_toml(job, opts)
}

fn write_job_toml(job: &JobDir, opts: &RunOptions) -> Result<(), RunError> {
    let loaded = &opts.loaded;
    let header = format!(
        "{}{}`, frozen by `ddpjob run {}`; resume reads this file.\n\n",
        crate::config::STORED_JOB_HEADER,
        loaded.spec.name,
        opts.config.display()
    );
    let here = std::env::current_dir().map_err(|cause| JobDirError::Io {
        path: ".".into(),
        cause,
    })?;
    job.write_file(
        &job.job_toml(),
        (header + &loaded.frozen_toml(&here)).as_bytes(),
    )?;
    Ok(())
}

/// Reads rank 0's `summary.json`, sets `wall_s` to the whole command's time and checks
/// `[expect]` against it.
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
    summary.expectations = crate::report::check(&spec.expect, &summary);
    job.write_json(&path, &summary)?;
    Ok(summary)
}
