//! The worker process (`ddpjob worker`, spawned by the launcher, never typed by users): reads
//! its torchrun-style environment, meets the others through the store, waits for the data,
//! joins the ring and trains. Rank 0 also writes the job directory.

mod environment;
pub mod failure;

pub use environment::{WorkerEnv, env};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use thiserror::Error;

use crate::checkpoint::{self, CheckpointError};
use crate::config::{self, ConfigError, JobSpec};
use crate::data::DataError;
use crate::fault::Fault;
use crate::jobdir::{JobDir, JobDirError};
use crate::models;
use crate::progress::{self, Logged, Reporter};
use crate::task::{self, Task};
use crate::train::{Ending, Hooks, Leader, TrainError, Trainer};
use ddpjob_comm::heartbeat::{self, Beacon, Heartbeat};
use ddpjob_comm::{CommError, Communicator};
use ddpjob_store::{Key, StoreClient, StoreError};

/// How long non-zero local ranks wait for local rank 0 to have the data (it may be
/// downloading); the launcher stops everyone at once if local rank 0 fails.
const DATA_PATIENCE: Duration = Duration::from_secs(3600);

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("`ddpjob worker` is started by `ddpjob run`, not by hand: {0}")]
    Env(String),
    #[error("cannot start the worker's threads ({0}); lower RAYON_NUM_THREADS or free some memory")]
    Threads(rayon::ThreadPoolBuildError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("{0}")]
    Rendezvous(String),
    #[error(transparent)]
    JobDir(#[from] JobDirError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("cannot build the model: {0}")]
    Model(candle_core::Error),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// A collective timed out; the text adds what the heartbeats say about the other ranks.
    #[error("{0}")]
    Hang(String),
    /// Already printed (see [`main`]); carries the original for the exit status.
    #[error("{0}")]
    Announced(Box<WorkerError>),
}

impl WorkerError {
    /// Whether a restart would only meet this error again: what the worker reads and builds
    /// before training (its config, data, model, device, checkpoint), unlike a lost peer, a
    /// hang or a failure during training.
    pub fn repeats_on_restart(&self) -> bool {
        match self {
            WorkerError::Config(_)
            | WorkerError::Data(_)
            | WorkerError::Model(_)
            | WorkerError::Device(_)
            | WorkerError::Checkpoint(_)
            | WorkerError::Train(TrainError::Restore { .. }) => true,
            WorkerError::Announced(inner) => inner.repeats_on_restart(),
            _ => false,
        }
    }
}

/// The `worker` subcommand's body; `Ok(true)` if it stopped on request after a checkpoint.
pub fn run() -> Result<bool, WorkerError> {
    let started = Instant::now();
    // SIGTERM, SIGINT, and SIGUSR1 (Slurm's `--signal=USR1@N` without `B:` reaches every
    // process of the step): finish the current optimizer step, checkpoint, exit.
    crate::signals::install();
    let env = WorkerEnv::from_env()?;
    failure::clear(&env.job_dir, env.rank);
    failure::record_panics(env.job_dir.clone(), env.rank);
    let fault = Fault::from_env(env.rank, env.restart_count).map_err(WorkerError::Env)?;
    let job = JobDir {
        root: env.job_dir.clone(),
    };
    let spec = config::load(&job.job_toml(), &[])?
        .spec
        .for_world_size(env.world_size)
        .map_err(|problem| config::ConfigError::Invalid {
            key: "train.global_batch_size".into(),
            at: config::Origin::Defaulted(job.job_toml()),
            problem,
        })?;
    // Before this process starts any thread: threads inherit the mode of their creator, and
    // glibc fixes its arenas at the first thread's allocation.
    ddpjob_kernels::keep_freed_memory(crate::memory::one_allocator_arena(&spec));
    crate::numerics::set_for_this_thread(spec.train.flush_denormals);
    crate::train::shards::start_global_pool(None).map_err(WorkerError::Threads)?;
    let timeout = Duration::from_secs(spec.distributed.timeout_s);

    let store = StoreClient::connect(&env.master(), &env.token, timeout)?;
    let beacon = Arc::new(Beacon::default());
    let _heartbeat = Heartbeat::start(
        &env.master(),
        &env.token,
        env.rank,
        beacon.clone(),
        heartbeat::interval_for(timeout),
    )
    .map_err(|e| WorkerError::Rendezvous(format!("cannot start heartbeats: {e}")))?;
    rendezvous(&store, &env, timeout)?;
    let data = load_data(&store, &env, &spec, &job)?;
    let device = crate::device::open(Some(&env.device))?;
    crate::device::set_matmul_precision(&device, spec.train.precision);
    let hooks = Hooks {
        vote_every: crate::train::vote_every(&device),
        stop: crate::signals::stop_flag(),
        fault,
        beacon: beacon.clone(),
        trace_samples: std::env::var_os(env::TRACE_SAMPLES).map(|_| {
            job.logs_dir()
                .join(format!("samples-rank-{}.txt", env.rank))
        }),
        // Every rank (sharded parameters are gathered for it); rank 0 writes.
        trace_weights: std::env::var_os(env::TRACE_WEIGHTS)
            .map(|_| job.logs_dir().join(crate::train::WEIGHT_DIGESTS)),
    };

    let comm = connect(&store, &env, &spec, &device, beacon, timeout)?;
    // The error is printed while the ring is still open, so this rank's own failure is on
    // record before its neighbours notice the closed connections and fail in turn.
    train(
        &env,
        &spec,
        &job,
        data.as_ref(),
        comm.as_ref(),
        &device,
        hooks,
        started,
    )
    .map_err(|e| {
        let e = explain_timeout(&store, &env, timeout, e);
        announce(Some(&env), &e);
        WorkerError::Announced(Box::new(e))
    })
}

