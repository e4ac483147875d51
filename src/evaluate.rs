//! `ddpjob eval`: scores a model on an evaluation split outside a run, exactly as a training
//! job's evaluation does (the same windows, `train.eval_batches` limit and batch size, the
//! same `score`), so its figure can be set beside a run's `val loss`. The model is a job's
//! trained weights or a Hugging Face directory; the data is the job's own or another job
//! file's `[data]`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use thiserror::Error;

use crate::config::{self, ConfigError, JobSpec};
use crate::data::DataError;
use crate::generate::{SampleError, load_weights, weights_path};
use crate::jobdir::JobDir;
use crate::train::{EvalResult, EvalThreads, evaluate, shards::ShardPool};
use ddpjob_comm::LocalCommunicator;

#[derive(Debug, Error)]
pub enum EvalError {
    /// Something asked for that cannot be done (exit 2).
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Config(Box<ConfigError>),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Weights(Box<SampleError>),
    #[error(transparent)]
    Train(#[from] crate::train::TrainError),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

impl From<ConfigError> for EvalError {
    fn from(e: ConfigError) -> Self {
        EvalError::Config(Box::new(e))
    }
}

impl From<SampleError> for EvalError {
    fn from(e: SampleError) -> Self {
        EvalError::Weights(Box::new(e))
    }
}

impl EvalError {
    /// 2 for what the user can fix in the command or the files it names, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            EvalError::Usage(_) | EvalError::Config(_) => 2,
            EvalError::Data(DataError::Mismatch(_)) => 2,
            EvalError::Weights(e)
                if matches!(**e, SampleError::Usage(_) | SampleError::Config(_)) =>
            {
                2
            }
            _ => 1,
        }
    }
}

/// The model to score.
pub enum EvalModel {
    /// A job's weights: its final ones, or a checkpoint's (`best`, `latest`, `step-N`).
    Job {
        job: JobDir,
        checkpoint: Option<String>,
    },
    /// A Hugging Face model directory (`config.json`, `model.safetensors`).
    Pretrained(PathBuf),
}

/// What `eval` measured.
#[derive(Debug, Clone)]
pub struct EvalReport {
    pub result: EvalResult,
    /// Where the weights came from.
    pub weights: PathBuf,
    /// Seconds to build the model and load its weights (the data's loading excluded).
    pub load_s: f64,
    /// Seconds the scoring took.
    pub eval_s: f64,
}

impl EvalReport {
    /// e^loss, for a language model.
    pub fn perplexity(&self) -> Option<f64> {
        self.result.perplexity()
    }

    /// One JSON object: `loss`, `accuracy`, every other metric the task declares by name
    /// (`perplexity` for a language model), `tokens` (a language model's) or `samples`; where the weights came from, the seconds
    /// loading them and scoring took, and the tokens (samples) scored per second.
    pub fn json(&self) -> serde_json::Value {
        let r = &self.result;
        let mut line = serde_json::json!({
            "loss": r.loss,
            "accuracy": r.accuracy,
            "weights": self.weights.display().to_string(),
            "load_s": self.load_s,
            "eval_s": self.eval_s,
            "per_s": r.samples as f64 / self.eval_s.max(1e-9),
        });
        // Whatever else the task declares, by name.
        for (name, value) in r.values.iter() {
            line[name] = value.into();
        }
        if self.perplexity().is_some() {
            line["tokens"] = r.samples.into();
        } else {
            line["samples"] = r.samples.into();
        }
        line
    }

    /// The line `eval` prints: the task's metrics, what they were taken over, and the weights.
    pub fn describe(&self) -> String {
        let r = &self.result;
        let unit = if self.perplexity().is_some() {
            "tokens"
        } else {
            "samples"
        };
        format!(
            "{} over {} {unit} ({})",
            r.describe(),
            r.samples,
            self.weights.display()
        )
    }
}

