//! One optimizer step on micro-batches already on the device: forward and backward per
//! micro-batch with weighted accumulation, one gradient average, clipping, the update. Shared by
//! the training loop and `ddpjob bench step`, so the benchmark times exactly what training runs.

use candle_core::{DType, Device, Tensor};

use crate::models::{GradientSink, Mode, Model};
use crate::optim::{Optimizer, clip_grad_norm};
use ddpjob_comm::{CommError, Communicator, StopVote, average_gradients};

pub use super::phase_clock::Phases;
use super::phase_clock::{Mark, Phase, PhaseClock};
use super::shards::ShardPool;
use super::streamed::{BucketVia, Here, Reduced};
use ddpjob_comm::buckets::ShardPlan;

/// One micro-batch: inputs, integer targets, and how the forward pass runs (the row seeds of
/// its dropout).
pub struct MicroBatch {
    pub inputs: Tensor,
    pub targets: Tensor,
    pub mode: Mode,
}

/// What every step needs besides the batches.
pub struct StepContext<'a> {
    pub model: &'a dyn Model,
    pub comm: &'a dyn Communicator,
    pub device: &'a Device,
    pub grad_clip_norm: Option<f64>,
    pub bucket_bytes: usize,
    /// Row shards run side by side per micro-batch (CPU); `None`: the whole micro-batch at
    /// once, the kernels splitting each op over the threads instead.
    pub shards: Option<&'a ShardPool>,
    /// The task's targets may be [`crate::task::IGNORE_TARGET`] (instruction data's prompts,
    /// padding): the step's loss is then the mean over the targets that score in the whole
    /// global batch, so parts are weighted by those, counted over all ranks.
    pub masked_targets: bool,
    /// `distributed.deterministic = "world-size-invariant"`'s pieces per step (see
    /// `invariant`); `None`: the usual step.
    pub virtual_shards: Option<usize>,
    /// Test-only (`DDPJOB_FAULT` kind `piece-order`): this step sums its pieces left to right.
    pub scrambled_pieces: bool,
    /// `distributed.sharding = "gradients"`: with a sharded optimizer, the last micro-batch's
    /// buckets are reduce-scattered while its backward runs (see `streamed`).
    pub stream_gradients: bool,
    /// `distributed.sharding = "full"`: the model's units, whose parameters are gathered
    /// only while a pass reads them (see `full`); the optimizer holds this rank's pieces.
    pub sharded_parameters: Option<&'a super::full::Units>,
    /// `distributed.overlap_comm`: with sharded parameters on the CPU, the collectives run on
    /// a thread of their own, the next block gathered ahead (see `overlap`).
    pub overlap_comm: bool,
}

/// Σ loss·n of a step that computed none: zeros, one per logged value.
pub(super) fn no_loss(cx: &StepContext) -> candle_core::Result<Tensor> {
    Tensor::zeros(1 + cx.model.loss_terms().len(), DType::F32, cx.device)
}

/// What one step produced: Σ loss·n over its samples ([1 + terms]: the task's loss, then each
/// of the model's [`Model::loss_terms`]; read only at log intervals), the sample count, and
/// whether any rank voted to stop.
pub struct StepResult {
    pub loss_sum: Tensor,
    pub samples: usize,
    /// Whether any rank voted to stop, read when the trainer decides (a device round trip).
    pub stop: StopVote,
    /// The global gradient norm before clipping (a scalar, the same on every rank), when
    /// `train.grad_clip_norm` computed it; read only when it is logged.
    pub grad_norm: Option<Tensor>,
}

