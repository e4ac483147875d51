//! `ddpjob run`: validate, refuse to overwrite a job, load the data, create the job directory,
//! train, and record the outcome in `state.json` and `summary.json`. One CPU worker in this
//! version, trained in this process through the `local` communicator.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Device;
use thiserror::Error;

use crate::comm::LocalCommunicator;
use crate::config::{self, ConfigError, JobSpec};
use crate::data::{DataError, Dataset};
use crate::jobdir::{JobDir, JobDirError, JobState, Status, now_unix};
use crate::models;
use crate::progress::{self, Logged, Reporter};
use crate::train::{Leader, Summary, TrainError, Trainer};

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    JobDir(#[from] JobDirError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("job `{name}` failed: {cause}")]
    Train {
        name: String,
        cause: Box<TrainError>,
    },
    #[error("cannot build the model: {0}")]
    Model(candle_core::Error),
}

impl RunError {
    /// 2 for mistakes the user fixes before running (config, name clash), 1 for a failed job.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::Config(_) => 2,
            RunError::JobDir(JobDirError::Io { .. }) => 1,
            RunError::JobDir(_) => 2,
            _ => 1,
        }
    }
}

pub struct RunOptions {
    pub config: PathBuf,
    pub overrides: Vec<String>,
    pub jobs_dir: PathBuf,
    pub started: Instant,
}

/// Runs a job from its config file to the end; returns its summary.
pub fn run(opts: &RunOptions) -> Result<(JobDir, Summary), RunError> {
    let loaded = config::load(&opts.config, &opts.overrides)?;
    let spec = &loaded.spec;
    let job = JobDir::open(&opts.jobs_dir, &spec.name);
    job.ensure_new(&spec.name)?;
    let mut display = progress::for_stdout();
    display.line(&format!("loading {} ...", describe_data(spec)));
    let data = Dataset::load(&spec.data, spec.seed)?;

    job.create(&spec.name)?;
    let header = format!(
        "# Resolved config of job `{}`, frozen by `ddpjob run {}`; resume reads this file.\n\n",
        spec.name,
        opts.config.display()
    );
    job.write_file(
        &job.job_toml(),
        (header + &loaded.resolved_toml()).as_bytes(),
    )?;
    let plan = spec.plan(data.train.len(), 1);
    let mut state = JobState {
        status: Status::Running,
        epoch: 0,
        step: 0,
        total_steps: plan.total_steps,
        world_size: 1,
        updated_unix: now_unix(),
        last_loss: None,
        error: None,
    };
    job.write_state(&state)?;

    let outcome = train_in_process(spec, &data, &job, display, opts.started);
    if let Some(s) = job.read_state() {
        state = s;
    }
    state.updated_unix = now_unix();
    match outcome {
        Ok(summary) => {
            job.write_json(&job.summary_path(), &summary)?;
            state.status = Status::Finished;
            state.epoch = summary.epochs;
            state.step = summary.steps;
            state.last_loss = Some(summary.final_train_loss);
            job.write_state(&state)?;
            Ok((job, summary))
        }
        Err(e) => {
            state.status = Status::Failed;
            state.error = Some(e.to_string());
            // The job's own error matters more than a failure to record it.
            let _ = job.write_state(&state);
            Err(e)
        }
    }
}

fn train_in_process(
    spec: &JobSpec,
    data: &Dataset,
    job: &JobDir,
    display: Box<dyn Reporter>,
    started: Instant,
) -> Result<Summary, RunError> {
    let device = Device::Cpu;
    let comm = LocalCommunicator;
    let model = models::build(
        &spec.model,
        data.train.shape,
        data.classes,
        spec.seed,
        &device,
    )
    .map_err(RunError::Model)?;
    let log_path = job.logs_dir().join("rank-0.log");
    let mut reporter = Logged::new(display, Some(&log_path)).map_err(|cause| JobDirError::Io {
        path: log_path.clone(),
        cause,
    })?;
    reporter.line(&format!(
        "job `{}`: {} parameters, {} train / {} test samples, world size 1",
        spec.name,
        model.params().element_count(),
        data.train.len(),
        data.test.len()
    ));
    let mut trainer = Trainer {
        spec,
        data,
        comm: &comm,
        model,
        device,
        reporter: &mut reporter,
        leader: Some(Leader::new(job.clone(), spec.checkpoint.keep_last, 1)),
        started,
    };
    let fail = |cause| RunError::Train {
        name: spec.name.clone(),
        cause: Box::new(cause),
    };
    let summary = trainer.run().map_err(fail)?;
    save_model(&trainer, &job.model_path()).map_err(fail)?;
    Ok(summary)
}

fn save_model(trainer: &Trainer, path: &Path) -> Result<(), TrainError> {
    let tensors = trainer.model.params().named_tensors();
    let tmp = path.with_extension("safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, path).map_err(|cause| JobDirError::Io {
        path: path.into(),
        cause,
    })?;
    Ok(())
}

fn describe_data(spec: &JobSpec) -> String {
    match &spec.data.dataset {
        config::DatasetKind::Mnist => format!("MNIST (data.root = {})", spec.data.root.display()),
        config::DatasetKind::FashionMnist => {
            format!("Fashion-MNIST (data.root = {})", spec.data.root.display())
        }
        config::DatasetKind::Synthetic(s) => {
            format!("synthetic data ({} train samples)", s.train_samples)
        }
    }
}