/// The job spec to score with: the model's (a job's `job.toml`, or `[model] init_from` the
/// directory), its `[data]` (and evaluation batch keys) replaced by `data_from`'s when given,
/// `overrides` applied last.
pub fn spec_for(
    model: &EvalModel,
    data_from: Option<&Path>,
    overrides: &[String],
) -> Result<JobSpec, EvalError> {
    let (path, mut doc) = match model {
        EvalModel::Job { job, .. } => (job.job_toml(), read_table(&job.job_toml())?),
        EvalModel::Pretrained(dir) => {
            let mut model = toml::Table::new();
            model.insert("init_from".into(), dir.display().to_string().into());
            let mut doc = toml::Table::new();
            doc.insert("model".into(), model.into());
            (dir.join("config.json"), doc)
        }
    };
    if let Some(file) = data_from {
        let other = read_table(file)?;
        if let Some(data) = other.get("data") {
            doc.insert("data".into(), data.clone());
        }
        let train = doc
            .entry("train")
            .or_insert_with(|| toml::Table::new().into());
        if let (Some(train), Some(theirs)) = (
            train.as_table_mut(),
            other.get("train").and_then(toml::Value::as_table),
        ) {
            for key in ["eval_batch_size", "eval_batches"] {
                if let Some(v) = theirs.get(key) {
                    train.insert(key.into(), v.clone());
                }
            }
        }
        // A pretrained model scores the windows the job trains on.
        let block = other.get("model").and_then(|m| m.get("block_size"));
        if let (EvalModel::Pretrained(_), Some(block)) = (model, block)
            && let Some(m) = doc.get_mut("model").and_then(toml::Value::as_table_mut)
        {
            m.insert("block_size".into(), block.clone());
        }
    }
    let text = toml::to_string(&doc).map_err(|e| EvalError::Usage(e.to_string()))?;
    // The text is not any one file's: messages name the files, not its lines.
    let model_file = match model {
        EvalModel::Pretrained(dir) => dir.display().to_string(),
        EvalModel::Job { .. } => path.display().to_string(),
    };
    let label = match data_from {
        Some(file) => format!("{model_file} with [data] from {}", file.display()),
        None => model_file,
    };
    let origin = data_from.map_or(path, Path::to_path_buf);
    Ok(config::load_composed(&origin, label, text, overrides)?.spec)
}

fn read_table(path: &Path) -> Result<toml::Table, EvalError> {
    let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
        path: path.into(),
        cause,
    })?;
    text.parse::<toml::Table>()
        .map_err(|e| EvalError::Usage(format!("`{}` is not valid TOML: {e}", path.display())))
}

/// Scores `model` on `spec`'s evaluation split in one process, on the device the job's first
/// worker would train on (`distributed.device`: a GPU of a cuda build where there is one,
/// `--set distributed.device=cpu` for the CPU).
pub fn run(model: &EvalModel, spec: &JobSpec) -> Result<EvalReport, EvalError> {
    let job = match model {
        EvalModel::Job { job, .. } => Some(job),
        EvalModel::Pretrained(_) => None,
    };
    let task = crate::task::load(spec, job)?;
    let crate::device::OneProcess { device, notice, .. } =
        crate::device::for_one_process(&spec.distributed)
            .map_err(|e| EvalError::Usage(e.to_string()))?;
    if let Some(notice) = notice {
        errln!("note: {notice}");
    }
    crate::device::set_matmul_precision(&device, spec.train.precision);
    let started = Instant::now();
    let weights = match model {
        EvalModel::Job { job, checkpoint } => weights_path(job, checkpoint.as_deref())?,
        EvalModel::Pretrained(dir) => dir.clone(),
    };
    // A job's weights hold its adapters as trained; a PEFT adapter directory's are loaded.
    let model_spec = match job {
        Some(_) => spec.model.without_adapter(),
        None => spec.model.clone(),
    };
    let built = crate::models::build(
        &model_spec,
        task.input(),
        spec.seed,
        &device,
        spec.train.precision,
        job.is_some() && crate::generate::restoring(&weights),
    )?;
    if job.is_some() {
        load_weights(built.params(), &weights)?;
    }
    // A precomputed reference is the job's; one made here is for this evaluation alone (the
    // weights are loaded by now, a LoRA job's base the one it started from).
    let wrapping = crate::objective::Wrapping {
        job: job.map(|j| j.root.as_path()),
        keep: false,
        restoring: false,
    };
    let (built, _) = crate::objective::around(
        built,
        spec,
        task.as_ref(),
        &device,
        wrapping,
        &LocalCommunicator,
    )?;
    let load_s = started.elapsed().as_secs_f64();
    if task.eval_len() == 0 {
        return Err(EvalError::Usage(
            "the evaluation split is empty; give the data a validation split (data.val_path, \
             data.val_fraction)"
                .into(),
        ));
    }
    let batches = task.batches(&device)?;
    let t = &spec.train;
    let started = Instant::now();
    // A world-size-invariant job's metrics as its training logged them: batch by batch.
    let threads = match spec.distributed.world_size_invariant {
        true => EvalThreads::Pieces {
            cpu: device.is_cpu(),
        },
        false => EvalThreads::Rows(ShardPool::for_device(&device)),
    };
    let result = evaluate(
        built.as_ref(),
        task.as_ref(),
        batches.as_ref(),
        &LocalCommunicator,
        (t.eval_batch_size, t.eval_batches),
        threads,
    )?;
    Ok(EvalReport {
        result,
        weights,
        load_s,
        eval_s: started.elapsed().as_secs_f64(),
    })
}
