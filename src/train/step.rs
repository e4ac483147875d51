//! One optimizer step on micro-batches already on the device: forward and backward per
//! micro-batch with weighted accumulation, one gradient average, clipping, the update. Shared by
//! the training loop and `ddpjob bench step`, so the benchmark times exactly what training runs.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::comm::{CommError, Communicator, average_gradients};
use crate::models::{Mode, Model};
use crate::optim::{Optimizer, clip_grad_norm};
use crate::task::cross_entropy;

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
}

/// What one step produced: Σ loss·n over its samples (a scalar, read only at log intervals),
/// the sample count, and whether any rank voted to stop.
pub struct StepResult {
    pub loss_sum: Tensor,
    pub samples: usize,
    pub stop: bool,
}

/// Where a step's time went (for `bench step`); filled only when asked for, since on an
/// accelerator it costs a device synchronisation per phase.
#[derive(Debug, Clone, Copy, Default)]
pub struct Phases {
    pub forward: Duration,
    pub backward: Duration,
    pub sync: Duration,
    pub update: Duration,
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
    mut phases: Option<&mut Phases>,
) -> Result<StepResult, StepError> {
    let params = cx.model.params();
    // Samples (rows) weight the micro-batches; a language model's rows all hold block_size
    // targets, so this is also the weighting by targets.
    let rows = |b: &MicroBatch| b.targets.dims().first().copied().unwrap_or(1);
    let n_step: usize = micro_batches.iter().map(rows).sum();
    let mut grads: Vec<Option<Tensor>> = vec![None; params.len()];
    let mut loss_sum: Option<Tensor> = None;
    let mut clock = PhaseClock::new(cx.device, phases.is_some());
    for batch in micro_batches {
        let n = rows(batch);
        let logits = cx.model.forward(&batch.inputs, &batch.mode)?;
        let loss = cross_entropy(&logits, &batch.targets)?;
        clock.lap(&mut phases, |p| &mut p.forward)?;
        let store = (&loss * (n as f64 / n_step as f64))?.backward()?;
        for (slot, var) in grads.iter_mut().zip(params.vars()) {
            if let Some(g) = store.get(var) {
                *slot = Some(match slot.take() {
                    Some(acc) => (acc + g)?,
                    None => g.clone(),
                });
            }
        }
        let weighted = (loss.detach() * n as f64)?;
        loss_sum = Some(match loss_sum {
            Some(s) => (s + weighted)?,
            None => weighted,
        });
        clock.lap(&mut phases, |p| &mut p.backward)?;
    }
    let mut grads = grads
        .into_iter()
        .zip(params.vars())
        .map(|(g, var)| g.map_or_else(|| var.zeros_like(), Ok))
        .collect::<Result<Vec<_>, _>>()?;
    let stop = average_gradients(cx.comm, &mut grads, cx.bucket_bytes, stop_vote)?;
    clock.lap(&mut phases, |p| &mut p.sync)?;
    if let Some(max_norm) = cx.grad_clip_norm {
        clip_grad_norm(&mut grads, max_norm)?;
    }
    optimizer.step(params, &grads, lr)?;
    clock.lap(&mut phases, |p| &mut p.update)?;
    let loss_sum = loss_sum.map_or_else(|| Tensor::zeros((), DType::F32, cx.device), Ok)?;
    Ok(StepResult {
        loss_sum,
        samples: n_step,
        stop,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Times phases when asked, synchronising the device first so queued work is counted.
struct PhaseClock<'a> {
    device: &'a Device,
    last: Option<Instant>,
}

impl<'a> PhaseClock<'a> {
    fn new(device: &'a Device, on: bool) -> Self {
        PhaseClock {
            device,
            last: on.then(Instant::now),
        }
    }

    fn lap(
        &mut self,
        phases: &mut Option<&mut Phases>,
        field: impl Fn(&mut Phases) -> &mut Duration,
    ) -> candle_core::Result<()> {
        if let (Some(last), Some(p)) = (self.last, phases.as_deref_mut()) {
            self.device.synchronize()?;
            let now = Instant::now();
            *field(p) += now - last;
            self.last = Some(now);
        }
        Ok(())
    }
}
