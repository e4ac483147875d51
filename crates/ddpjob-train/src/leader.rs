//! What only rank 0 does: write metrics, state and checkpoints into the job directory. A separate
//! type with no collectives, so a collective that only rank 0 would call cannot be written here.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::checkpoint::{Checkpointer, Restored, TensorFile, TrainPosition};
use crate::jobdir::record::{Record, TrainTerms};
use crate::jobdir::sink::{JsonlSink, MetricsSink, TensorBoardSink};
use crate::jobdir::{JobDir, JobDirError, JobState, now_unix};
use crate::models::Params;
use crate::task::MetricInfo;

use super::{EvalResult, Summary, TrainError};

pub struct Leader {
    job: JobDir,
    checkpointer: Checkpointer,
    world_size: usize,
    restart_count: usize,
    /// `[logging] tensorboard`: add a TensorBoard sink when training starts.
    tensorboard: bool,
    sinks: Mutex<Vec<Box<dyn MetricsSink>>>,
    /// What the task's evaluations report, kept in `state.json` for `show` and `list`.
    metrics: Vec<MetricInfo>,
    /// Redraws the job's `curves.svg` from its records (the reports' job, not the trainer's).
    curves: Option<DrawCurves>,
}

/// Draws a job's curves from its records; the error is a warning's text.
pub type DrawCurves = fn(&JobDir) -> Result<(), String>;

impl Leader {
    pub fn new(
        job: JobDir,
        keep_last: Option<usize>,
        world_size: usize,
        restart_count: usize,
        tensorboard: bool,
    ) -> Self {
        let checkpointer = Checkpointer::new(job.checkpoints_dir(), keep_last);
        let sinks: Vec<Box<dyn MetricsSink>> = vec![Box::new(JsonlSink::new(job.clone()))];
        Leader {
            job,
            checkpointer,
            world_size,
            restart_count,
            tensorboard,
            sinks: Mutex::new(sinks),
            metrics: Vec::new(),
            curves: None,
        }
    }

    /// The same, redrawing the curves with `draw` at every epoch end.
    pub fn drawing_curves(mut self, draw: DrawCurves) -> Self {
        self.curves = Some(draw);
        self
    }

    /// The same, recording that its task's evaluations report `metrics`.
    pub fn declaring(mut self, metrics: Vec<MetricInfo>) -> Self {
        self.metrics = metrics;
        self
    }

    /// `state.json` of a running job.
    fn running(&self, world_size: usize, total_steps: usize) -> JobState {
        JobState {
            restarts: self.restarts(),
            metrics: self.metrics.clone(),
            ..JobState::running(world_size, total_steps)
        }
    }

    /// Sends `record` to every sink.
    fn record(&self, record: &Record) -> Result<(), TrainError> {
        let mut sinks = self.sinks.lock().unwrap_or_else(|e| e.into_inner());
        for sink in sinks.iter_mut() {
            sink.write(record)?;
        }
        Ok(())
    }

    /// Opens the TensorBoard sink, replaying the (rewound) history into a fresh event file.
    fn start_sinks(&self) -> Result<(), TrainError> {
        if self.tensorboard {
            let sink = TensorBoardSink::start(&self.job)?;
            let mut sinks = self.sinks.lock().unwrap_or_else(|e| e.into_inner());
            sinks.push(Box::new(sink));
        }
        Ok(())
    }

    /// Records the plan in `state.json` as training starts.
    pub fn start(&self, world_size: usize, total_steps: usize) -> Result<(), TrainError> {
        self.start_sinks()?;
        let state = self.running(world_size, total_steps);
        Ok(self.job.write_state(&state)?)
    }

