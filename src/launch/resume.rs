//! `ddpjob resume [NAME]`: continues an unfinished job from its frozen `job.toml` (never the
//! original config file, which may have changed) and its newest checkpoint that verifies.

use std::path::PathBuf;
use std::time::Instant;

use super::group::{Group, rewind_to};

use super::{Layout, NodeOptions, RunError, meet, record_outcome};
use crate::checkpoint;
use crate::config;
use crate::jobdir::{self, JobDir, JobDirError, JobState, Status, now_unix};
use crate::train::Summary;
use ddpjob_store as store;

pub struct ResumeOptions {
    /// `None`: the most recently updated unfinished job.
    pub name: Option<String>,
    pub jobs_dir: PathBuf,
    /// Workers per node, as `distributed.nproc_per_node`: `"auto"` or a count (`--nproc-per-node`);
    /// `None` keeps the checkpoint's world size (bit-identical then).
    pub nproc_per_node: Option<String>,
    /// Start over when no checkpoint is usable, instead of failing.
    pub from_scratch: bool,
    pub started: Instant,
}

pub enum Resumed {
    /// Nothing to do; the message says so.
    AlreadyFinished(String),
    Finished(JobDir, Box<Summary>),
}

/// Finds the job, checks it can be resumed, and runs it to the end.
pub fn resume(opts: &ResumeOptions) -> Result<Resumed, RunError> {
    let name = target(opts)?;
    let job = JobDir::open(&opts.jobs_dir, &name);
    let Some(state) = job.state_or_rebuilt() else {
        return Err(RunError::Usage(if job.root.exists() {
            format!(
                "`{}` has no readable state.json, so it is not a ddpjob job",
                job.root.display()
            )
        } else {
            format!(
                "no job `{name}` in `{}`; `ddpjob list{}` shows the jobs there",
                opts.jobs_dir.display(),
                crate::jobdir::jobs_dir_option(&opts.jobs_dir)
            )
        }));
    };
    if state.status == Status::Finished {
        return Ok(Resumed::AlreadyFinished(format!(
            "job `{name}` already finished ({} steps, final train loss {}); nothing to resume. \
             Its results are in `{}`",
            state.step,
            state.last_loss.map_or("-".into(), |l| format!("{l:.4}")),
            job.root.display()
        )));
    }
    let _lock = job.lock(&name)?;
    let choice = choose_checkpoint(&job, &name, opts.from_scratch)?;
    // Same world size as the checkpoint unless asked otherwise, so a resume is exact.
    let overrides: Vec<String> = match &opts.nproc_per_node {
        Some(n) => vec![config::flag_override("--nproc-per-node", n)],
        None => choice
            .position
            .iter()
            .map(|p| format!("distributed.nproc_per_node={}", p.world_size))
            .collect(),
    };
    let loaded = config::load(&job.job_toml(), &overrides)?;
    let spec = &loaded.spec;
    fits(spec, &choice, &job)?;
    super::tracking::target(spec, &job.root)?;
    let layout = Layout::new(&NodeOptions::default(), spec)?;
    let token = store::random_token();
    let (server, client, port) = meet(&layout, &token, spec)?;
    start_continuing(&job, spec, &choice, layout.world_size())?;

    let group = Group {
        job: &job,
        spec,
        layout: &layout,
        token: &token,
        port,
        started: opts.started,
        server: server.as_ref(),
        client: &client,
        nodes: None,
    };
    let summary = super::tracking::followed(
        &job,
        spec,
        layout.world_size(),
        || group.execute(choice.usable.clone()),
        |outcome| record_outcome(&job, spec, opts.started, outcome),
    )?;
    Ok(Resumed::Finished(job, Box::new(summary)))
}

/// Refuses to continue from `choice` what `job.toml` no longer fits (see [`past_the_end`] and
/// [`other_optimizer`]), before anything of the job changes.
pub(super) fn fits(
    spec: &config::JobSpec,
    choice: &checkpoint::Choice,
    job: &JobDir,
) -> Result<(), RunError> {
    if let (Some(p), Some(dir)) = (&choice.position, &choice.usable) {
        past_the_end(spec, p, job)?;
        other_optimizer(spec, p, dir, job)?;
    }
    Ok(())
}

/// Refuses a checkpoint past the end of the job as `job.toml` now plans it (its epochs or
/// steps lowered by hand): continuing would report more steps done than planned.
fn past_the_end(
    spec: &config::JobSpec,
    p: &checkpoint::TrainPosition,
    job: &JobDir,
) -> Result<(), RunError> {
    let t = &spec.train;
    let past_epochs = p.epoch > t.epochs || (p.epoch == t.epochs && p.step_in_epoch > 0);
    let past_steps = t.max_steps.is_some_and(|m| p.step > m);
    if !(past_epochs || past_steps) {
        return Ok(());
    }
    let plan = match t.max_steps {
        Some(m) if past_steps => format!("train.max_steps = {m}"),
        _ => format!("train.epochs = {}", t.epochs),
    };
    Err(RunError::Usage(format!(
        "the newest checkpoint of job `{}` is at step {} (epoch {}), past the end of the job \
         as `{}` now plans it ({plan}); restore the value it was run with, or start a new job \
         from its weights",
        spec.name,
        p.step,
        p.epoch + 1,
        job.job_toml().display()
    )))
}