/// This rank's collectives: NCCL for GPU workers (unless `backend = "tcp"`), the tcp ring
/// between CPU workers, nothing to connect for a single one unless its collectives are to run
/// anyway (`distributed.collectives = "always"`: NCCL on a GPU, the identity on the CPU; the
/// trainer then goes through its buckets and broadcasts as a multi-rank job does). The
/// backend is built by name from the rendezvous (`ddpjob_comm::connect`).
fn connect(
    store: &StoreClient,
    env: &WorkerEnv,
    spec: &JobSpec,
    device: &Device,
    beacon: Arc<Beacon>,
    timeout: Duration,
) -> Result<Box<dyn Communicator>, WorkerError> {
    let always = spec.distributed.always_collectives;
    let placement = ddpjob_comm::Placement {
        gpu: device.is_cuda(),
        world_size: env.world_size,
        always,
    };
    let name = ddpjob_comm::choose(spec.distributed.backend.name(), placement);
    let rendezvous = ddpjob_comm::Rendezvous {
        store,
        token: &env.token,
        rank: env.rank,
        world_size: env.world_size,
        local_world_size: env.local_world_size,
        attempt: env.restart_count,
        timeout,
        beacon,
    };
    let options = ddpjob_comm::Options {
        device,
        always,
        tree: spec.distributed.world_size_invariant,
        on_nccl_failure: Box::new(nccl_failure(env.clone(), timeout)),
    };
    Ok(ddpjob_comm::connect(name, &rendezvous, options)?)
}

/// What the NCCL watchdog reports when a collective hangs or fails, before it aborts the
/// communicator (which may block) and ends this worker, whose main thread may be blocked in a
/// GPU synchronisation: which collective and, from the heartbeats, who never arrived, as the
/// failure record the launcher reads.
fn nccl_failure(
    env: WorkerEnv,
    timeout: Duration,
) -> impl FnOnce(&ddpjob_comm::watchdog::Verdict) + Send + 'static {
    move |verdict| {
        let mut message = verdict.describe(env.rank, timeout);
        if let Some(seq) = verdict.hung_seq()
            && let Ok(store) =
                StoreClient::connect(&env.master(), &env.token, Duration::from_secs(5))
        {
            let arrivals = heartbeat::diagnose_in(&store, env.world_size, seq, timeout);
            message += &format!("; ranks that {arrivals}");
        }
        failure::write(
            &env.job_dir,
            &failure::FailureRecord {
                rank: env.rank,
                kind: failure::FailureKind::Error,
                message: message.clone(),
            },
        );
        errln!("error: {message}");
    }
}

/// A collective that timed out gets what the heartbeats say: who never arrived, and where.
fn explain_timeout(
    store: &StoreClient,
    env: &WorkerEnv,
    timeout: Duration,
    error: WorkerError,
) -> WorkerError {
    let seq = match &error {
        WorkerError::Comm(CommError::Timeout { seq, .. })
        | WorkerError::Train(TrainError::Comm(CommError::Timeout { seq, .. })) => *seq,
        _ => return error,
    };
    let arrivals = heartbeat::diagnose_in(store, env.world_size, seq, timeout);
    WorkerError::Hang(format!("{error}; ranks that {arrivals}"))
}

