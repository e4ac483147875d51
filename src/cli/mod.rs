//! The command line: parses arguments (clap), runs the subcommand, prints errors once with their
//! cause chain, and maps failures to exit codes (0 ok, 1 job failed, 2 usage or config error).

mod bench;
mod eval;
mod export;
mod inspect;
mod jobs;
mod output;
mod preview;
mod sample;
mod shell;
mod sync;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};

use crate::worker;
use output::OutputArgs;

#[derive(Debug, Parser)]
#[command(
    name = "ddpjob",
    version,
    about = "Data-parallel training jobs for Candle, from TOML job files"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a job: creates <jobs-dir>/<name>/ and runs it to the end.
    Run(RunArgs),
    /// Continue an unfinished job from its newest good checkpoint (reads jobs/<name>/job.toml).
    Resume(ResumeArgs),
    /// Print the resolved config and derived numbers (global batch, steps); exit 2 on errors.
    Validate(ConfigArgs),
    /// List jobs, most recent first: status, model and data, step, loss, best accuracy,
    /// expectations and a loss sparkline, one line each.
    List(ListArgs),
    /// One job in full: status, config digest, progress, best and last metrics, checkpoints,
    /// expectation results and a loss sparkline.
    Show(ShowArgs),
    /// Every config key with its type, default and meaning (those under PREFIX, e.g. `train`).
    Keys {
        /// A section or key: `train`, `model.arch`.
        prefix: Option<String>,
    },
    /// The first training examples exactly as the trainer sees them, before packing: the
    /// decoded text with the trained tokens highlighted, or (--json) Hugging Face's
    /// input_ids and labels (-100 where not trained).
    Preview(preview::PreviewArgs),
    /// Generate text with a trained language-model job's weights (gpt, llama), streamed as it
    /// is generated.
    Sample(sample::SampleArgs),
    /// Validation loss and perplexity (a classifier's loss and accuracy) of a job's weights
    /// or a Hugging Face model directory, scored as a run's evaluation scores them.
    Eval(eval::EvalArgs),
    /// Write a job's weights as a Hugging Face model directory (`--hf DIR`) that
    /// `transformers` loads: config.json, model.safetensors and the tokenizer.
    Export(export::ExportArgs),
    /// Run a job on several world sizes with the same global batch (train.batch_size) and
    /// compare every step's weights; exit 1 naming the first step and tensor that differ.
    Verify(verify::VerifyArgs),
    /// Upload a job to an MLflow tracking server after it ran (offline, or while the server was
    /// down): its params, every metric by step, artifacts and status, as the live run has
    /// them; the job's run is continued, so nothing is sent twice.
    Sync(sync::SyncArgs),
    /// Print a shell completion script: `ddpjob completions bash > /etc/bash_completion.d/ddpjob`.
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), or write one per subcommand into DIR.
    Man {
        /// Write ddpjob.1 and ddpjob-<command>.1 here instead of printing ddpjob.1.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Measure this machine: collective bandwidth between worker processes, training step speed.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// A worker process; started by `run` with the torchrun environment, not by hand.
    #[command(hide = true)]
    Worker,
    /// A benchmark worker; started by `bench`, not by hand.
    #[command(hide = true)]
    BenchWorker {
        #[arg(long)]
        sizes: String,
        #[arg(long, default_value = "ring")]
        algorithm: String,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Time the all-reduce `run` uses (the tcp ring between CPU worker processes, or NCCL
    /// between GPUs), per size: time, algorithm bandwidth and bus bandwidth as nccl-tests
    /// defines them.
    Allreduce {
        /// Worker processes (at least 2); on GPUs, one per GPU.
        #[arg(long, default_value_t = 2, value_name = "N")]
        nproc_per_node: usize,
        /// `cpu` (tcp ring), `cuda` (NCCL, one GPU per worker; `--features cuda` builds), or
        /// `auto`: GPUs when this build and the driver show enough of them.
        #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "cuda"])]
        device: String,
        /// Buffer sizes in floats (K = 10^3, M = 10^6, G = 10^9).
        #[arg(long, default_value = "1M,10M,100M")]
        sizes: String,
        /// `ring`: the tcp ring (or NCCL) every job uses; `tree`: the tree-ordered all-reduce
        /// of world-size-invariant training (recursive halving between partner processes;
        /// CPU workers, a power-of-two count).
        #[arg(long, default_value = "ring", value_parser = ["ring", "tree"])]
        algorithm: String,
        /// Print the results as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Time the training step (forward, backward, optimizer) of a job file's model and batch
    /// in this process, data loading excluded: samples/s and where the time goes.
    Step {
        /// The job file (TOML) whose model, batch, accumulation and optimizer to time.
        #[arg(long)]
        config: PathBuf,
        /// Override a config key: --set model.arch=mlp (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Timed optimizer steps.
        #[arg(long, default_value_t = 300)]
        steps: usize,
        /// Untimed steps first.
        #[arg(long, default_value_t = 20)]
        warmup: usize,
        /// Threads (default: every core, as a single worker of `run` gets).
        #[arg(long)]
        threads: Option<usize>,
        /// Skip the matrix-product peak measured after the steps (its products would otherwise
        /// be in a profiler's trace, e.g. ncu or nsys, beside the step's kernels).
        #[arg(long)]
        no_peak: bool,
        /// Print the result as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
struct ConfigArgs {
    /// The job file (TOML).
    config: PathBuf,
    /// Job name (default: `name` in the file, else the file's stem).
    #[arg(long)]
    name: Option<String>,
    /// Override a config key, typed by the schema: --set train.lr=0.02 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Workers on this node: "auto" or a number (same as distributed.nproc_per_node).
    #[arg(long, value_name = "N")]
    nproc_per_node: Option<String>,
}

impl ConfigArgs {
    /// The job's name when its config cannot be read: --name, else the file's stem.
    fn fallback_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            self.config
                .file_stem()
                .map_or("job".into(), |s| s.to_string_lossy().into_owned())
        })
    }

    fn overrides(&self) -> Vec<String> {
        let mut all = self.set.clone();
        if let Some(name) = &self.name {
            all.push(crate::config::flag_override("--name", name));
        }
        if let Some(n) = &self.nproc_per_node {
            all.push(crate::config::flag_override("--nproc-per-node", n));
        }
        all
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// Number of nodes (machines) in the job; run the same command on each (default: from
    /// Slurm under srun, from PET_NNODES or the pod-level WORLD_SIZE under a PyTorchJob, else 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    nnodes: Option<u16>,
    /// This node's index, 0..nnodes; node 0 hosts the rendezvous store (default: SLURM_NODEID,
    /// PET_NODE_RANK or the pod-level RANK, else 0).
    #[arg(long, value_name = "I")]
    node_rank: Option<u16>,
    /// Address of node 0 that every node can reach (needed with --nnodes > 1).
    #[arg(long, value_name = "ADDR")]
    master_addr: Option<String>,
    /// Port of node 0's store (default: a free port on one node, 29500 with --nnodes > 1).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// When the job already exists: `never` (an error; a job is never overwritten) or `auto`
    /// (continue it when its config is the same, leave it when finished, refuse it when the
    /// config differs). Default: `auto` in a job Slurm requeued (SLURM_RESTART_COUNT > 0).
    #[arg(long, value_name = "WHEN", value_parser = ["never", "auto"])]
    resume: Option<String>,
    #[command(flatten)]
    output: OutputArgs,
}

#[derive(Debug, Args)]
struct ResumeArgs {
    /// The job to resume (default: the most recently updated unfinished job that no launcher
    /// is running).
    name: Option<String>,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// Workers for the rest of the job: "auto" or a number, as for `run` (default: the
    /// checkpoint's world size, which resumes exactly); another number re-shards the rest of
    /// the epoch.
    #[arg(long, value_name = "N")]
    nproc_per_node: Option<String>,
    /// When no checkpoint is usable, train again from the start instead of failing.
    #[arg(long)]
    from_scratch: bool,
    #[command(flatten)]
    output: OutputArgs,
}

#[derive(Debug, Args)]
struct ListArgs {
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// Print the jobs as a JSON array (one object per job, as `show --json` prints it).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct ShowArgs {
    /// The job's name (its directory under --jobs-dir).
    name: String,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// Print the job as one JSON object: status, progress, best evaluation, checkpoints and
    /// summary.json.
    #[arg(long)]
    json: bool,
}

/// Entry point used by `main.rs`: the command line with ddpjob's own models and datasets.
pub fn main() -> ExitCode {
    main_with(crate::registry::Registry::builtin())
}

/// The whole command line (`run`, `resume`, `validate`, `list`, `show`, `sample`, `bench`, ...)
/// for a binary whose models and datasets are `registry`'s: what a user's own trainer's
/// `main` calls. Workers re-execute the same binary, so they build from the same registry.
///
/// ```no_run
/// use ddpjob::{ExitCode, Registry};
///
/// fn main() -> ExitCode {
///     ddpjob::cli::main_with(Registry::builtin())
/// }
/// ```
pub fn main_with(registry: crate::registry::Registry) -> ExitCode {
    if registry.install().is_err() {
        errln!(
            "error: a registry was already in use when ddpjob::cli::main_with was called \
             (Registry::current or install ran first); call main_with first in main"
        );
        return ExitCode::from(1);
    }
    let started = Instant::now();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let code = dispatch(cli.command, started);
    // A GPU command may have started compiling kernels on a thread of its own.
    crate::models::finish_compiling_gpu_kernels();
    code
}

/// Runs one command; its exit code.
fn dispatch(command: Command, started: Instant) -> ExitCode {
    let result = match command {
        Command::Run(args) => jobs::run(args, started),
        Command::Resume(args) => jobs::resume(args, started),
        Command::Validate(args) => jobs::validate(&args),
        Command::List(args) => inspect::list(&args.jobs_dir, args.json),
        Command::Show(args) => inspect::show(&args.jobs_dir, &args.name, args.json),
        Command::Preview(args) => preview::preview(&args),
        Command::Sample(args) => sample::sample(&args),
        Command::Export(args) => export::export(&args),
        Command::Eval(args) => eval::eval(&args),
        Command::Verify(args) => verify::verify(&args),
        Command::Sync(args) => sync::sync(&args),
        Command::Keys { prefix } => keys(prefix.as_deref()),
        Command::Completions { shell } => shell::completions(shell),
        Command::Man { dir } => shell::man(dir.as_deref()),
        Command::Worker => return ExitCode::from(worker::main()),
        Command::Bench(BenchCommand::Allreduce {
            nproc_per_node,
            device,
            sizes,
            algorithm,
            json,
        }) => bench::bench_allreduce(nproc_per_node, &device, &sizes, &algorithm, json),
        Command::Bench(BenchCommand::Step {
            config,
            set,
            steps,
            warmup,
            threads,
            no_peak,
            json,
        }) => bench::bench_step(&config, &set, (steps, warmup, threads, !no_peak), json),
        Command::BenchWorker { sizes, algorithm } => crate::bench::parse_sizes(&sizes)
            .and_then(|s| crate::bench::worker(&s, algorithm == "tree"))
            .map_err(|e| (1, e.into())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, err)) => {
            errln!("error: {err:#}");
            ExitCode::from(code)
        }
    }
}

type CliResult = Result<(), (u8, anyhow::Error)>;

/// The job `name` under `jobs_dir`, or a usage error (exit 2) saying where to look.
fn existing_job(
    jobs_dir: &std::path::Path,
    name: &str,
) -> Result<crate::jobdir::JobDir, (u8, anyhow::Error)> {
    let root = jobs_dir.join(name);
    if !root.join("job.toml").is_file() {
        return Err((
            2,
            anyhow::anyhow!(
                "no job `{name}` in `{}`; `ddpjob list{}` shows the jobs there",
                jobs_dir.display(),
                crate::jobdir::jobs_dir_option(jobs_dir)
            ),
        ));
    }
    Ok(crate::jobdir::JobDir { root })
}

/// `ddpjob keys [PREFIX]`.
fn keys(prefix: Option<&str>) -> CliResult {
    match crate::config::schema::reference(prefix, crate::registry::Registry::current()) {
        Some(text) => {
            out!("{text}");
            Ok(())
        }
        None => Err((
            2,
            anyhow::anyhow!(
                "no config key is `{}` or under it; `ddpjob keys` lists them all",
                prefix.unwrap_or_default()
            ),
        )),
    }
}
