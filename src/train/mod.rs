//! The training loop: epochs of optimizer steps over DistributedSampler shards, gradient
//! accumulation, one gradient average per step through the [`Communicator`], clipping, the
//! schedule, evaluation, metrics and checkpoints. The same code for one worker or many.

mod eval;
mod leader;
mod metrics;
mod resume;
pub mod shards;
pub mod step;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::{Device, Tensor};
use thiserror::Error;

use crate::checkpoint::{self, CheckpointError, MetricState, Restored, TrainPosition};
use crate::comm::{CommError, Communicator, StopVote, broadcast_params};
use crate::config::{JobSpec, OnWriteError, Plan};
use crate::data::{DataError, DistributedSampler};
use crate::fault::Fault;
use crate::heartbeat::Beacon;
use crate::jobdir::JobDirError;
use crate::models::{Mode, Model};
use crate::optim::{Optimizer, Schedule};
use crate::progress::Reporter;
use crate::task::{BatchSource, ModelInput, Task, sample_seed};

pub use eval::{EvalResult, evaluate};
pub use leader::Leader;
pub use metrics::Summary;
use metrics::{LossTally, trace_samples};
pub use resume::Start;
use step::{MicroBatch, StepContext, StepError};

#[derive(Debug, Error)]
pub enum TrainError {
    #[error(
        "training loss became {value} in epoch {epoch}, between optimizer steps {first_step} and {last_step}; \
         lower train.lr, set train.grad_clip_norm, or check the data"
    )]
    NonFinite {
        value: f64,
        epoch: usize,
        first_step: usize,
        last_step: usize,
    },
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    JobDir(#[from] JobDirError),
    #[error(
        "checkpoint `{}` does not fit this job: {problem}; was job.toml edited? resume from \
         another checkpoint or start a new job", dir.display()
    )]
    Restore {
        dir: std::path::PathBuf,
        problem: String,
    },
    #[error("{0}")]
    Injected(String),
}

impl From<StepError> for TrainError {
    fn from(e: StepError) -> Self {
        match e {
            StepError::Tensor(e) => TrainError::Tensor(e),
            StepError::Comm(e) => TrainError::Comm(e),
        }
    }
}

/// Steps between reads of the ranks' stop vote on `device` (each log line, checkpoint and
/// epoch end read it too): every step on the CPU, where reading is free; every 8 on a GPU,
/// where a read waits for every kernel queued so far, so a stop request takes effect within 8
/// steps and 7 steps in 8 queue their kernels without waiting.
pub fn vote_every(device: &Device) -> usize {
    if device.is_cpu() { 1 } else { 8 }
}

/// What a worker can be told from outside the training loop.
pub struct Hooks<'a> {
    /// Steps between reads of the stop vote ([`vote_every`]).
    pub vote_every: usize,
    /// Set (by a signal handler) when the job should stop after the current optimizer step.
    pub stop: &'a AtomicBool,
    /// Test-only fault injection (`DDPJOB_FAULT`).
    pub fault: Option<Fault>,
    /// Where this worker is, for heartbeats.
    pub beacon: Arc<Beacon>,
    /// Test-only (`DDPJOB_TRACE_SAMPLES`): a file to append `epoch step index...` lines to, one
    /// per optimizer step, so tests can check which samples each rank saw.
    pub trace_samples: Option<std::path::PathBuf>,
}

/// How a run ended.
#[derive(Debug)]
pub enum Ending {
    Completed(Summary),
    /// Every rank agreed to stop (preemption); the checkpoint of `step` is on disk.
    Stopped {
        step: usize,
    },
}

pub struct Trainer<'a> {
    pub spec: &'a JobSpec,
    pub data: &'a dyn Task,
    pub comm: &'a dyn Communicator,
    pub model: Box<dyn Model>,
    pub device: Device,
    pub reporter: &'a mut dyn Reporter,
    /// Rank 0 only: the job directory's writer (it has no collectives).
    pub leader: Option<Leader>,
    pub started: Instant,
    /// The checkpoint to continue from.
    pub resume: Option<Restored>,
    pub hooks: Hooks<'a>,
}