/// Forward and backward over each micro-batch, gradients summed with weights
/// n_micro / n_step (so the step sees the mean over all its samples, exactly as one big batch
/// would), averaged over ranks once, clipped, applied with learning rate `lr`.
pub fn optimizer_step(
    cx: &StepContext,
    optimizer: &mut Optimizer,
    micro_batches: &[MicroBatch],
    lr: f64,
    stop_vote: bool,
    phases: Option<&mut Phases>,
) -> Result<StepResult, StepError> {
    if let Some(pieces) = cx.virtual_shards {
        let [batch] = micro_batches else {
            return Err(candle_core::Error::Msg(format!(
                "a world-size-invariant step takes one micro-batch, not {}",
                micro_batches.len()
            ))
            .into());
        };
        return super::invariant::optimizer_step(cx, optimizer, batch, pieces, lr, stop_vote);
    }
    let params = cx.model.params();
    ddpjob_comm::broadcast_vars(cx.comm, params.buffers().map(|(_, var)| var))?;
    // Samples (rows) weight the micro-batches; a language model's rows all hold block_size
    // targets, so this is also the weighting by targets.
    let rows = |b: &MicroBatch| b.targets.dims().first().copied().unwrap_or(1);
    let n_step: usize = micro_batches.iter().map(rows).sum();
    let weights = PartWeights::of(cx, micro_batches, n_step)?;
    let mut clock = PhaseClock::new(cx.device, phases.is_some())?;
    let passes = Passes {
        model: cx.model,
        shards: cx.shards,
        weights: &weights,
        sharded: cx.sharded_parameters.is_some(),
        streamed: optimizer.plan().filter(|_| cx.stream_gradients),
        stop_vote,
    };
    // The collectives on a thread of their own while the passes run (see `overlap`).
    let overlapped = match (cx.sharded_parameters, cx.comm.shared()) {
        (Some(units), Some(comm)) if cx.overlap_comm && cx.device.is_cpu() => Some((units, comm)),
        _ => None,
    };
    let ran = if let Some((units, comm)) = overlapped {
        let served = super::overlap::overlapped(
            comm,
            (optimizer, params, units),
            (passes.streamed, stop_vote),
            |courier| passes.run(micro_batches, courier, &mut clock),
        )?;
        let (mut ran, reduced) = (served.0?, served.1);
        ran.streamed = ran.streamed.take().or(reduced);
        ran
    } else if let Some(units) = cx.sharded_parameters {
        let mut gate = super::full::Sharded::new(cx.comm, optimizer, params, units, false)?;
        let ran = crate::models::gate::run_with(&mut gate, || {
            passes.run(micro_batches, &Here(cx.comm), &mut clock)
        });
        // A collective that failed inside a pass is the step's error, whole.
        if let Some(error) = gate.error.take() {
            return Err(error);
        }
        let ran = ran?;
        gate.release_all()?;
        ran
    } else {
        passes.run(micro_batches, &Here(cx.comm), &mut clock)?
    };
    let Ran {
        grads,
        loss_sum,
        streamed,
    } = ran;
    // Only what trains is averaged, clipped and applied: a frozen parameter's gradient (when
    // the pass made one) is dropped here, before it crosses the wire.
    let trainable = |mut grads: Vec<Option<Tensor>>| {
        params
            .trainable()
            .map(|(i, var)| grads[i].take().map_or_else(|| var.zeros_like(), Ok))
            .collect::<Result<Vec<_>, _>>()
    };
    let mut grad_norm = None;
    let stop = match optimizer.plan() {
        Some(plan) => {
            let (mut pieces, vote) = match streamed {
                Some(reduced) => reduced,
                None => {
                    let grads = trainable(grads)?;
                    super::sharded::reduce_scatter_gradients(cx, plan, grads, stop_vote)?
                }
            };
            clock.lap(Phase::Sync)?;
            if let Some(max_norm) = cx.grad_clip_norm {
                let norm = super::sharded::clip_pieces(cx, &mut pieces, max_norm)?;
                grad_norm = Some(Tensor::new(norm as f32, &candle_core::Device::Cpu)?);
            }
            let stop = match cx.sharded_parameters {
                Some(_) => super::full::update(cx, optimizer, &pieces, lr, stop_vote)?,
                None => super::sharded::update_and_gather(cx, optimizer, &pieces, lr, vote)?,
            };
            clock.lap(Phase::Update)?;
            stop
        }
        None => {
            let mut grads = trainable(grads)?;
            let stop = average_gradients(cx.comm, &mut grads, cx.bucket_bytes, stop_vote)?;
            clock.lap(Phase::Sync)?;
            if let Some(max_norm) = cx.grad_clip_norm {
                grad_norm = Some(clip_grad_norm(&mut grads, max_norm)?);
            }
            optimizer.step(params, &grads, lr)?;
            clock.lap(Phase::Update)?;
            stop
        }
    };
    if let Some(phases) = phases {
        clock.finish(phases)?;
    }
    let loss_sum = loss_sum.map_or_else(|| no_loss(cx), Ok)?;
    Ok(StepResult {
        loss_sum,
        samples: n_step,
        stop,
        grad_norm,
    })
}

/// What a step's passes need; how their buckets are reduced (here, or by the collectives'
/// own thread, see `overlap`) is [`Passes::run`]'s to say.
struct Passes<'a> {
    model: &'a dyn Model,
    shards: Option<&'a ShardPool>,
    weights: &'a PartWeights,
    /// Parameters sharded (`"full"`): the passes gather them.
    sharded: bool,
    /// With a sharded optimizer, the last micro-batch's buckets are reduced as its backward
    /// forms them (see `streamed`).
    streamed: Option<&'a ShardPlan>,
    stop_vote: bool,
}

