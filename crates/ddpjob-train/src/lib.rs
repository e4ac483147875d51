//! The trainer: epochs of optimizer steps over DistributedSampler shards, gradient
//! accumulation, one gradient average per step through the [`Communicator`], clipping, the
//! schedule, evaluation, metrics and checkpoints. The same code for one worker or many. It is
//! given a [`TrainPlan`] (what it needs of the job, not the whole spec); after each step it
//! does what [`events`] says is due. Also
//! what it reports to while it runs ([`progress`]) and the faults tests inject into it
//! ([`fault`]).
//!
//! It depends on the seams (`ddpjob-seam`: the [`Model`] and [`Task`] it drives), the job spec,
//! the collectives, the optimizers, the sampler and the storage (checkpoints, the job
//! directory and its records): never on a model family, a dataset, the registry, the launcher
//! or the reports drawn from its records (the curves are drawn by a function it is handed), so
//! a change to a model family does not rebuild it.

// Printing that never panics. `println!` panics when stdout is a closed pipe (`ddpjob run
// job.toml | head`), which killed a training job (its launcher or its rank 0) over a display;
// these drop what cannot be written, as the job's logs keep every line. Exported for the root
// crate, which prints the same way (`#[macro_use] extern crate ddpjob_train`).
#[doc(hidden)]
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
#[doc(hidden)]
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}
#[doc(hidden)]
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

// The names the trainer's files use for the crates it drives.
use ddpjob_data as data;
use ddpjob_optim as optim;
use ddpjob_seam as models;
use ddpjob_seam::task;
use ddpjob_spec as config;
use ddpjob_storage::{checkpoint, jobdir};

mod epoch;
mod eval;
pub mod events;
pub mod fault;
mod full;
mod invariant;
mod leader;
mod metrics;
mod overlap;
mod phase_clock;
pub mod progress;
mod resume;
mod sharded;
pub mod shards;
pub mod step;
mod streamed;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use candle_core::Device;
use thiserror::Error;

use crate::checkpoint::{CheckpointError, MetricState, Restored, TensorFile, TrainPosition};
use crate::config::{OnWriteError, Plan, Sharding, TrainPlan};
use crate::data::{DataError, DistributedSampler};
use crate::jobdir::JobDirError;
use crate::models::{Mode, Model};
use crate::optim::{GatherError, Gathered, Optimizer, Schedule};
use crate::task::{BatchSource, ModelInput, Task, sample_seed};
use ddpjob_comm::buckets::ShardPlan;
use ddpjob_comm::heartbeat::Beacon;
use ddpjob_comm::{CommError, Communicator, broadcast_vars};
use fault::Fault;
use progress::Reporter;

pub use eval::{EvalResult, EvalThreads, declared_metrics, evaluate};
pub use leader::{DrawCurves, Leader, Weights};
pub use metrics::{EarlyStop, ExpectationResult, Summary, WeightDigests};

/// The file under a job's `logs/` where `DDPJOB_TRACE_WEIGHTS` puts each step's weight digests.
pub const WEIGHT_DIGESTS: &str = "weights.jsonl";
pub use resume::Start;
use step::{MicroBatch, StepContext, StepError, StepResult};

#[derive(Debug, Error)]
pub enum TrainError {
    #[error(
        "training loss became {value} in epoch {}, {}; lower train.lr, set \
         train.grad_clip_norm, or check the data",
        epoch + 1,
        match first_step == last_step {
            true => format!("at optimizer step {first_step}"),
            false => format!("between optimizer steps {first_step} and {last_step}"),
        }
    )]
    NonFinite {
        value: f64,
        /// Counted from 0, as `metrics.jsonl`'s; said from 1, as the log's lines.
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
    /// The job cannot train as configured on this data (found once the data is open).
    #[error("{0}")]
    Unfit(String),
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
    /// `DDPJOB_TRACE_WEIGHTS` (set by `ddpjob verify`): a file rank 0 appends each step's
    /// weight digests to (see `metrics::WeightDigests`); set on every rank, since sharded
    /// parameters are gathered for it.
    pub trace_weights: Option<std::path::PathBuf>,
}

