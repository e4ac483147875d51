//! `ddpjob export NAME --hf DIR`: a job's weights as a Hugging Face model directory that
//! `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads, with the job's tokenizer.

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use clap::{Args, ValueEnum};

use super::CliResult;
use crate::config;
use crate::data::vocab::Vocab;
use crate::generate::{SampleError, weights_path};
use crate::hf::{self, ExportDtype};
use crate::jobdir::JobDir;

#[derive(Debug, Args)]
pub(super) struct ExportArgs {
    /// The job's name (its directory under --jobs-dir).
    name: String,
    /// Write a Hugging Face model directory here (config.json, model.safetensors, tokenizer).
    #[arg(long, value_name = "DIR")]
    hf: PathBuf,
    /// Which weights: best, latest, step-N (default: the final weights, else the newest
    /// checkpoint).
    #[arg(long, value_name = "WHICH")]
    checkpoint: Option<String>,
    /// The dtype of the written weights.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
    /// Write into DIR even if it is not empty.
    #[arg(long)]
    force: bool,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

pub(super) fn export(args: &ExportArgs) -> CliResult {
    let job = super::existing_job(&args.jobs_dir, &args.name)?;
    let spec = config::load(&job.job_toml(), &[])
        .map_err(|e| (2, anyhow!(e)))?
        .spec;
    let weights = weights_path(&job, args.checkpoint.as_deref()).map_err(|e| match e {
        SampleError::Usage(_) => (2, anyhow!(e)),
        other => (1, anyhow!(other)),
    })?;
    let tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu)
        .map_err(|e| (1, anyhow!("cannot read `{}`: {e}", weights.display())))?;
    let (hf_config, tensors) =
        crate::models::hf_export_parts(&spec.model, tensors).map_err(|e| (2, anyhow!(e)))?;
    let tokenizer = tokenizer_files(&spec, &job);
    let dtype = match args.dtype {
        Dtype::F32 => ExportDtype::F32,
        Dtype::Bf16 => ExportDtype::Bf16,
    };
    hf::export(&args.hf, hf_config, tensors, &tokenizer, dtype, args.force).map_err(|e| {
        let code = if matches!(e, hf::HfError::Invalid(_)) {
            2
        } else {
            1
        };
        (code, anyhow!(e))
    })?;
    println!(
        "exported `{}` to `{}`{}",
        weights.display(),
        args.hf.display(),
        if tokenizer.is_empty() {
            " (no tokenizer: the job's vocabulary is ddpjob's own char/byte one, which \
             transformers cannot load)"
        } else {
            ""
        }
    );
    Ok(())
}

/// The job's `tokenizer.json` and the files that go with it in its model directory.
fn tokenizer_files(spec: &config::JobSpec, job: &JobDir) -> Vec<PathBuf> {
    let data = crate::registry::Registry::current().data_tokenizer(&spec.data);
    match data {
        Some(path) => {
            let dir = path.parent().unwrap_or(Path::new("."));
            companions(dir, Some(path.clone()))
        }
        // Text in ddpjob's own char or byte vocabulary (kept in the job) has no file to write.
        None if Vocab::path_in(&job.root).is_file() => Vec::new(),
        None => pretrained_dir(spec).map_or_else(Vec::new, |d| companions(&d, None)),
    }
}

fn pretrained_dir(spec: &config::JobSpec) -> Option<PathBuf> {
    spec.model.init_from().map(PathBuf::from)
}

/// `tokenizer` (or `dir/tokenizer.json`) and the tokenizer's companions found in `dir`.
fn companions(dir: &Path, tokenizer: Option<PathBuf>) -> Vec<PathBuf> {
    let main = tokenizer.unwrap_or_else(|| dir.join("tokenizer.json"));
    if !main.is_file() {
        return Vec::new();
    }
    let mut files = vec![main];
    for name in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ] {
        let path = dir.join(name);
        if path.is_file() {
            files.push(path);
        }
    }
    files
}