/// Refuses a checkpoint whose optimizer state is not the optimizer `job.toml` now names (it
/// was edited): restored, the state would be dropped or wrong, silently.
fn other_optimizer(
    spec: &config::JobSpec,
    p: &checkpoint::TrainPosition,
    dir: &std::path::Path,
    job: &JobDir,
) -> Result<(), RunError> {
    // SAFETY: read-only mapping of a verified checkpoint, read while it lives. One that cannot
    // be read is the worker's to report as it restores it.
    let file = dir.join("optimizer.safetensors");
    let Ok(state) = (unsafe { candle_core::safetensors::MmapedSafetensors::new(&file) }) else {
        return Ok(());
    };
    let names: Vec<String> = state.tensors().into_iter().map(|(n, _)| n).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    match crate::optim::state_mismatch(spec.train.optimizer, &names, p.optimizer_steps) {
        None => Ok(()),
        Some(problem) => Err(RunError::Usage(format!(
            "the newest checkpoint of job `{}` (`{}`) does not fit `{}`: {problem}",
            spec.name,
            dir.display(),
            job.job_toml().display()
        ))),
    }
}

/// The newest checkpoint of job `name` that verifies; none is an error unless `from_scratch`.
pub(super) fn choose_checkpoint(
    job: &JobDir,
    name: &str,
    from_scratch: bool,
) -> Result<checkpoint::Choice, RunError> {
    let checkpoints = job.checkpoints_dir();
    let choice = checkpoint::Checkpoints::of(job)
        .newest_good()
        .map_err(|cause| JobDirError::Io {
            path: checkpoints.clone(),
            cause,
        })?;
    if choice.usable.is_none() && !from_scratch {
        let damaged: Vec<String> = choice
            .skipped
            .iter()
            .map(|(d, why)| format!("`{}`: {why}", d.display()))
            .collect();
        let found = if damaged.is_empty() {
            "it has none".to_string()
        } else {
            format!("every one is damaged ({})", damaged.join("; "))
        };
        return Err(RunError::Usage(format!(
            "job `{name}` has no usable checkpoint in `{}` ({found}); run \
             `{} --from-scratch` to train it again from the start",
            checkpoints.display(),
            job.cli("resume")
        )));
    }
    Ok(choice)
}

/// Checks the job's data still fits it, sets damaged checkpoints aside, rewinds the metrics to
/// `choice` and marks the job running on `world_size` workers.
pub(super) fn start_continuing(
    job: &JobDir,
    spec: &config::JobSpec,
    choice: &checkpoint::Choice,
    world_size: usize,
) -> Result<(), RunError> {
    let name = &spec.name;
    // The data must still be there, and text still encode with the vocabulary the job
    // trained with. What a job from before a file was kept (the record of its data files)
    // is kept from now on.
    for file in super::prepare_data(spec, job, true)? {
        if !job.root.join(&file.name).exists() {
            super::keep(job, &file)?;
        }
    }
    rewind_to(job, choice)?;
    match (&choice.usable, &choice.position) {
        (Some(dir), Some(p)) => outln!(
            "resuming job `{name}` from `{}` (epoch {}, step {}) on {world_size} worker(s)",
            dir.display(),
            p.epoch + 1,
            p.step,
        ),
        _ => outln!("job `{name}`: no usable checkpoint; training again from the start"),
    }
    let mut state = job
        .read_state()
        .unwrap_or_else(|| JobState::running(world_size, 0));
    state.status = Status::Running;
    state.error = None;
    state.world_size = world_size;
    state.updated_unix = now_unix();
    job.write_state(&state)?;
    Ok(())
}

/// The job `resume` continues: the one named, else the most recently updated unfinished one.
pub fn target(opts: &ResumeOptions) -> Result<String, RunError> {
    match &opts.name {
        Some(name) => Ok(name.clone()),
        None => most_recent_unfinished(opts),
    }
}

fn most_recent_unfinished(opts: &ResumeOptions) -> Result<String, RunError> {
    if let Some(what) = jobdir::not_a_directory(&opts.jobs_dir) {
        let dir = opts.jobs_dir.clone();
        return Err(JobDirError::JobsDirIsAFile { dir, what }.into());
    }
    let jobs = jobdir::list_jobs(&opts.jobs_dir).map_err(|cause| JobDirError::Io {
        path: opts.jobs_dir.clone(),
        cause,
    })?;
    // Jobs another launcher is running now are not candidates: they are not stopped. One
    // with a checkpoint comes before newer ones without (which `resume` would refuse).
    let mut running = Vec::new();
    let mut without_checkpoint = Vec::new();
    for (name, state) in jobs {
        if state.status == Status::Finished {
            continue;
        }
        let job = JobDir::open(&opts.jobs_dir, &name);
        match job.running_launcher() {
            Some(pid) => running.push(format!("`{name}` (pid {pid})")),
            None if opts.from_scratch || job.has_checkpoint() => {
                if !without_checkpoint.is_empty() {
                    let newer: Vec<String> = without_checkpoint
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect();
                    errln!(
                        "note: resuming `{name}`, the newest unfinished job with a checkpoint \
                         ({} newer, without one)",
                        newer.join(", ")
                    );
                }
                return Ok(name);
            }
            None => without_checkpoint.push(name),
        }
    }
    // None has one: the newest, whose refusal says how to train it again.
    if let Some(newest) = without_checkpoint.into_iter().next() {
        return Ok(newest);
    }
    let running = match running.is_empty() {
        true => String::new(),
        false => format!(" ({} running now)", running.join(", ")),
    };
    Err(RunError::Usage(format!(
        "no unfinished job in `{}` to resume{running}; `ddpjob list{}` shows the jobs there, \
         `ddpjob resume NAME{}` picks one",
        opts.jobs_dir.display(),
        crate::jobdir::jobs_dir_option(&opts.jobs_dir),
        crate::jobdir::jobs_dir_option(&opts.jobs_dir)
    )))
}