/// How a run ended.
#[derive(Debug)]
pub enum Ending {
    Completed(Box<Summary>),
    /// Every rank agreed to stop (preemption); the checkpoint of `step` is on disk.
    Stopped {
        step: usize,
    },
}

pub struct Trainer<'a> {
    /// What it is given of the job (see [`TrainPlan`]).
    pub plan: TrainPlan<'a>,
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
    /// The frozen parameters' fingerprint when some are (see `checkpoint::base`): checkpoints
    /// then hold only what trains, and record it. Taken when the run begins, once the weights
    /// are in place (a whole checkpoint of an older job sets the frozen ones too).
    pub base_sha256: Option<String>,
    /// `distributed.sharding = "full"`: the model's units, once the run has begun; the
    /// parameters then hold values only while read (see `full`).
    pub sharded_parameters: Option<full::Units>,
}

/// What a run carries from epoch to epoch.
struct RunState {
    /// Optimizer steps done.
    step: usize,
    metrics: MetricState,
    optimizer: Optimizer,
    schedule: Schedule,
    total_steps: usize,
    last_eval: Option<EvalResult>,
    epochs_done: usize,
    /// Set once `train.early_stopping` has ended the run (after the epoch's end is recorded).
    stopped_early: Option<EarlyStop>,
    /// A mid-epoch evaluation of the current weights, already recorded, that the epoch's end
    /// takes instead of evaluating them again.
    fresh_eval: Option<EvalResult>,
}

/// One epoch's shard of steps, as this run takes it.
struct EpochRun {
    epoch: usize,
    /// Steps of the epoch already done before this run reached it.
    skip: usize,
    /// Steps of the epoch done when its training steps end (`skip` plus this run's).
    done: usize,
    /// Steps in the epoch (on this world size, from its start or its re-shard).
    groups: usize,
    /// Samples of the epoch consumed by all ranks so far.
    consumed: usize,
}