/// One epoch's shard of steps, as this run takes it.
struct EpochRun {
    epoch: usize,
    /// Steps of the epoch already done before this run reached it.
    skip: usize,
    /// Steps in the epoch (on this world size, from its start or its re-shard).
    groups: usize,
    /// Samples of the epoch consumed by all ranks so far.
    consumed: usize,
}

impl Trainer<'_> {
    pub fn plan(&self) -> Plan {
        self.spec
            .plan(self.data.train_len(), self.comm.world_size())
    }

    /// Trains to the end of the plan, or until every rank agrees to stop.
    pub fn run(&mut self) -> Result<Ending, TrainError> {
        let spec = self.spec;
        let t = &spec.train;
        let plan = self.plan();
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let position = self.resume.as_ref().map(|r| r.position.clone());
        let train_len = self.data.train_len();
        let start = Start::new(spec, train_len, world, plan.total_steps, position.as_ref());
        let total_steps = start.total_steps;
        let schedule = Schedule::new(t.lr, t.schedule, total_steps);
        let mut optimizer = Optimizer::new(t.optimizer, self.model.params().len());
        if let Some(restored) = self.resume.take() {
            resume::restore(self.model.params(), &mut optimizer, &restored)?;
            let note = start.describe(spec, &restored.position, world);
            self.reporter.line(&format!(
                "{note} (from checkpoint `{}`)",
                restored.dir.display()
            ));
            if let Some(leader) = &self.leader {
                leader.log_resume(&restored, world, total_steps)?;
            }
        } else if let Some(leader) = &self.leader {
            leader.start(world, total_steps)?;
        }
        broadcast_params(self.comm, self.model.params())?;
        let data = self.data;
        let batches = data.batches(&self.device)?;
        let batches = batches.as_ref();
        if let Some(note) = batches.note() {
            self.reporter.line(&note);
        }
        let mut sampler = DistributedSampler::new(train_len, world, rank, spec.seed)
            .with_drop_last(spec.data.drop_last);

        let mut step = start.step;
        let mut metrics = start.metrics.clone();
        let mut last_eval = None;
        let mut epochs_done = start.epoch;
        for epoch in start.epoch..t.epochs {
            if step >= total_steps {
                break;
            }
            sampler.set_epoch(epoch as u64);
            let here = position.is_some() && epoch == start.epoch;
            let indices = if here && start.reshard {
                sampler.indices_after(start.consumed)
            } else {
                sampler.indices()
            };
            let micro: Vec<&[usize]> = indices.chunks(t.batch_size).collect();
            let groups: Vec<&[&[usize]]> = micro.chunks(t.accumulation).collect();
            let mut run = EpochRun {
                epoch,
                skip: if here { start.skip_in_epoch } else { 0 },
                groups: groups.len(),
                consumed: if here { start.consumed } else { 0 },
            };
            if !here {
                metrics.start_epoch();
            }
            let steps_now = groups
                .len()
                .saturating_sub(run.skip)
                .min(total_steps - step);
            self.reporter.epoch_start(epoch, t.epochs, steps_now);
            let mut interval = LossTally::default();
            let mut interval_first_step = step + 1;
            for (i, group) in groups[run.skip..].iter().take(steps_now).enumerate() {
                let started = Instant::now();
                let lr = schedule.lr(step, epoch);
                self.hooks.beacon.set_step(step + 1);
                if let Some(fault) = &self.hooks.fault {
                    fault
                        .before_step(step + 1, self.hooks.stop)
                        .map_err(TrainError::Injected)?;
                }
                if let Some(path) = &self.hooks.trace_samples {
                    trace_samples(path, epoch, step + 1, group)?;
                }
                let vote = self.hooks.stop.load(Ordering::SeqCst);
                let (loss_sum, samples, votes) =
                    self.optimizer_step(batches, &mut optimizer, epoch, group, lr, vote)?;
                step += 1;
                run.consumed += samples * world;
                interval.add(loss_sum, samples, started.elapsed())?;
                let in_epoch = run.skip + i + 1;
                let checkpoint_due =
                    checkpoint::due_after_step(&spec.checkpoint, step) && i + 1 < steps_now;
                let at_log = step % t.log_every == 0 || i + 1 == steps_now || checkpoint_due;
                // Every rank reads the vote after the same steps (the schedule depends on the
                // step alone), so all stop after the same one. A rank's vote stays up once cast.
                let stop = (at_log || step % self.hooks.vote_every.max(1) == 0) && votes.read()?;
                let at_log = at_log || stop;
                let mut status = None;
                if at_log {
                    let (loss, n, secs) = interval.reduce(self.comm)?;
                    if !loss.is_finite() {
                        return Err(TrainError::NonFinite {
                            value: loss,
                            epoch,
                            first_step: interval_first_step,
                            last_step: step,
                        });
                    }
                    metrics.add_interval(loss, n, secs);
                    let rate = n / secs.max(1e-9);
                    let text = format!("loss {loss:.4}  lr {lr:.2e}  {rate:.0} samples/s");
                    self.reporter.interval(&format!(
                        "epoch {}/{} step {step}/{total_steps}  {text}",
                        epoch + 1,
                        t.epochs,
                    ));
                    if let Some(leader) = &self.leader {
                        leader.log_step(epoch, step, loss, lr, rate)?;
                    }
                    status = Some(text);
                    interval_first_step = step + 1;
                }
                self.reporter.step(i + 1, status.as_deref());
                if stop {
                    self.reporter.epoch_end();
                    let position = self.position(&run, in_epoch, step, &optimizer, lr, &metrics);
                    self.save_checkpoint(&optimizer, &position)?;
                    self.reporter.line(&format!(
                        "stopped on request after step {step}; continue with `ddpjob resume`"
                    ));
                    return Ok(Ending::Stopped { step });
                }
                let eval_due = t.eval_every.is_some_and(|n| step % n == 0);
                if eval_due && i + 1 < steps_now {
                    let eval = self.evaluate(batches)?;
                    self.reporter.line(&format!(
                        "step {step}/{total_steps}: {}",
                        self.describe_eval(&eval)
                    ));
                    let position = self.position(&run, in_epoch, step, &optimizer, lr, &metrics);
                    self.record_eval(&eval, &mut metrics, &optimizer, position, true)?;
                }
                if checkpoint_due {
                    let position = self.position(&run, in_epoch, step, &optimizer, lr, &metrics);
                    self.save_checkpoint(&optimizer, &position)?;
                }
            }
            self.reporter.epoch_end();
            let (n, secs) = (metrics.epoch_samples, metrics.epoch_secs);
            let train_loss = metrics.finish_epoch();
            epochs_done = epoch + 1;

            let eval = self.evaluate(batches)?;
            let lr = schedule.lr(step.saturating_sub(1), epoch);
            let rate = n / secs.max(1e-9);
            self.reporter.line(&format!(
                "epoch {}/{} done: train loss {train_loss:.4}, {}, {rate:.0} samples/s, {secs:.1} s",
                epoch + 1,
                t.epochs,
                self.describe_eval(&eval),
            ));
            if let Some(leader) = &self.leader {
                leader.log_epoch(epoch, step, train_loss, lr, rate, &eval, secs, total_steps)?;
                if let Err(warning) = leader.draw_curves() {
                    self.reporter.line(&format!("warning: {warning}"));
                }
            }
            last_eval = Some(eval);
            let done = run.skip + steps_now;
            let at = self.epoch_end_position(&run, done, step, &optimizer, lr, &metrics);
            self.record_eval(&eval, &mut metrics, &optimizer, at, false)?;
            // The last step's mid-epoch checkpoint is taken here, after evaluation, as an epoch one.
            if checkpoint::due_after_epoch(&spec.checkpoint, epoch)
                || checkpoint::due_after_step(&spec.checkpoint, step)
            {
                let position = self.epoch_end_position(&run, done, step, &optimizer, lr, &metrics);
                self.save_checkpoint(&optimizer, &position)?;
            }
        }

        let eval = match last_eval {
            Some(e) => e,
            None => self.evaluate(batches)?,
        };
        let train_s = metrics.train_s;
        let samples_per_s = metrics.total_samples / train_s.max(1e-9);
        let tokens = matches!(data.input(), ModelInput::Tokens { .. });
        Ok(Ending::Completed(Summary {
            best_test_loss: metrics.best_eval.map(|b| b.0),
            best_step: metrics.best_eval.map(|b| b.1),
            train_tokens_per_s: tokens.then(|| samples_per_s * data.targets_per_sample() as f64),
            test_accuracy: eval.accuracy,
            test_loss: eval.loss,
            final_train_loss: metrics.last_epoch_loss.unwrap_or(f64::NAN),
            epochs: epochs_done,
            steps: step,
            train_samples_per_s: samples_per_s,
            wall_s: self.started.elapsed().as_secs_f64(),
            train_s,
            samples: metrics.total_samples as u64,
            world_size: world,
            parameters: self.model.params().element_count(),
            expectations: Vec::new(),
        }))
    }

    /// One optimizer step over the micro-batches of `group` (indices into the training split).
    /// Returns (Σ loss·n, n, whether any rank voted to stop).
    fn optimizer_step(
        &mut self,
        source: &dyn BatchSource,
        optimizer: &mut Optimizer,
        epoch: usize,
        group: &[&[usize]],
        lr: f64,
        stop_vote: bool,
    ) -> Result<(Tensor, usize, StopVote), TrainError> {
        let seed = self.spec.seed;
        let batches = group
            .iter()
            .map(|micro| {
                let (inputs, targets) = source.train(epoch, micro)?;
                let row_seeds = micro.iter().map(|&i| sample_seed(seed, epoch, i)).collect();
                Ok(MicroBatch {
                    inputs,
                    targets,
                    mode: Mode::Train { row_seeds },
                })
            })
            .collect::<Result<Vec<_>, DataError>>()?;
        let cx = StepContext {
            model: self.model.as_ref(),
            comm: self.comm,
            device: &self.device,
            grad_clip_norm: self.spec.train.grad_clip_norm,
            bucket_bytes: self.spec.distributed.bucket_bytes,
            // Row shards would split a BatchNorm's batch statistics.
            shards: shards::ShardPool::for_device(&self.device)
                .filter(|_| self.model.rows_independent()),
        };
        let r = step::optimizer_step(&cx, optimizer, &batches, lr, stop_vote, None)?;
        Ok((r.loss_sum, r.samples, r.stop))
    }

    /// Evaluates on the whole evaluation split, or on `train.eval_batches` batches of it when
    /// set (every evaluation alike, as nanoGPT's `eval_iters` or Lightning's
    /// `limit_val_batches`: a large corpus's split is never scored whole unless asked).
    fn evaluate(&self, batches: &dyn BatchSource) -> Result<EvalResult, TrainError> {
        let t = &self.spec.train;
        // Every rank scores its share with rank 0's buffers (BatchNorm statistics).
        crate::comm::broadcast_buffers(self.comm, self.model.params())?;
        evaluate(
            self.model.as_ref(),
            batches,
            self.data.eval_len(),
            self.comm,
            t.eval_batch_size,
            t.eval_batches,
            shards::ShardPool::for_device(&self.device),
        )
    }

    fn describe_eval(&self, eval: &EvalResult) -> String {
        match self.data.input() {
            ModelInput::Tokens { .. } => format!(
                "val loss {:.4}, next-token accuracy {:.2}%",
                eval.loss,
                eval.accuracy * 100.0
            ),
            ModelInput::Image { .. } => format!(
                "test loss {:.4}, test accuracy {:.2}%",
                eval.loss,
                eval.accuracy * 100.0
            ),
        }
    }

    /// Records an evaluation: a metrics line for a mid-epoch one (epoch lines carry their own),
    /// the best loss so far, and the `best` checkpoint when asked for.
    fn record_eval(
        &mut self,
        eval: &EvalResult,
        metrics: &mut MetricState,
        optimizer: &Optimizer,
        mut at: TrainPosition,
        mid_epoch: bool,
    ) -> Result<(), TrainError> {
        let step = at.step;
        if let Some(leader) = &self.leader
            && mid_epoch
        {
            leader.log_eval(at.epoch, step, eval)?;
        }
        let better = eval.loss.is_finite() && metrics.best_eval.is_none_or(|b| eval.loss < b.0);
        if !better {
            return Ok(());
        }
        metrics.best_eval = Some((eval.loss, step));
        at.metrics.best_eval = metrics.best_eval;
        if !self.spec.checkpoint.keep_best {
            return Ok(());
        }
        if let Some(leader) = &self.leader {
            match leader.save_best(self.model.params(), optimizer, &at) {
                Ok(dir) => self.reporter.line(&format!(
                    "best {} so far ({:.4}): weights kept in {}",
                    self.loss_name(),
                    eval.loss,
                    dir.display()
                )),
                Err(TrainError::Checkpoint(e))
                    if self.spec.checkpoint.on_write_error == OnWriteError::Warn =>
                {
                    self.reporter.line(&format!("warning: {e}; training on"));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn loss_name(&self) -> &'static str {
        match self.data.input() {
            ModelInput::Tokens { .. } => "validation loss",
            ModelInput::Image { .. } => "test loss",
        }
    }

    /// The position after `done` steps of `run`'s epoch: the next epoch's start when it is
    /// complete.
    fn epoch_end_position(
        &self,
        run: &EpochRun,
        done: usize,
        step: usize,
        optimizer: &Optimizer,
        lr: f64,
        metrics: &MetricState,
    ) -> TrainPosition {
        if done < run.groups {
            return self.position(run, done, step, optimizer, lr, metrics);
        }
        let next = EpochRun {
            epoch: run.epoch + 1,
            skip: 0,
            groups: 0,
            consumed: 0,
        };
        let mut m = metrics.clone();
        m.start_epoch();
        self.position(&next, 0, step, optimizer, lr, &m)
    }

    fn position(
        &self,
        run: &EpochRun,
        step_in_epoch: usize,
        step: usize,
        optimizer: &Optimizer,
        lr: f64,
        metrics: &MetricState,
    ) -> TrainPosition {
        TrainPosition {
            epoch: run.epoch,
            step_in_epoch,
            step,
            optimizer_steps: optimizer.steps(),
            world_size: self.comm.world_size(),
            seed: self.spec.seed,
            lr,
            consumed_in_epoch: run.consumed,
            metrics: metrics.clone(),
        }
    }

    fn save_checkpoint(
        &mut self,
        optimizer: &Optimizer,
        position: &TrainPosition,
    ) -> Result<(), TrainError> {
        if let Some(leader) = &self.leader {
            match leader.checkpoint(self.model.params(), optimizer, position) {
                Ok(dir) => self
                    .reporter
                    .line(&format!("checkpoint written: {}", dir.display())),
                Err(TrainError::Checkpoint(e))
                    if self.spec.checkpoint.on_write_error == OnWriteError::Warn =>
                {
                    self.reporter.line(&format!(
                        "warning: {e}; training on (checkpoint.on_write_error = \"warn\")"
                    ));
                }
                Err(e) => return Err(e),
            }
        }
        // Everyone continues only once rank 0's checkpoint is complete on disk.
        self.comm.barrier()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
