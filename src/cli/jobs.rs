//! `run`, `resume` and `validate`: the commands that read a job file or a job directory and
//! train (or only check) it.

use std::time::Instant;

use anyhow::anyhow;

use super::output::{Done, Ending, Reporting};
use super::{CliResult, ConfigArgs, ResumeArgs, RunArgs};
use crate::config::{self, Expectation};
use crate::jobdir::JobDir;
use crate::launch::auto::ResumeMode;
use crate::launch::cluster::{self, NodeFlags, SchedulerEnv};
use crate::launch::{self, Ended, ResumeOptions, Resumed, RunOptions};

pub(super) fn run(args: RunArgs, started: Instant) -> CliResult {
    let loaded = config::load(&args.config.config, &args.config.overrides());
    // The name and [expect] for the reports; a config error is reported like any failure.
    let (name, expect) = match &loaded {
        Ok(l) => (l.spec.name.clone(), l.spec.expect.clone()),
        Err(_) => (args.config.fallback_name(), Vec::new()),
    };
    let reporting = Reporting::start(&args.output, name, expect, started)?;
    let loaded = match loaded {
        Ok(loaded) => loaded,
        Err(e) => return reporting.finish(Err((2, anyhow::Error::new(e)))),
    };
    loaded.print_notes();
    let scheduler = SchedulerEnv::from_process();
    let flags = NodeFlags {
        nnodes: args.nnodes.map(usize::from),
        node_rank: args.node_rank.map(usize::from),
        master_addr: args.master_addr,
        master_port: args.master_port,
    };
    let node = match cluster::resolve(&flags, &scheduler) {
        Ok(resolution) => {
            for note in &resolution.notes {
                errln!("note: {note}");
            }
            resolution.node
        }
        Err(e) => return reporting.finish(Err((2, anyhow!(e)))),
    };
    let mode = match (args.resume.as_deref(), scheduler.slurm_requeued()) {
        (Some("auto"), _) => ResumeMode::Auto,
        (Some(_), _) => ResumeMode::Never,
        (None, Some(n)) => {
            errln!("note: --resume auto: Slurm requeued this job (SLURM_RESTART_COUNT={n})");
            ResumeMode::Auto
        }
        (None, None) => ResumeMode::Never,
    };
    let opts = RunOptions {
        config: args.config.config.clone(),
        loaded,
        jobs_dir: args.jobs_dir,
        node,
        resume: mode,
        started,
    };
    let ending: Ending = match launch::run(&opts) {
        Ok(Ended::AlreadyFinished(job, message)) => already_finished(job, message),
        Ok(Ended::Finished(job, summary)) => Ok(Done {
            note: summary.is_none().then(|| {
                format!(
                    "node {}: workers finished; node 0 holds the results\njob directory: {}",
                    opts.node.node_rank,
                    job.root.display()
                )
            }),
            job,
            summary: summary.map(|s| *s),
        }),
        Err(e) => {
            let code = e.exit_code();
            let warned = matches!(&e, launch::RunError::Interrupted { signal, .. } if *signal == libc::SIGUSR1);
            let mut error = anyhow::Error::new(e);
            // Slurm's time-limit warning on node 0: ask Slurm for another allocation.
            let requeued = (warned && opts.node.node_rank == 0)
                .then(|| cluster::requeue(&scheduler))
                .flatten();
            if let Some(said) = requeued {
                let job = JobDir::open(&opts.jobs_dir, &opts.loaded.spec.name);
                if let Some(mut state) = job.read_state() {
                    state.error = Some(format!("{error}; {said}"));
                    let _ = job.write_state(&state);
                }
                error = error.context(said);
            }
            Err((code, error))
        }
    };
    reporting.finish(ending)
}