/// What the passes gave: the gradients summed over the micro-batches (all but the streamed
/// last one's), Σ loss·n, and this rank's pieces of the streamed buckets when reduced.
struct Ran {
    grads: Vec<Option<Tensor>>,
    loss_sum: Option<Tensor>,
    streamed: Option<Reduced>,
}

impl Passes<'_> {
    /// Forward and backward over each micro-batch (each on its row shards side by side), the
    /// last one's buckets reduced through `via` when streamed.
    fn run<V: BucketVia>(
        &self,
        micro_batches: &[MicroBatch],
        via: &V,
        clock: &mut PhaseClock,
    ) -> Result<Ran, StepError> {
        let rows = |b: &MicroBatch| b.targets.dims().first().copied().unwrap_or(1);
        let params = self.model.params();
        let mut ran = Ran {
            grads: vec![None; params.len()],
            loss_sum: None,
            streamed: None,
        };
        let timed = clock.timed();
        for (k, batch) in micro_batches.iter().enumerate() {
            let ranges = super::shards::ranges(self.shards, rows(batch));
            let shard = |i: usize, sink: Option<&mut dyn GradientSink>| {
                let part = batch.rows(ranges[i].clone())?;
                let weights = self.weights.of_part(&part, ranges[i].len())?;
                let how = (timed, self.sharded);
                shard_forward_backward(self.model, &part, weights, how, sink)
            };
            let results = match (self.streamed, self.shards, ranges.len()) {
                // The last micro-batch's buckets reduced while its backward runs.
                (Some(plan), pool, parts) if k + 1 == micro_batches.len() => {
                    let earlier = std::mem::take(&mut ran.grads);
                    let (results, reduced) = super::streamed::last_micro_batch(
                        params,
                        (plan, via),
                        earlier,
                        self.stop_vote,
                        pool,
                        parts,
                        |i, sink| shard(i, Some(sink)),
                    )?;
                    ran.streamed = reduced;
                    results.into_iter().map(Ok).collect()
                }
                (_, Some(pool), parts) if parts > 1 => pool.run(parts, |i| shard(i, None)),
                _ => vec![shard(0, None)],
            };
            let mut forward_end: Option<Mark> = None;
            for result in results {
                let result = result?;
                forward_end = match (forward_end, result.forward_end) {
                    (Some(a), Some(b)) => Some(a.later(b)),
                    (a, b) => b.or(a),
                };
                accumulate(&mut ran.grads, result.grads)?;
                ran.loss_sum = Some(match ran.loss_sum.take() {
                    Some(s) => (s + result.loss_sum)?,
                    None => result.loss_sum,
                });
            }
            // Shards interleave their phases: the forward ends when the slowest shard's does.
            clock.split(forward_end)?;
        }
        Ok(ran)
    }
}

/// Adds a shard's (or micro-batch's) gradients to the step's, in the order they come (the
/// same sums whatever runs them). CPU f32 gradients are added in one parallel pass.
pub(super) fn accumulate(
    acc: &mut [Option<Tensor>],
    new: Vec<Option<Tensor>>,
) -> candle_core::Result<()> {
    let host = |t: &Tensor| ddpjob_kernels::applies(t) && t.is_contiguous();
    let mut pairs = Vec::new();
    for (i, (slot, g)) in acc.iter_mut().zip(new).enumerate() {
        match (slot.take(), g) {
            (Some(a), Some(g)) if host(&a) && host(&g) => pairs.push((i, a, g)),
            (Some(a), Some(g)) => *slot = Some((a + g)?),
            (a, g) => *slot = g.or(a),
        }
    }
    if pairs.is_empty() {
        return Ok(());
    }
    let operands: Vec<(&Tensor, &Tensor)> = pairs.iter().map(|(_, a, g)| (a, g)).collect();
    let sums = ddpjob_kernels::add_pairs(&operands)?;
    for ((i, ..), sum) in pairs.iter().zip(sums) {
        acc[*i] = Some(sum);
    }
    Ok(())
}

/// What one shard of a micro-batch contributes: its parameters' gradients (weighted by its
/// share of the step's rows), Σ loss·rows, and where its forward pass ended (when timed).
pub(super) struct ShardResult {
    pub(super) grads: Vec<Option<Tensor>>,
    pub(super) loss_sum: Tensor,
    forward_end: Option<Mark>,
}