impl Trainer<'_> {
    pub fn plan(&self) -> Plan {
        self.plan
            .plan(self.data.train_len(), self.comm.world_size())
    }

    /// Trains to the end of the plan, or until every rank agrees to stop: the start (restored
    /// or fresh), the epochs (each its steps, then its evaluation and checkpoint), the summary.
    pub fn run(&mut self) -> Result<Ending, TrainError> {
        let spec = self.plan;
        let t = &spec.train;
        let world = self.comm.world_size();
        let train_len = self.data.train_len();
        // Among them, world-size-invariant training with less than one global batch.
        if let Some(why) = spec.no_steps(train_len, world) {
            return Err(TrainError::Unfit(why));
        }
        let position = self.resume.as_ref().map(|r| r.position.clone());
        let start = Start::new(
            spec,
            train_len,
            world,
            self.plan().total_steps,
            position.as_ref(),
        );
        let mut run = RunState {
            step: start.step,
            metrics: start.metrics.clone(),
            optimizer: self.begin(&start)?,
            schedule: Schedule::new(t.lr, t.schedule, start.total_steps),
            total_steps: start.total_steps,
            last_eval: None,
            epochs_done: start.epoch,
            stopped_early: None,
            fresh_eval: None,
        };
        // A checkpoint taken as early stopping ended the run (the launcher went before the
        // job was marked finished): it ends here too rather than training on.
        run.stopped_early = self.early_stop(&run.metrics, run.step, run.total_steps);
        let data = self.data;
        let batches = data.batches(&self.device)?;
        let batches = batches.as_ref();
        if let Some(note) = batches.note() {
            self.reporter.line(&note);
        }
        if t.eval_every.is_some() && position.is_none() {
            // As nanoGPT: where the run starts from (a fine-tune's pretrained weights). Not a
            // candidate for `best`, whose weights are the training's.
            let eval = self.evaluate(batches, &run.optimizer)?;
            let line = format!("step 0/{}: {}", run.total_steps, eval.describe());
            self.reporter.line(&line);
            if let Some(leader) = &self.leader {
                leader.log_eval(start.epoch, 0, &eval)?;
            }
        }
        let mut sampler = DistributedSampler::new(train_len, world, self.comm.rank(), spec.seed)
            .with_drop_last(spec.drop_last);
        for epoch in start.epoch..t.epochs {
            let resumed_here = position.is_some() && epoch == start.epoch;
            // A run stopped after its last step, before that epoch's end (its evaluation,
            // record and train loss): the resumed run ends the epoch, with no step to take.
            // (Exactly at its end: a job edited to fewer steps has nothing to end.)
            let unfinished =
                resumed_here && start.metrics.is_epoch_open() && run.step == run.total_steps;
            if (run.step >= run.total_steps && !unfinished) || run.stopped_early.is_some() {
                break;
            }
            sampler.set_epoch(epoch as u64);
            let indices = if resumed_here && start.reshard {
                sampler.indices_after(start.consumed)
            } else {
                sampler.indices()
            };
            let mut micro: Vec<&[usize]> = indices.chunks(t.batch_size).collect();
            if spec.distributed.world_size_invariant {
                // Only whole global batches: a partial one's samples (and the sampler's
                // padding) would depend on the world size.
                let left = match resumed_here && start.reshard {
                    true => train_len.saturating_sub(start.consumed),
                    false => train_len,
                };
                micro.truncate(spec.micro_batches_for(left, world));
            }
            let groups: Vec<&[&[usize]]> = micro.chunks(t.accumulation).collect();
            let mut epoch_run = EpochRun {
                epoch,
                skip: if resumed_here { start.skip_in_epoch } else { 0 },
                done: 0,
                groups: groups.len(),
                consumed: if resumed_here { start.consumed } else { 0 },
            };
            if !resumed_here {
                run.metrics.start_epoch();
            }
            if let Some(stopped) = self.train_epoch(&mut run, &mut epoch_run, &groups, batches)? {
                return Ok(stopped);
            }
            self.end_epoch(&mut run, &epoch_run, batches)?;
        }
        if let Some(stop) = &run.stopped_early {
            self.reporter
                .line(&stop.describe(&declared_metrics(self.data)));
        }
        let eval = match run.last_eval.take() {
            Some(e) => e,
            None => self.evaluate(batches, &run.optimizer)?,
        };
        // Sharded parameters: the final weights streamed to where `Leader::finish` takes them.
        self.stream_weights(&run.optimizer, Leader::final_weights_staging_path, true)?;
        let mut summary = self.summary(&run, &eval);
        summary.peak_rss_bytes = self.peak_rss()?;
        Ok(Ending::Completed(Box::new(summary)))
    }

    /// The optimizer, restored from the checkpoint (with a line and a `resume` record) or
    /// fresh; every rank then starts from rank 0's parameters.
    fn begin(&mut self, start: &Start) -> Result<Optimizer, TrainError> {
        let (spec, world) = (self.plan, self.comm.world_size());
        let params = self.model.params();
        let mut optimizer = match spec.distributed.sharding {
            // A single rank that skips its collectives has nothing to share its state with.
            sharding if sharding.shards_optimizer() && !self.comm.skips_collectives() => {
                let sizes: Vec<usize> = params.trainable().map(|(_, v)| v.elem_count()).collect();
                let bucket_bytes = spec.distributed.bucket_bytes;
                let plan = ShardPlan::new(&sizes, bucket_bytes, self.comm);
                let stage = match sharding {
                    Sharding::Full => "ZeRO-3",
                    Sharding::Gradients => "ZeRO-2",
                    _ => "ZeRO-1",
                };
                self.reporter.line(&format!(
                    "optimizer state sharded over {world} worker{} ({stage}): rank {} keeps \
                     the state of {} of {} trainable values",
                    if world == 1 { "" } else { "s" },
                    self.comm.rank(),
                    plan.owned_elements(),
                    sizes.iter().sum::<usize>()
                ));
                // Asked once, here: a model that can then hands its gradients over block by
                // block.
                let streams =
                    sharding == Sharding::Gradients && self.model.stream_gradients().is_some();
                if sharding == Sharding::Gradients && !streams {
                    self.reporter.line(
                        "sharding = \"gradients\": this model forms its gradients all at \
                         once at the end of its backward, so they are reduce-scattered then, \
                         as with \"optimizer\" (no further memory saved)",
                    );
                }
                if sharding == Sharding::Full {
                    let units = full::Units::of(self.model.as_ref()).map_err(|why| {
                        TrainError::Unfit(format!(
                            "distributed.sharding = \"full\": model.arch = \"{}\" cannot \
                             gather its parameters block by block: {why}; use \"gradients\"",
                            spec.model
                        ))
                    })?;
                    let trainable = sizes.iter().sum::<usize>();
                    // Only what trains is in the buckets that are sharded.
                    let frozen = match params.element_count() - trainable {
                        0 => String::new(),
                        n => format!(
                            "; the {n} frozen values (model.freeze, LoRA's base) are not \
                             sharded: every worker keeps them whole"
                        ),
                    };
                    self.reporter.line(&format!(
                        "parameters sharded too: each block's gathered for its forward and \
                         its backward only ({} values at most, of {trainable}){frozen}",
                        units.largest_block(params),
                    ));
                    self.sharded_parameters = Some(units);
                }
                Optimizer::sharded(spec.train.optimizer, plan, params)
            }
            _ => Optimizer::new(spec.train.optimizer, params.len()),
        };
        if let Some(restored) = self.resume.take() {
            resume::restore(self.model.params(), &mut optimizer, &restored)?;
            let note = start.describe(spec, &restored.position, world);
            self.reporter.line(&format!(
                "{note} (from checkpoint `{}`)",
                restored.dir.display()
            ));
            if let Some(leader) = &self.leader {
                leader.log_resume(&restored, world, start.total_steps)?;
            }
        } else if let Some(leader) = &self.leader {
            leader.start(world, start.total_steps)?;
        }
        broadcast_vars(self.comm, self.model.params().vars())?;
        self.base_sha256 = crate::checkpoint::base::fingerprint(self.model.params())?;
        // With sharded parameters, from here on this rank keeps its pieces only.
        if self.sharded_parameters.is_some() {
            optimizer.hold_parameters(self.model.params())?;
        }
        if let Some(mut sharded) = self.sharded(&optimizer, true)? {
            sharded.release_all()?;
        }
        Ok(optimizer)
    }

    /// With sharded parameters, what gathers and releases them, every one present or
    /// released as `present` says; `None` without.
    fn sharded<'s>(
        &'s self,
        optimizer: &'s Optimizer,
        present: bool,
    ) -> Result<Option<full::Sharded<'s>>, TrainError> {
        let Some(units) = &self.sharded_parameters else {
            return Ok(None);
        };
        let params = self.model.params();
        Ok(Some(full::Sharded::new(
            self.comm, optimizer, params, units, present,
        )?))
    }

    /// With sharded parameters, gives every one its values (`trace_weights`, a test's hook);
    /// [`Trainer::release_parameters`] lets them go again. A collective; without sharded
    /// parameters nothing happens.
    fn gather_parameters(&self, optimizer: &Optimizer) -> Result<(), TrainError> {
        if let Some(mut sharded) = self.sharded(optimizer, false)? {
            sharded.gather_all()?;
        }
        Ok(())
    }

    fn release_parameters(&self, optimizer: &Optimizer) -> Result<(), TrainError> {
        if let Some(mut sharded) = self.sharded(optimizer, true)? {
            sharded.release_all()?;
        }
        Ok(())
    }

    /// With sharded parameters, streams every weight (the frozen ones with `frozen_too`) into
    /// the leader's `staging` file, bucket by bucket (a collective): that file on rank 0,
    /// `None` elsewhere and without sharded parameters (the leader writes their values).
    fn stream_weights(
        &self,
        optimizer: &Optimizer,
        staging: fn(&Leader) -> PathBuf,
        frozen_too: bool,
    ) -> Result<Option<PathBuf>, TrainError> {
        let Some(sharded) = self.sharded(optimizer, false)? else {
            return Ok(None);
        };
        let path = self.leader.as_ref().map(staging);
        sharded
            .write_weights(self.model.params(), frozen_too, path.as_deref())
            .map_err(from_gather)?;
        Ok(path)
    }

    /// Whether the run's final weights were streamed into the leader's staging file at the
    /// end of [`Trainer::run`] (sharded parameters), for [`Leader::finish`].
    pub fn streamed_final_weights(&self) -> bool {
        self.sharded_parameters.is_some()
    }

    /// Every rank's peak resident memory so far, in rank order (a collective).
    fn peak_rss(&self) -> Result<Vec<u64>, TrainError> {
        let mut peaks = vec![0f64; self.comm.world_size()];
        peaks[self.comm.rank()] = ddpjob_data::host::peak_rss_bytes() as f64;
        if !self.comm.skips_collectives() {
            self.comm.all_reduce_sum_f64(&mut peaks)?;
        }
        Ok(peaks.into_iter().map(|b| b as u64).collect())
    }

    /// The values that train, when some parameter tensors are frozen.
    fn trainable_parameters(&self) -> Option<usize> {
        let params = self.model.params();
        (params.frozen_count() > 0).then(|| params.trainable_element_count())
    }

    /// `summary.json` of a completed run, its final evaluation `eval`.
    fn summary(&self, run: &RunState, eval: &EvalResult) -> Summary {
        let metrics = &run.metrics;
        let train_s = metrics.train_s;
        let samples_per_s = metrics.total_samples / train_s.max(1e-9);
        let tokens = matches!(self.data.input(), ModelInput::Tokens { .. });
        Summary {
            best_test_loss: metrics.best_eval.map(|b| b.0),
            best_step: metrics.best_eval.map(|b| b.1),
            train_tokens_per_s: tokens
                .then(|| samples_per_s * self.data.targets_per_sample() as f64),
            test_accuracy: eval.accuracy,
            test_loss: eval.loss,
            more_metrics: Summary::more(&eval.values),
            metrics: eval.metrics.clone(),
            final_train_loss: metrics.last_epoch_loss.unwrap_or(f64::NAN),
            epochs: run.epochs_done,
            steps: run.step,
            train_samples_per_s: samples_per_s,
            wall_s: self.started.elapsed().as_secs_f64(),
            train_s,
            samples: metrics.total_samples as u64,
            world_size: self.comm.world_size(),
            parameters: self.model.params().element_count(),
            trainable_parameters: self.trainable_parameters(),
            peak_rss_bytes: Vec::new(),
            estimated_peak_bytes: None,
            stopped_early: run.stopped_early,
            expectations: Vec::new(),
        }
    }

    /// One optimizer step over the micro-batches of `group` (indices into the training split).
    /// Returns (Σ loss·n, n, whether any rank voted to stop).
    fn optimizer_step(
        &mut self,
        source: &dyn BatchSource,
        optimizer: &mut Optimizer,
        (epoch, step): (usize, usize),
        group: &[&[usize]],
        lr: f64,
        stop_vote: bool,
    ) -> Result<StepResult, TrainError> {
        let seed = self.plan.seed;
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
            grad_clip_norm: self.plan.train.grad_clip_norm,
            bucket_bytes: self.plan.distributed.bucket_bytes,
            // Row shards would split a BatchNorm's batch statistics; with sharded parameters
            // the pass runs on the thread that gathers them.
            shards: shards::ShardPool::for_device(&self.device)
                .filter(|_| self.model.rows_independent() && self.sharded_parameters.is_none()),
            masked_targets: self.data.masks_targets(),
            virtual_shards: self.plan.virtual_shards(),
            scrambled_pieces: self
                .hooks
                .fault
                .as_ref()
                .is_some_and(|f| f.scrambles_pieces(step)),
            stream_gradients: matches!(
                self.plan.distributed.sharding,
                Sharding::Gradients | Sharding::Full
            ),
            sharded_parameters: self.sharded_parameters.as_ref(),
            overlap_comm: self.plan.distributed.overlap_comm,
        };
        Ok(step::optimizer_step(
            &cx, optimizer, &batches, lr, stop_vote, None,
        )?)
    }

    /// Evaluates on the whole evaluation split, or on `train.eval_batches` batches of it when
    /// set (every evaluation alike, as nanoGPT's `eval_iters` or Lightning's
    /// `limit_val_batches`: a large corpus's split is never scored whole unless asked).
    fn evaluate(
        &self,
        batches: &dyn BatchSource,
        optimizer: &Optimizer,
    ) -> Result<EvalResult, TrainError> {
        let Some(mut gate) = self.sharded(optimizer, false)? else {
            return self.evaluate_now(batches);
        };
        // Block by block, as a training pass gathers them: the model's scoring asks too.
        let eval = crate::models::gate::run_with(&mut gate, || self.evaluate_now(batches));
        if let Some(error) = gate.error.take() {
            return Err(error.into());
        }
        gate.release_all()?;
        eval
    }

    fn evaluate_now(&self, batches: &dyn BatchSource) -> Result<EvalResult, TrainError> {
        let t = &self.plan.train;
        // Every rank scores its share with rank 0's buffers (BatchNorm statistics).
        ddpjob_comm::broadcast_vars(self.comm, self.model.params().buffers().map(|(_, var)| var))?;
        let threads = match self.plan.distributed.world_size_invariant {
            _ if self.sharded_parameters.is_some() => EvalThreads::Lockstep,
            true => EvalThreads::Pieces {
                cpu: self.device.is_cpu(),
            },
            false => EvalThreads::Rows(shards::ShardPool::for_device(&self.device)),
        };
        evaluate(
            self.model.as_ref(),
            self.data,
            batches,
            self.comm,
            (t.eval_batch_size, t.eval_batches),
            threads,
        )
    }

    /// Records an evaluation: a metrics line for a mid-epoch one (epoch lines carry their own),
    /// the best loss so far, the `best` checkpoint when asked for, and the count for early
    /// stopping. Returns why training ends here when `train.early_stopping` says it does.
    fn record_eval(
        &mut self,
        eval: &EvalResult,
        run: &mut RunState,
        mut at: TrainPosition,
        mid_epoch: bool,
    ) -> Result<Option<EarlyStop>, TrainError> {
        let (step, metrics) = (at.step, &mut run.metrics);
        if let Some(leader) = &self.leader
            && mid_epoch
        {
            leader.log_eval(at.epoch, step, eval)?;
        }
        // Every rank holds the same all-reduced loss, so every rank decides alike.
        let early = self.plan.train.early_stopping;
        if early.patience.is_some() {
            // The watched metric as the task declared it; a task that does not declare it
            // still has the loss and accuracy every evaluation sums.
            let name = early.monitor.metric();
            let value = eval.get(name).unwrap_or(match name {
                "accuracy" => eval.accuracy,
                _ => eval.loss,
            });
            metrics.count_for_early_stopping(value, early.monitor, early.min_delta);
        }
        // The plan's last evaluation ends the run anyway: no early stop to report.
        let stop = self
            .early_stop(metrics, step, run.total_steps)
            .filter(|_| step < run.total_steps);
        let better = eval.loss.is_finite() && metrics.best_eval.is_none_or(|b| eval.loss < b.0);
        if better {
            metrics.best_eval = Some((eval.loss, step));
        }
        at.metrics.best_eval = metrics.best_eval;
        at.metrics.early_stopping_best = metrics.early_stopping_best;
        at.metrics.evals_without_improvement = metrics.evals_without_improvement;
        at.metrics.early_stopping_on = metrics.early_stopping_on;
        if better && self.plan.checkpoint.keep_best {
            self.save_best(eval, &run.optimizer, &at)?;
        }
        Ok(stop)
    }

    /// The `best` checkpoint of evaluation `eval` at `at` (a collective when the optimizer's
    /// state is sharded).
    fn save_best(
        &mut self,
        eval: &EvalResult,
        optimizer: &Optimizer,
        at: &TrainPosition,
    ) -> Result<(), TrainError> {
        let written = self.write_checkpoint(optimizer, at, Leader::save_best);
        match written {
            Ok(Some(dir)) => self.reporter.line(&format!(
                "best {} so far ({:.4}): weights kept in {}",
                self.loss_name(),
                eval.loss,
                dir.display()
            )),
            Ok(None) => {}
            Err(TrainError::Checkpoint(e))
                if self.plan.checkpoint.on_write_error == OnWriteError::Warn =>
            {
                self.reporter.line(&format!("warning: {e}; training on"));
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Where `train.early_stopping` ends the run, by `metrics`' count after `step` of `planned`
    /// (`None` while it goes on).
    fn early_stop(&self, metrics: &MetricState, step: usize, planned: usize) -> Option<EarlyStop> {
        let early = self.plan.train.early_stopping;
        let patience = early.patience?;
        // A count of another figure (job.toml's monitor edited since) does not end this run.
        let counted = metrics.early_stopping_on.unwrap_or_default() == early.monitor;
        (counted && metrics.evals_without_improvement >= patience).then_some(EarlyStop {
            step,
            planned_steps: planned,
            evaluations: metrics.evals_without_improvement,
            monitor: early.monitor,
            best: metrics.early_stopping_best,
        })
    }

    /// What the evaluation's loss is called in messages, as the task words it.
    fn loss_name(&self) -> String {
        declared_metrics(self.data)
            .into_iter()
            .find(|m| m.name == "loss")
            .map_or_else(|| "loss".into(), |m| m.label)
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
            done: 0,
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
            seed: self.plan.seed,
            lr,
            consumed_in_epoch: run.consumed,
            metrics: metrics.clone(),
            format: crate::checkpoint::FORMAT,
            base_sha256: self.base_sha256.clone(),
            virtual_shards: self.plan.distributed.invariant_shards(),
        }
    }

    /// The optimizer's state for rank 0's checkpoint (a collective when it is sharded); a
    /// failed write of a sharded state is a checkpoint error like any other.
    fn gather_optimizer(&self, optimizer: &Optimizer) -> Result<Option<Gathered>, TrainError> {
        let staging = self.leader.as_ref().map(Leader::staging_path);
        let params = self.model.params();
        optimizer
            .checkpoint_state(self.comm, params, staging.as_deref())
            .map_err(from_gather)
    }

    fn save_checkpoint(
        &mut self,
        optimizer: &Optimizer,
        position: &TrainPosition,
    ) -> Result<(), TrainError> {
        match self.write_checkpoint(optimizer, position, Leader::checkpoint) {
            Ok(Some(dir)) => self
                .reporter
                .line(&format!("checkpoint written: {}", dir.display())),
            Ok(None) => {}
            Err(TrainError::Checkpoint(e))
                if self.plan.checkpoint.on_write_error == OnWriteError::Warn =>
            {
                self.reporter.line(&format!(
                    "warning: {e}; training on (checkpoint.on_write_error = \"warn\")"
                ));
            }
            Err(e) => return Err(e),
        }
        // Everyone continues only once rank 0's checkpoint is complete on disk.
        self.comm.barrier()?;
        Ok(())
    }
}

impl Trainer<'_> {
    /// A checkpoint at `position` of the weights and `optimizer`'s state, gathered (a
    /// collective, when sharded) and written by rank 0 with `write` (`Leader::checkpoint` or
    /// `Leader::save_best`): its directory there, `None` elsewhere. Rank 0's failure to write
    /// what it gathered comes back once every collective has run, as a checkpoint error like
    /// a failure of its own files.
    fn write_checkpoint(
        &self,
        optimizer: &Optimizer,
        position: &TrainPosition,
        write: fn(&Leader, Weights, TensorFile, &TrainPosition) -> Result<PathBuf, TrainError>,
    ) -> Result<Option<PathBuf>, TrainError> {
        let state = self.gather_optimizer(optimizer);
        let whole = position.base_sha256.is_none();
        let staged = self.stream_weights(optimizer, Leader::weights_staging_path, whole);
        let (state, staged) = (state?, staged?);
        let (Some(leader), Some(state)) = (&self.leader, state) else {
            return Ok(None);
        };
        let weights = Weights {
            params: self.model.params(),
            written: staged.as_deref(),
        };
        write(leader, weights, state.as_checkpoint(), position).map(Some)
    }
}

/// A gathered checkpoint's failure as the run's: a failed write is a checkpoint error.
fn from_gather(e: GatherError) -> TrainError {
    match e {
        GatherError::Comm(e) => e.into(),
        GatherError::Tensor(e) => e.into(),
        GatherError::Io { path, cause } => {
            crate::checkpoint::CheckpointError::Io { path, cause }.into()
        }
    }
}