pub(super) fn resume(args: ResumeArgs, started: Instant) -> CliResult {
    let mut opts = ResumeOptions {
        name: args.name,
        jobs_dir: args.jobs_dir,
        nproc_per_node: args.nproc_per_node.clone(),
        from_scratch: args.from_scratch,
        started,
    };
    // Resolved once: `resume` then continues exactly the job the reports are about.
    if let Ok(target) = launch::resume_target(&opts) {
        opts.name = Some(target);
    }
    let name = opts.name.clone().unwrap_or_else(|| "resume".into());
    let job = JobDir::open(&opts.jobs_dir, &name);
    let expect: Vec<Expectation> = config::load(&job.job_toml(), &[])
        .map(|l| l.spec.expect)
        .unwrap_or_default();
    let reporting = Reporting::start(&args.output, name, expect, started)?;
    reporting.finish(resumed(launch::resume(&opts), job))
}

/// How a resume (by `resume`, or `run --resume auto`) of `job` ended.
fn resumed(result: Result<Resumed, launch::RunError>, job: JobDir) -> Ending {
    match result {
        Ok(Resumed::AlreadyFinished(message)) => already_finished(job, message),
        Ok(Resumed::Finished(job, summary)) => Ok(Done {
            job,
            summary: Some(*summary),
            note: None,
        }),
        Err(e) => Err((e.exit_code(), anyhow::Error::new(e))),
    }
}

/// A finished job left as it is, with its summary for the reports.
fn already_finished(job: JobDir, message: String) -> Ending {
    Ok(Done {
        summary: std::fs::read(job.summary_path())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok()),
        note: Some(message),
        job,
    })
}