/// Exit status of a failed worker: 2 if it was started by hand, 3 if it only failed because a
/// peer went away (the launcher then blames the peer), 1 otherwise.
pub const EXIT_PEER_LOST: u8 = 3;
/// Exit status of a worker that stopped on request (SIGTERM) after its checkpoint.
pub const EXIT_STOPPED: u8 = 4;

/// The `worker` subcommand: runs, prints its error once (rank 0 also into its log), exits.
pub fn main() -> u8 {
    let error = match run() {
        Ok(false) => return 0,
        Ok(true) => return EXIT_STOPPED,
        Err(WorkerError::Announced(e)) => *e,
        Err(e) => {
            announce(WorkerEnv::from_env().ok().as_ref(), &e);
            e
        }
    };
    let peer_lost = |c: &CommError| matches!(c, CommError::PeerLost { .. });
    match &error {
        WorkerError::Env(_) => 2,
        WorkerError::Comm(c) | WorkerError::Train(TrainError::Comm(c)) if peer_lost(c) => {
            EXIT_PEER_LOST
        }
        _ => 1,
    }
}

/// Prints a worker's error with its rank; rank 0's stderr is the terminal, so it also goes
/// into rank 0's log for the launcher's report.
fn announce(env: Option<&WorkerEnv>, error: &WorkerError) {
    let text = match env {
        Some(env) => format!("error: rank {}: {error}", env.rank),
        None => format!("error: {error}"),
    };
    errln!("{text}");
    if let Some(env) = env {
        let kind = match error.repeats_on_restart() {
            true => failure::FailureKind::Setup,
            false => failure::FailureKind::Error,
        };
        let record = failure::FailureRecord {
            rank: env.rank,
            kind,
            message: error.to_string(),
        };
        failure::write(&env.job_dir, &record);
    }
    if let Some(env) = env.filter(|env| env.rank == 0) {
        let log = log_path(&env.job_dir, 0);
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(log) {
            let _ = writeln!(f, "{text}");
        }
    }
}

/// The nodes of `ranks` (in order, each once).
fn nodes_of(ranks: &[usize], env: &WorkerEnv) -> Vec<usize> {
    let mut nodes: Vec<usize> = ranks.iter().map(|r| r / env.local_world_size).collect();
    nodes.dedup();
    nodes
}

fn stop_requested() -> bool {
    crate::signals::stop_flag().load(std::sync::atomic::Ordering::SeqCst)
}

/// Registers this rank and waits for every other; a timeout names the ranks (and nodes) missing.
fn rendezvous(store: &StoreClient, env: &WorkerEnv, timeout: Duration) -> Result<(), WorkerError> {
    store.set(
        &Key::Registered { rank: env.rank }.to_string(),
        format!("pid {} node {}", std::process::id(), env.node_rank).as_bytes(),
    )?;
    let keys: Vec<String> = (0..env.world_size)
        .map(|rank| Key::Registered { rank }.to_string())
        .collect();
    // In slices, so a stop signal (Ctrl-C on a node waiting for the others) ends the wait,
    // and rank 0 says what it waits for (and a launcher refused meanwhile) as it happens.
    let started = std::time::Instant::now();
    // One node's own workers starting slowly is no wait for nodes.
    let several_nodes = env.world_size > env.local_world_size;
    let (mut said_waiting, mut said_refused) = (env.rank != 0 || !several_nodes, env.rank != 0);
    let waited = loop {
        let left = timeout.saturating_sub(started.elapsed());
        match store.wait(&keys, left.min(Duration::from_secs(1))) {
            Err(e @ ddpjob_store::StoreError::Timeout { .. })
                if !left.is_zero() && !stop_requested() =>
            {
                let missing = e.missing_ranks(ddpjob_store::REGISTERED_PREFIX);
                let mut nodes = nodes_of(&missing, env);
                nodes.retain(|&n| n != env.node_rank);
                if !said_waiting && !nodes.is_empty() {
                    said_waiting = true;
                    outln!(
                        "waiting for node(s) {nodes:?} to join (up to {} s, \
                         distributed.timeout_s; Ctrl-C stops)",
                        timeout.as_secs()
                    );
                }
                if !said_refused && let Ok(Some(host)) = store.get(&Key::Refused.to_string()) {
                    said_refused = true;
                    errln!(
                        "warning: a launcher on {} was refused: it runs another config, job \
                         name, --nnodes or --nproc-per-node than this node (its job token \
                         differs); still waiting for the right one",
                        String::from_utf8_lossy(&host)
                    );
                }
            }
            done => break done,
        }
    };
    waited.map_err(|e| {
        let missing = e.missing_ranks(ddpjob_store::REGISTERED_PREFIX);
        if missing.is_empty() {
            return WorkerError::Store(e);
        }
        let nodes = nodes_of(&missing, env);
        let refused = match store.get(&Key::Refused.to_string()) {
            Ok(Some(host)) => format!(
                "; a launcher on {} was refused: it runs another config, job name, --nnodes \
                 or --nproc-per-node than node 0 (its job token differs)",
                String::from_utf8_lossy(&host)
            ),
            _ => String::new(),
        };
        if stop_requested() {
            return WorkerError::Rendezvous(format!(
                "stopped by a signal while ranks {missing:?} (nodes {nodes:?}) had not joined \
                 yet; nothing trained"
            ));
        }
        WorkerError::Rendezvous(format!(
            "ranks {missing:?} (nodes {nodes:?}) did not join within {} s \
             (distributed.timeout_s){refused}; start `ddpjob run` on every node with the same \
             config, --nnodes and --master-addr/--master-port, each with its own --node-rank",
            timeout.as_secs()
        ))
    })
}

