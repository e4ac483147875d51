//! `ddpjob eval MODEL`: validation loss and perplexity (a classifier's loss and accuracy) of a
//! job's weights or a Hugging Face model directory, scored as a run's evaluation scores them.

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use clap::Args;

use super::CliResult;
use crate::evaluate::{self, EvalModel};

#[derive(Debug, Args)]
pub(super) struct EvalArgs {
    /// A job's name (its directory under --jobs-dir) or a Hugging Face model directory.
    model: String,
    /// A job's weights to score: best, latest, step-N (default: the final weights, else the
    /// newest checkpoint).
    #[arg(long, value_name = "WHICH")]
    checkpoint: Option<String>,
    /// Score on this job file's `[data]` (default: the job's own; required for a model
    /// directory unless --set gives data.* keys).
    #[arg(long, value_name = "JOBFILE")]
    data: Option<PathBuf>,
    /// Override a key: --set data.path=other.txt (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Print one JSON object (loss, perplexity, tokens, accuracy, weights).
    #[arg(long)]
    json: bool,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
}

pub(super) fn eval(args: &EvalArgs) -> CliResult {
    // Freed activations stay in the process, as in a worker: without it the kernel zeroed
    // fresh pages for a quarter of a SmolLM2-135M evaluation's time (perf, 2026-11-26).
    ddpjob_kernels::keep_freed_memory(true);
    let model = which_model(args)?;
    let fail = |e: evaluate::EvalError| (e.exit_code(), anyhow!(e));
    let spec = evaluate::spec_for(&model, args.data.as_deref(), &args.set).map_err(fail)?;
    let report = evaluate::run(&model, &spec).map_err(|e| match model_overrides(args, &e) {
        Some(set) => (
            2,
            anyhow!(e).context(format!(
                "{set} changed the model these weights were trained as; score them without it \
                 (the job's own [model])"
            )),
        ),
        None => fail(e),
    })?;
    if args.json {
        outln!("{}", report.json());
    } else {
        outln!("{}", report.describe());
    }
    Ok(())
}

/// The `--set model.…` arguments, when they are why a job's weights do not fit its model.
fn model_overrides(args: &EvalArgs, e: &evaluate::EvalError) -> Option<String> {
    // The weights' names or shapes differ from the model's (a damaged file is not this).
    let weights = matches!(e, evaluate::EvalError::Weights(w)
        if matches!(**w, crate::generate::SampleError::Weights { .. })
            && w.to_string().ends_with(crate::generate::DOES_NOT_FIT));
    let set: Vec<String> = args
        .set
        .iter()
        .filter(|s| s.starts_with("model."))
        .map(|s| format!("--set {s}"))
        .collect();
    (weights && !set.is_empty()).then(|| set.join(" "))
}

/// A job when `--jobs-dir` has one of that name, else a model directory.
fn which_model(args: &EvalArgs) -> Result<EvalModel, (u8, anyhow::Error)> {
    if args.jobs_dir.join(&args.model).join("job.toml").is_file() {
        let job = super::existing_job(&args.jobs_dir, &args.model)?;
        return Ok(EvalModel::Job {
            job,
            checkpoint: args.checkpoint.clone(),
        });
    }
    let dir = Path::new(&args.model);
    // A PEFT adapter directory is scored over its base, as `model.init_from` reads it.
    let adapter = crate::hf::peft::AdapterConfig::is_adapter_dir(dir);
    // A Hub id (`Qwen/Qwen3-0.6B`, no such path here) is read as `model.init_from` reads it:
    // from the Hugging Face cache, downloaded when missing.
    let hub_id = !dir.exists() && ddpjob_storage::hf::hub::looks_like_id(&args.model);
    if dir.join("config.json").is_file() || adapter || hub_id {
        if args.checkpoint.is_some() {
            return Err((
                2,
                anyhow!(
                    "--checkpoint picks a job's weights; `{}` is a model directory",
                    dir.display()
                ),
            ));
        }
        if args.data.is_none() && !args.set.iter().any(|s| s.starts_with("data.")) {
            return Err((
                2,
                anyhow!(
                    "say what to score `{}` on: --data JOBFILE (a job file's [data]) or --set \
                     data.dataset=text --set data.path=FILE",
                    dir.display()
                ),
            ));
        }
        return Ok(EvalModel::Pretrained(dir.to_path_buf()));
    }
    Err((
        2,
        anyhow!(
            "`{}` is neither a job in `{}` (`ddpjob list{}` shows them) nor a Hugging Face \
             model directory (with config.json), PEFT adapter directory (with \
             adapter_config.json) or Hub model id (`org/name`)",
            args.model,
            args.jobs_dir.display(),
            crate::jobdir::jobs_dir_option(&args.jobs_dir)
        ),
    ))
}