/// How a part of the step (a shard of a micro-batch) weighs: the factor of its mean loss's
/// gradient, and of its mean loss in the step's Σ loss·n.
enum PartWeights {
    /// Every target scores: a part weighs by its rows (n / n_step; its loss by n).
    Rows { n_step: usize },
    /// A part weighs by its scored targets over the step's on all ranks (times the world size,
    /// which the average over ranks divides out again); its loss so that Σ loss·n over all
    /// ranks is the global mean times the global rows.
    Scored { world: f64, scored: f64, rows: f64 },
}

impl PartWeights {
    fn of(
        cx: &StepContext,
        micro_batches: &[MicroBatch],
        n_step: usize,
    ) -> Result<PartWeights, StepError> {
        if !cx.masked_targets {
            return Ok(PartWeights::Rows { n_step });
        }
        let mut totals = [0.0, n_step as f64];
        for batch in micro_batches {
            totals[0] += crate::task::scored_targets(&batch.targets)? as f64;
        }
        cx.comm.all_reduce_sum_f64(&mut totals)?;
        Ok(PartWeights::Scored {
            world: cx.comm.world_size() as f64,
            scored: totals[0],
            rows: totals[1],
        })
    }

    /// (gradient scale, loss weight) of `part`, `n` rows.
    fn of_part(&self, part: &MicroBatch, n: usize) -> Result<(f64, f64), StepError> {
        match *self {
            PartWeights::Rows { n_step } => Ok((n as f64 / n_step as f64, n as f64)),
            PartWeights::Scored { scored: 0.0, .. } => Ok((0.0, 0.0)),
            PartWeights::Scored {
                world,
                scored,
                rows,
            } => {
                let mine = crate::task::scored_targets(&part.targets)? as f64;
                Ok((mine * world / scored, mine * rows / scored))
            }
        }
    }
}

/// `timed`: the forward's end is marked (see `phase_clock`). With a `sink`, the gradients go
/// there as the pass forms them, none into the result.
pub(super) fn shard_forward_backward(
    model: &dyn Model,
    batch: &MicroBatch,
    (scale, loss_weight): (f64, f64),
    (timed, sharded): (bool, bool),
    sink: Option<&mut dyn GradientSink>,
) -> Result<ShardResult, StepError> {
    let (loss, logged, pass) = match model.train_pass(&batch.inputs, &batch.targets, &batch.mode)? {
        Some(pass) => (pass.loss().clone(), pass.logged()?, Some(pass)),
        // Autograd over `Model::loss` would read every parameter, which sharded ones do not
        // hold between their gathers.
        None if sharded => {
            let why = "sharding = \"full\": the model gave no training pass that gathers its \
                       blocks (Model::train_pass returned None after Model::shard_parameters)";
            return Err(candle_core::Error::Msg(why.into()).into());
        }
        None => {
            let (loss, logged) =
                model.loss_with_terms(&batch.inputs, &batch.targets, &batch.mode)?;
            (loss, logged, None)
        }
    };
    let forward_end = match timed {
        true => Some(Mark::now(loss.device())?),
        false => None,
    };
    let grads = match (pass, sink) {
        (Some(pass), Some(sink)) => {
            pass.backward_to(scale, sink)?;
            Vec::new()
        }
        (Some(pass), None) => pass.backward(scale)?,
        (None, sink) => {
            // One launch less each way on a GPU when the shard is the whole step (x·1 = x).
            let store = match scale {
                1.0 => loss.backward()?,
                _ => (&loss * scale)?.backward()?,
            };
            let grads = model.params().vars().map(|v| store.get(v).cloned());
            match sink {
                Some(sink) => {
                    crate::models::hand_over_all(grads, sink)?;
                    Vec::new()
                }
                None => grads.collect(),
            }
        }
    };
    Ok(ShardResult {
        grads,
        loss_sum: (logged * loss_weight)?,
        forward_end,
    })
}

impl MicroBatch {
    /// Rows `range` of the micro-batch (the whole of it, uncopied, for all its rows).
    fn rows(&self, range: std::ops::Range<usize>) -> candle_core::Result<MicroBatch> {
        let len = range.len();
        if range.start == 0 && self.inputs.dims().first() == Some(&len) {
            return Ok(MicroBatch {
                inputs: self.inputs.clone(),
                targets: self.targets.clone(),
                mode: self.mode.clone(),
            });
        }
        let mode = match &self.mode {
            Mode::Train { row_seeds } => Mode::Train {
                row_seeds: row_seeds[range.clone()].to_vec(),
            },
            Mode::Eval => Mode::Eval,
        };
        Ok(MicroBatch {
            inputs: self.inputs.narrow(0, range.start, len)?,
            targets: self.targets.narrow(0, range.start, len)?,
            mode,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
}
