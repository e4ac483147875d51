//! The command line: parses arguments (clap), runs the subcommand, prints errors once with their
//! cause chain, and maps failures to exit codes (0 ok, 1 job failed, 2 usage or config error).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};

use crate::bench;
use crate::config::{self, DatasetKind};
use crate::jobdir;
use crate::launch::{self, NodeOptions, ResumeOptions, Resumed, RunOptions};
use crate::worker;

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
    /// List jobs with status, epoch/step and last loss, most recent first.
    List(ListArgs),
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
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Time the all-reduce `run` uses (tcp ring between CPU worker processes), per size:
    /// time, algorithm bandwidth and bus bandwidth as nccl-tests defines them.
    Allreduce {
        /// Worker processes (at least 2).
        #[arg(long, default_value_t = 2, value_name = "N")]
        nproc_per_node: usize,
        /// Buffer sizes in floats (K = 10^3, M = 10^6, G = 10^9).
        #[arg(long, default_value = "1M,10M,100M")]
        sizes: String,
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
    fn overrides(&self) -> Vec<String> {
        let mut all = self.set.clone();
        if let Some(name) = &self.name {
            all.push(format!("name={name}"));
        }
        if let Some(n) = &self.nproc_per_node {
            all.push(format!("distributed.nproc_per_node={n}"));
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
    /// Number of nodes (machines) in the job; run the same command on each.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    nnodes: u16,
    /// This node's index, 0..nnodes; node 0 hosts the rendezvous store.
    #[arg(long, default_value_t = 0, value_name = "I")]
    node_rank: u16,
    /// Address of node 0 that every node can reach (needed with --nnodes > 1).
    #[arg(long, value_name = "ADDR")]
    master_addr: Option<String>,
    /// Port of node 0's store (default: a free port on one node, 29500 with --nnodes > 1).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
}

#[derive(Debug, Args)]
struct ResumeArgs {
    /// The job to resume (default: the most recently updated unfinished job).
    name: Option<String>,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// Workers for the rest of the job (default: the checkpoint's world size, which resumes
    /// exactly); another number re-shards the rest of the epoch.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    nproc_per_node: Option<u16>,
    /// When no checkpoint is usable, train again from the start instead of failing.
    #[arg(long)]
    from_scratch: bool,
}

#[derive(Debug, Args)]
struct ListArgs {
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
}

/// Entry point used by `main.rs`.
pub fn main() -> ExitCode {
    let started = Instant::now();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli.command {
        Command::Run(args) => run(args, started),
        Command::Resume(args) => resume(args, started),
        Command::Validate(args) => validate(&args),
        Command::List(args) => list(&args.jobs_dir),
        Command::Worker => return ExitCode::from(worker::main()),
        Command::Bench(BenchCommand::Allreduce {
            nproc_per_node,
            sizes,
            json,
        }) => bench_allreduce(nproc_per_node, &sizes, json),
        Command::Bench(BenchCommand::Step {
            config,
            set,
            steps,
            warmup,
            threads,
            json,
        }) => bench_step(&config, &set, steps, warmup, threads, json),
        Command::BenchWorker { sizes } => bench::parse_sizes(&sizes)
            .and_then(|s| bench::worker(&s))
            .map_err(|e| (1, e.into())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, err)) => {
            eprintln!("error: {err:#}");
            ExitCode::from(code)
        }
    }
}

type CliResult = Result<(), (u8, anyhow::Error)>;

fn run(args: RunArgs, started: Instant) -> CliResult {
    let opts = RunOptions {
        config: args.config.config.clone(),
        overrides: args.config.overrides(),
        jobs_dir: args.jobs_dir,
        node: NodeOptions {
            nnodes: args.nnodes.into(),
            node_rank: args.node_rank.into(),
            master_addr: args.master_addr,
            master_port: args.master_port,
        },
        started,
    };
    match launch::run(&opts) {
        Ok((job, None)) => {
            println!(
                "node {}: workers finished; node 0 holds the results",
                opts.node.node_rank
            );
            println!("job directory: {}", job.root.display());
            Ok(())
        }
        Ok((job, Some(s))) => {
            print_finished(&job, &s);
            Ok(())
        }
        Err(e) => Err((e.exit_code(), anyhow::Error::new(e))),
    }
}

fn resume(args: ResumeArgs, started: Instant) -> CliResult {
    let opts = ResumeOptions {
        name: args.name,
        jobs_dir: args.jobs_dir,
        nproc_per_node: args.nproc_per_node.map(usize::from),
        from_scratch: args.from_scratch,
        started,
    };
    match launch::resume(&opts) {
        Ok(Resumed::AlreadyFinished(message)) => {
            println!("{message}");
            Ok(())
        }
        Ok(Resumed::Finished(job, s)) => {
            print_finished(&job, &s);
            Ok(())
        }
        Err(e) => Err((e.exit_code(), anyhow::Error::new(e))),
    }
}

fn print_finished(job: &jobdir::JobDir, s: &crate::train::Summary) {
    println!(
        "finished: test accuracy {:.2}%, test loss {:.4}, final train loss {:.4}, {} steps, {:.0} samples/s, {:.1} s",
        s.test_accuracy * 100.0,
        s.test_loss,
        s.final_train_loss,
        s.steps,
        s.train_samples_per_s,
        s.wall_s
    );
    println!("job directory: {}", job.root.display());
}

fn bench_allreduce(nproc: usize, sizes: &str, json: bool) -> CliResult {
    let sizes = bench::parse_sizes(sizes).map_err(bench_failure)?;
    let rows = bench::allreduce(nproc, &sizes).map_err(bench_failure)?;
    if json {
        println!("{}", serde_json::to_string(&rows).unwrap_or_default());
    } else {
        print!("{}", bench::table(nproc, &rows));
    }
    Ok(())
}

/// A benchmark's error with its exit status: 2 for usage, 1 for a failed measurement.
fn bench_failure(e: bench::BenchError) -> (u8, anyhow::Error) {
    let code = if matches!(e, bench::BenchError::Usage(_)) {
        2
    } else {
        1
    };
    (code, anyhow::Error::new(e))
}

fn bench_step(
    config: &Path,
    set: &[String],
    steps: usize,
    warmup: usize,
    threads: Option<usize>,
    json: bool,
) -> CliResult {
    let loaded = config::load(config, set).map_err(|e| (2, e.into()))?;
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let options = bench::StepOptions {
        steps,
        warmup,
        threads,
    };
    let result = bench::step(&loaded.spec, options).map_err(bench_failure)?;
    if json {
        println!("{}", serde_json::to_string(&result).unwrap_or_default());
    } else {
        print!("{}", bench::step_table(&result));
    }
    Ok(())
}

fn validate(args: &ConfigArgs) -> CliResult {
    let loaded = config::load(&args.config, &args.overrides()).map_err(|e| (2, e.into()))?;
    let spec = &loaded.spec;
    let (train_samples, source) = match &spec.data.dataset {
        DatasetKind::Synthetic(s) => (s.train_samples, "synthetic"),
        DatasetKind::Mnist | DatasetKind::FashionMnist => (60_000, "standard split; not read"),
    };
    let world = spec.distributed.nproc_per_node.unwrap_or(1);
    let plan = spec.plan(train_samples, world);
    print!("{}", loaded.resolved_toml());
    println!();
    println!("# derived");
    println!("world_size        = {world}  (CPU: nproc_per_node \"auto\" is 1)");
    println!(
        "global_batch      = {}  (batch_size {} x accumulation {} x world {world})",
        plan.global_batch, spec.train.batch_size, spec.train.accumulation
    );
    println!("train_samples     = {train_samples}  ({source})");
    println!("samples_per_rank  = {}", plan.samples_per_rank);
    println!(
        "steps_per_epoch   = {}  (optimizer steps)",
        plan.steps_per_epoch
    );
    println!("total_steps       = {}", plan.total_steps);
    eprintln!("{}: ok", args.config.display());
    Ok(())
}

fn list(jobs_dir: &Path) -> CliResult {
    let jobs = jobdir::list_jobs(jobs_dir).map_err(|e| {
        (
            1,
            anyhow::anyhow!("cannot read jobs directory `{}`: {e}", jobs_dir.display()),
        )
    })?;
    if jobs.is_empty() {
        println!("no jobs in {}", jobs_dir.display());
        return Ok(());
    }
    println!(
        "{:<24} {:<12} {:>6} {:>14} {:>10}  UPDATED",
        "NAME", "STATUS", "EPOCH", "STEP", "LOSS"
    );
    let now = jobdir::now_unix();
    for (name, s) in jobs {
        let loss = s.last_loss.map_or("-".into(), |l| format!("{l:.4}"));
        let step = format!("{}/{}", s.step, s.total_steps);
        println!(
            "{name:<24} {:<12} {:>6} {step:>14} {loss:>10}  {}",
            s.status.to_string(),
            s.epoch,
            ago(now, s.updated_unix)
        );
    }
    Ok(())
}

fn ago(now: u64, then: u64) -> String {
    let secs = now.saturating_sub(then);
    match secs {
        0..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}