/// Local rank 0 reads (and if needed downloads) the data; the other local ranks wait for it on
/// the store, then read the same files.
fn load_data(
    store: &StoreClient,
    env: &WorkerEnv,
    spec: &JobSpec,
    job: &JobDir,
) -> Result<Box<dyn Task>, WorkerError> {
    let key = Key::DataReady {
        node: env.node_rank,
    }
    .to_string();
    if env.local_rank == 0 {
        let loaded = task::load(spec, Some(job));
        let note = match &loaded {
            Ok(_) => "ok".to_string(),
            Err(e) => format!("error: {e}"),
        };
        store.set(&key, note.as_bytes())?;
        return Ok(loaded?);
    }
    let note = store.wait_get(&key, DATA_PATIENCE)?;
    if note != b"ok" {
        return Err(WorkerError::Rendezvous(format!(
            "local rank 0 could not load the data: {}",
            String::from_utf8_lossy(&note)
        )));
    }
    Ok(task::load(spec, Some(job))?)
}

#[allow(clippy::too_many_arguments)]
fn train(
    env: &WorkerEnv,
    spec: &JobSpec,
    job: &JobDir,
    data: &dyn Task,
    comm: &dyn Communicator,
    device: &Device,
    hooks: Hooks,
    started: Instant,
) -> Result<bool, WorkerError> {
    let device = device.clone();
    let resume = match &env.resume_from {
        Some(dir) => Some(checkpoint::load(dir, &device)?),
        None => None,
    };
    // A checkpoint of what trains only (see `checkpoint::base`) goes over the base, built as
    // a new job builds it; a whole one replaces every weight, so nothing is drawn or read.
    let restoring = resume
        .as_ref()
        .is_some_and(|r| r.position.base_sha256.is_none());
    // Resumed, the adapters LoRA started from are the checkpoint's as trained.
    let model_spec = match &resume {
        Some(_) => spec.model.without_adapter(),
        None => spec.model.clone(),
    };
    let model = models::build(
        &model_spec,
        data.input(),
        spec.seed,
        &device,
        spec.train.precision,
        restoring,
    )
    .map_err(WorkerError::Model)?;
    let wrapping = crate::objective::Wrapping {
        job: Some(&job.root),
        keep: true,
        restoring,
    };
    let (model, objective) = crate::objective::around(model, spec, data, &device, wrapping, comm)
        .map_err(WorkerError::Model)?;
    if spec.train.activation_checkpointing {
        model.checkpoint_activations().map_err(|why| {
            WorkerError::Model(candle_core::Error::Msg(format!(
                "train.activation_checkpointing: model.arch = \"{}\": {why}; set it to \
                 false to train without",
                spec.model.arch()
            )))
        })?;
    }
    if spec.virtual_shards().is_some() && !model.rows_independent() {
        // Its statistics (BatchNorm's) would come from whichever pieces rank 0 computed.
        return Err(WorkerError::Model(candle_core::Error::Msg(format!(
            "distributed.deterministic = \"world-size-invariant\": model.arch = \"{}\" keeps \
             running statistics over its batches (buffers: BatchNorm), which would depend on \
             the pieces each worker computes; use deterministic = \"run\"",
            spec.model.arch()
        ))));
    }
    let leader = env.rank == 0;
    // Rank 0 drives the terminal and mirrors its lines into its log; the others' stdout is
    // their log file already.
    let (display, log_path) = if leader {
        let path = job.logs_dir().join("rank-0.log");
        (progress::for_stdout(), Some(path))
    } else {
        (Box::new(progress::Plain) as Box<dyn Reporter>, None)
    };
    let mut reporter =
        Logged::new(display, log_path.as_deref()).map_err(|cause| JobDirError::Io {
            path: log_path.clone().unwrap_or_default(),
            cause,
        })?;
    reporter.line(&format!(
        "job `{}` rank {}/{} (node {}, local rank {}{}) on {}{}: {} parameters, {} train / {} evaluation samples",
        spec.name,
        env.rank,
        env.world_size,
        env.node_rank,
        env.local_rank,
        match env.restart_count {
            0 => String::new(),
            n => format!(", restart {n}"),
        },
        env.device,
        crate::device::describe_precision(&device, spec.train.precision),
        model.params().element_count(),
        data.train_len(),
        data.eval_len()
    ));
    if device.is_cpu() {
        reporter.line(&crate::numerics::report(spec.train.flush_denormals));
    }
    if let Some(line) = objective {
        reporter.line(&line);
    }
    let params = model.params();
    let frozen = params.frozen_count();
    if frozen > 0 {
        let why = match (spec.model.freeze().is_empty(), spec.model.lora().is_some()) {
            (false, true) => "model.freeze, [model.lora]",
            (false, false) => "model.freeze",
            (true, _) => "[model.lora]",
        };
        reporter.line(&format!(
            "frozen: {frozen} of {} parameter tensors ({why}); {} of {} values train, and only \
             their gradients are averaged",
            params.len(),
            params.trainable_element_count(),
            params.element_count()
        ));
    }
    if let Some(q) = spec.model.quantize() {
        let layers = params.packed().count();
        reporter.line(&format!(
            "base in 4 bits ([model.quantize]): {layers} linear layers, {} values in {} ({}; \
             {} in f32)",
            params.packed_element_count(),
            crate::memory::gb(params.packed_bytes() as u64),
            q.describe(),
            crate::memory::gb(4 * params.packed_element_count() as u64),
        ));
    }
    // Row shards run one per thread on a CPU worker; a GPU worker runs its batch whole.
    let threads = if device.is_cpu() {
        rayon::current_num_threads()
    } else {
        1
    };
    let layout = crate::memory::Layout::of(spec, env.world_size, threads);
    let estimate = crate::memory::estimate(spec, model.as_ref(), layout);
    reporter.line(&format!(
        "memory per worker (estimate): {}",
        estimate.describe()
    ));
    if !comm.skips_collectives() && comm.world_size() == 1 {
        reporter.line(
            "collectives: run at world size 1, through the backend (distributed.collectives = \
             \"always\")",
        );
    }
    let mut trainer = Trainer {
        plan: spec.train_plan(),
        data,
        comm,
        model,
        device,
        reporter: &mut reporter,
        leader: leader.then(|| {
            Leader::new(
                job.clone(),
                spec.checkpoint.keep_last,
                env.world_size,
                env.restart_count,
                spec.logging.tensorboard,
            )
            .declaring(crate::train::declared_metrics(data))
            .drawing_curves(crate::report::curves::draw)
        }),
        started: env.since_launch(started),
        resume,
        hooks,
        base_sha256: None,
        sharded_parameters: None,
    };
    let mut summary = match trainer.run()? {
        Ending::Completed(summary) => *summary,
        Ending::Stopped { step } => {
            errln!("rank {}: stopped after step {step}", env.rank);
            return Ok(true);
        }
    };
    summary.estimated_peak_bytes = estimate.total();
    if let Some(leader) = &trainer.leader {
        let streamed = trainer.streamed_final_weights();
        leader.finish(trainer.model.params(), streamed, &summary)?;
    }
    // Nobody leaves before rank 0's final files are complete.
    comm.barrier()?;
    Ok(false)
}

/// Where a rank's output goes.
pub fn log_path(job_dir: &Path, rank: usize) -> PathBuf {
    job_dir.join("logs").join(format!("rank-{rank}.log"))
}