    /// Records a resumed start: `state.json` at the checkpoint's position, and a `resume` line
    /// in `metrics.jsonl` (whose later lines the launcher already dropped).
    pub fn log_resume(
        &self,
        from: &Restored,
        world_size: usize,
        total_steps: usize,
    ) -> Result<(), TrainError> {
        let p = &from.position;
        self.start_sinks()?;
        self.record(&Record::Resume {
            epoch: p.epoch,
            step: p.step,
            checkpoint: from
                .dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned()),
            world_size,
            previous_world_size: p.world_size,
            restart: self.restart_count,
            time: now_unix(),
        })?;
        let state = JobState {
            epoch: p.epoch,
            step: p.step,
            last_loss: p.metrics.last_epoch_loss,
            ..self.running(world_size, total_steps)
        };
        Ok(self.job.write_state(&state)?)
    }

    /// Restarts so far, as the launcher recorded them.
    fn restarts(&self) -> usize {
        self.job.read_state().map_or(0, |s| s.restarts)
    }

    pub fn log_step(
        &self,
        epoch: usize,
        step: usize,
        (loss, lr, samples_per_s): (f64, f64, f64),
        grad_norm: Option<f64>,
        metrics: TrainTerms,
    ) -> Result<(), TrainError> {
        self.record(&Record::Train {
            epoch,
            step,
            loss,
            lr,
            samples_per_s: round(samples_per_s),
            grad_norm,
            metrics,
            time: now_unix(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn log_epoch(
        &self,
        epoch: usize,
        step: usize,
        train_loss: f64,
        lr: f64,
        samples_per_s: f64,
        eval: &EvalResult,
        epoch_train_s: f64,
        total_steps: usize,
    ) -> Result<(), TrainError> {
        self.record(&Record::Epoch {
            epoch,
            step,
            loss: train_loss,
            lr,
            samples_per_s: round(samples_per_s),
            metrics: recorded(&eval.values),
            train_s: epoch_train_s,
            time: now_unix(),
        })?;
        let state = JobState {
            epoch: epoch + 1,
            step,
            last_loss: Some(train_loss),
            ..self.running(self.world_size, total_steps)
        };
        Ok(self.job.write_state(&state)?)
    }

    /// A mid-epoch evaluation (`train.eval_every`).
    pub fn log_eval(&self, epoch: usize, step: usize, eval: &EvalResult) -> Result<(), TrainError> {
        self.record(&Record::Eval {
            epoch,
            step,
            metrics: recorded(&eval.values),
            time: now_unix(),
        })
    }

    /// Replaces `checkpoints/best` with the current weights: `params`' values, or the file
    /// `weights.written` they were streamed into (sharded parameters).
    pub fn save_best(
        &self,
        weights: Weights,
        optimizer: TensorFile,
        position: &TrainPosition,
    ) -> Result<PathBuf, TrainError> {
        let mut held = None;
        let model = weights.file(position, &mut held);
        Ok(self.checkpointer.save_best(model, optimizer, position)?)
    }

    /// Where sharded parameters stream a checkpoint's weights before it takes them (as
    /// [`Leader::staging_path`]).
    pub fn weights_staging_path(&self) -> PathBuf {
        self.job
            .checkpoints_dir()
            .join(format!(".tmp-model-{}.safetensors", std::process::id()))
    }

    /// Where sharded parameters stream the run's final weights (beside `model.safetensors`).
    pub fn final_weights_staging_path(&self) -> PathBuf {
        self.job.model_path().with_extension("safetensors.tmp")
    }

    /// Where a sharded optimizer streams its gathered state before a checkpoint takes it:
    /// beside the checkpoints (the same filesystem, so it is moved, not copied), named as the
    /// temporary files a checkpoint's pruning removes if the job dies meanwhile.
    pub fn staging_path(&self) -> PathBuf {
        self.job
            .checkpoints_dir()
            .join(format!(".tmp-optimizer-{}.safetensors", std::process::id()))
    }

    /// Redraws `curves.svg` with the function it was handed ([`Self::drawing_curves`]); a
    /// failure is only worth a warning (returned as its text).
    pub fn draw_curves(&self) -> Result<(), String> {
        self.curves.map_or(Ok(()), |draw| draw(&self.job))
    }

    pub fn checkpoint(
        &self,
        weights: Weights,
        optimizer: TensorFile,
        position: &TrainPosition,
    ) -> Result<PathBuf, TrainError> {
        let mut held = None;
        let model = weights.file(position, &mut held);
        let dir = self.checkpointer.save(model, optimizer, position)?;
        // state.json follows the checkpoints, so it says where a resume would start.
        if let Some(mut state) = self.job.read_state() {
            state.epoch = position.epoch;
            state.step = position.step;
            state.updated_unix = now_unix();
            self.job.write_state(&state)?;
        }
        Ok(dir)
    }
}

impl Leader {
    /// The end of a successful run: final weights (PyTorch names) and `summary.json`. With
    /// `streamed`, the weights are already in [`Leader::final_weights_staging_path`] (sharded
    /// parameters); else `params`' values are written.
    pub fn finish(
        &self,
        params: &Params,
        streamed: bool,
        summary: &Summary,
    ) -> Result<(), TrainError> {
        let path = self.job.model_path();
        let tmp = self.final_weights_staging_path();
        if !streamed {
            crate::jobdir::save_tensors(&params.named_tensors(), &tmp)?;
        }
        std::fs::rename(&tmp, &path).map_err(|cause| JobDirError::Io {
            path: path.clone(),
            cause,
        })?;
        Ok(self.job.write_json(&self.job.summary_path(), summary)?)
    }
}

/// A model's weights for a file: the parameters' values, or (sharded parameters, whose
/// values are not all held anywhere) the file they were already streamed into.
#[derive(Clone, Copy)]
pub struct Weights<'a> {
    pub params: &'a Params,
    pub written: Option<&'a Path>,
}

impl<'a> Weights<'a> {
    /// What a checkpoint at `position` writes of these weights: the file they were streamed
    /// into, else their tensors (kept alive in `held`).
    fn file<'h>(
        &self,
        position: &TrainPosition,
        held: &'h mut Option<std::collections::HashMap<String, candle_core::Tensor>>,
    ) -> TensorFile<'h>
    where
        'a: 'h,
    {
        match self.written {
            Some(path) => TensorFile::Written(path),
            None => TensorFile::Tensors(held.insert(checkpointed(self.params, position))),
        }
    }
}

/// What a checkpoint at `position` holds of `params`: what trains when the position records a
/// base (see `checkpoint::base`), else everything.
fn checkpointed(
    params: &Params,
    position: &TrainPosition,
) -> std::collections::HashMap<String, candle_core::Tensor> {
    match position.base_sha256 {
        Some(_) => crate::checkpoint::base::checkpointed(params),
        None => params.named_tensors(),
    }
}

/// `x` to four significant digits, and at least one decimal: 48612.3, 312.5, 0.6836 (a large
/// model's samples/s is below 1, where one decimal would say little).
fn round(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let decimals = (4 - x.abs().log10().ceil() as i32).max(1);
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// An evaluation's metrics as a record holds them: `test_loss` and `test_accuracy` first, as
/// every version has written them (a task's own after them, in its order), whatever order the
/// task declared them in (`state.json` keeps that).
fn recorded(values: &crate::task::MetricValues) -> crate::task::MetricValues {
    values.with_first(&["loss", "accuracy"])
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_keep_four_significant_digits_and_at_least_one_decimal() {
        assert_eq!(super::round(48612.34), 48612.3);
        assert_eq!(super::round(312.54), 312.5);
        assert_eq!(super::round(0.683_649), 0.6836);
        assert_eq!(super::round(0.0), 0.0);
        assert!(super::round(f64::NAN).is_nan());
    }

    #[test]
    fn records_keep_loss_and_accuracy_first_whatever_the_declared_order() {
        use crate::task::{EvalSums, MetricValues, classifier_metrics};
        let sums = EvalSums {
            loss: 2.0,
            correct: 3.0,
            targets: 4.0,
            ..EvalSums::default()
        };
        // A classifier declares its accuracy first; its records read as they always have.
        let values = MetricValues::of(&classifier_metrics(), &sums);
        let line = serde_json::to_string(&super::recorded(&values)).unwrap();
        assert_eq!(line, r#"{"test_loss":0.5,"test_accuracy":0.75}"#);
    }
}