pub(super) fn validate(args: &ConfigArgs) -> CliResult {
    let loaded = config::load(&args.config, &args.overrides()).map_err(|e| (2, anyhow!(e)))?;
    loaded.print_notes();
    let spec = &loaded.spec;
    let counted = crate::registry::Registry::current().train_samples(&spec.data);
    let mut examples = false;
    let (train_samples, source) = match counted {
        Some(found) => found,
        None => match crate::task::load(spec, None) {
            Ok(task) => {
                examples = task.masks_targets();
                (task.train_len(), opened(spec, task.as_ref()))
            }
            Err(e) => return Err((2, anyhow!(e))),
        },
    };
    let frozen = crate::launch::check_freeze(spec).map_err(|e| (2, anyhow!(e)))?;
    // Where `run` would put the workers on this machine, as it would decide it.
    let placement = crate::device::place(&spec.distributed).map_err(|e| (2, anyhow!(e)))?;
    if let Some(notice) = &placement.notice {
        errln!("note: {notice}");
    }
    // Where `run` would sit among the nodes, from the scheduler's variables (no flags here).
    let node = cluster::resolve(&NodeFlags::default(), &SchedulerEnv::from_process())
        .map_err(|e| (2, anyhow!(e)))?;
    for note in &node.notes {
        errln!("note: {note}");
    }
    let nnodes = node.node.nnodes;
    let world = placement.nproc * nnodes;
    let derived = spec.for_world_size(world).map_err(|e| (2, anyhow!(e)))?;
    let spec = &derived;
    let plan = spec.plan(train_samples, world);
    // A count of 0 is data not on disk yet (a download, token files to prepare): said below.
    if let Some(why) = spec
        .no_steps(train_samples, world)
        .filter(|_| train_samples > 0)
    {
        return Err((2, anyhow!("{}: {why}", args.config.display())));
    }
    out!("{}", loaded.resolved_toml());
    outln!();
    match nnodes {
        1 => outln!("# derived (on this machine, one node)"),
        n => outln!(
            "# derived (node {} of {n}, each with this machine's workers; {})",
            node.node.node_rank,
            node.notes.join("; ")
        ),
    }
    let devices: Vec<String> = (0..placement.nproc)
        .map(|r| placement.device_of(r))
        .collect();
    // Runs of the same device as one entry (`cpu x 8`), so a large node reads in one line.
    let mut runs: Vec<(String, usize)> = Vec::new();
    for device in devices {
        match runs.last_mut() {
            Some((last, n)) if *last == device => *n += 1,
            _ => runs.push((device, 1)),
        }
    }
    let devices: Vec<String> = runs
        .into_iter()
        .map(|(device, n)| match n {
            1 => device,
            n => format!("{device} x {n}"),
        })
        .collect();
    outln!(
        "world_size        = {world}  ({nnodes} node(s) x devices: {})",
        devices.join(", ")
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if placement.gpus.is_empty() && placement.nproc > cores {
        outln!(
            "  note: {} CPU workers share this machine's {cores} cores (more workers than \
             cores seldom trains faster)",
            placement.nproc
        );
    }
    let derived_from = match spec.train.global_batch_size {
        Some(_) => ", batch_size from train.global_batch_size",
        None => "",
    };
    outln!(
        "global_batch      = {}  (batch_size {} x accumulation {} x world {world}{derived_from})",
        plan.global_batch,
        spec.train.batch_size,
        spec.train.accumulation
    );
    outln!("train_samples     = {train_samples}  ({source})");
    outln!("samples_per_rank  = {}", plan.samples_per_rank);
    outln!(
        "steps_per_epoch   = {}  (optimizer steps)",
        plan.steps_per_epoch
    );
    outln!("total_steps       = {}", plan.total_steps);
    let early = spec.train.early_stopping;
    if let Some(patience) = early.patience {
        let when = match spec.train.eval_every {
            Some(n) => format!("each epoch's end and every {n} steps"),
            None => "each epoch's end".into(),
        };
        let watched = match early.monitor {
            crate::config::Monitor::Loss => "a lower loss",
            crate::config::Monitor::Accuracy => "a higher accuracy",
        };
        outln!(
            "early_stopping    = after {patience} evaluation(s) in a row without {watched}  \
             (evaluations at {when}; train.early_stopping)"
        );
    }
    if let Some(language) = spec.model.language() {
        outln!(
            "tokens_per_step   = {}{}  (global_batch x block_size {})",
            if examples { "at most " } else { "" },
            plan.global_batch * language.block_size,
            language.block_size
        );
    }
    if let Some(f) = frozen {
        outln!(
            "frozen            = {} of {} parameter tensors  (model.freeze, LoRA)",
            f.frozen,
            f.all
        );
        let layers = match f.adapted.as_slice() {
            [] => None,
            [only] => Some(only.clone()),
            [first, last] => Some(format!("{first}, {last}")),
            [first, .., last] => Some(format!("{first}, ..., {last}")),
        };
        if let Some(layers) = layers {
            outln!(
                "lora_layers       = {}: {layers}  (model.lora.target_modules)",
                f.adapted.len()
            );
        }
    }
    let threads = match placement.device_of(0).as_str() {
        "cpu" => crate::launch::cpu_threads_per_worker(placement.nproc),
        _ => 1,
    };
    match memory_lines(spec, world, threads, &placement) {
        Ok((lines, fits)) => {
            lines.iter().for_each(|l| outln!("{l}"));
            // `run` refuses what does not fit: so does `validate`, after saying why.
            if !fits {
                return Err((
                    2,
                    anyhow!(
                        "{}: its workers do not fit this machine's memory (see above); `run` \
                         would refuse it",
                        args.config.display()
                    ),
                ));
            }
        }
        Err(NotEstimated::Unknown(why)) => outln!("memory_per_worker = not estimated ({why})"),
        // What `run` refuses before the job exists (weights that do not fit the model, ...).
        Err(NotEstimated::Refused(why)) => {
            return Err((2, anyhow!("{}: {why}", args.config.display())));
        }
    }
    errln!("{}: ok", args.config.display());
    Ok(())
}

/// Why `validate` gives no memory estimate.
enum NotEstimated {
    /// The data cannot be read here to size the model's input: said, not an error.
    Unknown(String),
    /// The model cannot be built (its `init_from` weights do not fit it): `run` refuses it.
    Refused(String),
}

/// The memory estimate per worker (see `memory`), what sharding or activation checkpointing
/// would make of it where the job does not use them yet, and whether it fits: each GPU's free
/// memory, or CPU workers this machine's (the flag: whether they fit). Builds the model on the
/// CPU to count its parameters.
fn memory_lines(
    spec: &config::JobSpec,
    world: usize,
    threads: usize,
    placement: &crate::device::Placement,
) -> Result<(Vec<String>, bool), NotEstimated> {
    let gpus = &placement.gpus;
    use crate::memory::{Layout, estimate, fit};
    let input = match crate::registry::Registry::current().data_input(&spec.data) {
        Some(input) => input,
        None => crate::task::load(spec, None)
            .map_err(|e| NotEstimated::Unknown(e.to_string()))?
            .input(),
    };
    let cpu = candle_core::Device::Cpu;
    let precision = spec.train.precision;
    // Blank weights (nothing drawn or loaded; a gpt's or llama's are zero pages, never
    // touched): only the shapes count, and a model too large for this machine must not fill it.
    let model = crate::models::checked_blank(&spec.model, input, spec.seed, &cpu, precision)
        .map_err(|e| NotEstimated::Refused(e.to_string()))?;
    let layout = Layout::of(spec, world, threads);
    let mine = estimate(spec, model.as_ref(), layout);
    // Without the activations, what is known of the rest, said so.
    let total = |e: &crate::memory::Estimate| match e.total() {
        Some(total) => crate::memory::gb(total),
        None => {
            let known = e.weights + e.gradients + e.optimizer + e.runtime;
            format!("{} + activations (not known)", crate::memory::gb(known))
        }
    };
    let mut lines = vec![format!(
        "memory_per_worker = {}  (estimate: {})",
        total(&mine),
        mine.describe()
    )];
    let alternatives = fit::alternatives(spec, model.as_ref(), layout);
    for (setting, other) in &alternatives {
        lines.push(format!("  with {setting}: {}", total(other)));
    }
    let mut fits = true;
    for (gpu, free, verdict) in fit::gpu_verdicts(spec, model.as_ref(), layout, gpus) {
        fits &= verdict.is_ok();
        lines.push(match verdict {
            Ok(()) => format!(
                "  fits GPU {gpu} ({} free; activations not counted)",
                crate::memory::gb(free)
            ),
            Err(why) => format!("  does not fit: {why}"),
        });
    }
    // CPU workers share this machine's memory (`run` refuses them as it does a GPU job).
    if let (true, Some(available)) = (gpus.is_empty(), fit::available_host_memory()) {
        let workers = placement.nproc;
        let verdict = fit::check_host(spec, model.as_ref(), layout, workers, available);
        fits &= verdict.is_ok();
        lines.push(match verdict {
            Ok(()) => format!(
                "  fits this machine ({} available for {workers} CPU worker{})",
                crate::memory::gb(available),
                if workers == 1 { "" } else { "s" }
            ),
            Err(why) => format!("  does not fit: {why}"),
        });
    }
    Ok((lines, fits))
}

/// Where `validate`'s count of training samples comes from, when it opened the data.
fn opened(spec: &config::JobSpec, task: &dyn crate::task::Task) -> String {
    match spec.model.language() {
        // What was truncated or left out is said here, not first in the run's log.
        Some(_) if task.example_counts().is_some_and(|c| c.pairs) => format!(
            "preference pairs, two rows each of up to block_size + 1 tokens; {} for \
             evaluation{}",
            task.eval_len(),
            task.batches(&candle_core::Device::Cpu)
                .ok()
                .and_then(|b| b.note())
                .map_or(String::new(), |note| format!("; {note}")),
        ),
        Some(_) if task.masks_targets() => format!(
            "examples, each up to block_size + 1 tokens; {} for evaluation{}{}",
            task.eval_len(),
            task.batches(&candle_core::Device::Cpu)
                .ok()
                .and_then(|b| b.note())
                .map_or(String::new(), |note| format!("; {note}")),
            // The note above says what was cut or left out; here the tokens trained on.
            task.example_counts().map_or(String::new(), |c| format!(
                "; {} tokens, {} trained ({:.1}%)",
                c.tokens,
                c.trained,
                100.0 * c.trained as f64 / c.tokens.max(1) as f64
            ))
        ),
        Some(_) => format!(
            "windows of block_size + 1 tokens; {} for evaluation",
            task.eval_len()
        ),
        None => format!("{}, opened", spec.data.name()),
    }
}
