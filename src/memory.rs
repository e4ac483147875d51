//! Memory per worker: what a job is expected to need at its peak, from the model's size, the
//! optimizer, the sharding, the batch and what the model keeps per sample for its backward
//! (printed by `validate` and at launch, recorded in `summary.json`), and what the kernel says a
//! worker used (`summary.json`'s `peak_rss_bytes`).

use crate::config::{Backend, DeviceChoice, JobSpec, Objective, OptimizerSpec, Sharding};
use crate::models::Model;
pub(crate) use ddpjob_data::host::gb;

/// The process itself: code, thread stacks, the data's buffers and the allocator's slack,
/// fitted to the peaks of eight CPU jobs of an 85 M-parameter GPT (AMD EPYC, 2026-11-26: 1, 2
/// and 4 workers, sharded or not, context 256 and 1024, checkpointing on and off; the
/// estimates are within 10% of each; see docs/src/memory.md).
const RUNTIME_BYTES: u64 = 40_000_000;

/// A worker's expected peak, in bytes, by what holds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Every parameter, in f32 (with `sharding = "full"`, this worker's share of them and
    /// what a pass gathers at once), and a 4-bit base's codes and scales whole
    /// (`[model.quantize]`).
    pub weights: u64,
    /// One gradient per row shard running side by side (a CPU worker's threads; in
    /// world-size-invariant training each piece in flight and the tree's partial sums; with
    /// `sharding = "gradients"` what a streaming pass holds at once), and the averaged
    /// gradient the update runs beside (this worker's 1/W of it when sharded).
    pub gradients: u64,
    /// The optimizer's state (this worker's 1/W of it when sharded).
    pub optimizer: u64,
    /// `train.objective = "dpo"`'s frozen reference: a second copy of the weights for a full
    /// fine-tune (none for LoRA, whose reference is the base, nor for a precomputed one).
    pub reference: u64,
    /// What the batch's training pass keeps for its backward; `None`: the model does not say.
    pub activations: Option<u64>,
    /// The process itself, and the buffers a collective fills (two buckets, beside the
    /// gradients, on more than one worker).
    pub runtime: u64,
    /// Samples per micro-batch and positions per sample, for the description.
    pub batch: usize,
    pub positions: Option<usize>,
    /// The activations and the gradients are never all held at once, so the larger of the
    /// two counts: with `sharding = "full"` every pass goes block by block through autograd,
    /// whose backward drops each block's graph as the reduce-scattered gradient pieces grow.
    pub activations_or_gradients: bool,
}

/// Whether a process training `spec` keeps its memory in one allocator arena (see
/// `ddpjob_kernels::keep_freed_memory`): for a vocabulary of 32,768 tokens or more, whose
/// embedding, its gradient and the head's blocks of logits exceed the 64 MiB a thread's arena
/// holds (Qwen3-0.6B's step: 14.7 → 13.3 s with one arena), not for small ones, where one
/// arena's lock costs more than it saves (the 2-layer MoE fixture: 7.3 → 12 ms).
pub fn one_allocator_arena(spec: &JobSpec) -> bool {
    (spec.model.language())
        .and_then(|l| l.vocab_size)
        .is_some_and(|v| v >= 32_768)
}

/// How a job is laid out, as far as memory goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    pub world: usize,
    /// Threads per worker (row shards on a CPU worker); 1 on a GPU.
    pub threads: usize,
    pub sharding: Sharding,
    pub checkpointing: bool,
}

impl Layout {
    /// `spec`'s layout over `world` workers of `threads` threads.
    pub fn of(spec: &JobSpec, world: usize, threads: usize) -> Layout {
        Layout {
            world,
            threads,
            sharding: spec.distributed.sharding,
            checkpointing: spec.train.activation_checkpointing,
        }
    }
}

/// The estimate for `model` trained as `spec` says, laid out as `layout`.
pub fn estimate(spec: &JobSpec, model: &dyn Model, layout: Layout) -> Estimate {
    let params = model.params();
    let (all, trainable) = (
        params.element_count() as u64,
        params.trainable_element_count() as u64,
    );
    let t = &spec.train;
    // Sharding divides by the workers that share: none on one worker that skips collectives.
    let share = match layout.sharding {
        Sharding::None => 1,
        _ if layout.world > 1 => layout.world as u64,
        _ => 1,
    };
    // Parameters sharded: this worker's pieces, the rest (gathered for a whole pass) and one
    // block at a time.
    let weights = match layout.sharding {
        Sharding::Full if layout.world > 1 => {
            gathered_weights(model, share, overlapped(spec, layout))
        }
        _ => None,
    };
    // Gradients reduce-scattered as the backward forms them: a shard holds the model's
    // largest group in flight and a bucket, not the whole gradient (with accumulation, the
    // earlier micro-batches' sum besides).
    let streamed = match layout.sharding {
        Sharding::Gradients | Sharding::Full if layout.world > 1 => model.stream_gradients(),
        _ => None,
    };
    let (per_shard, earlier) = match streamed {
        Some(held) => {
            let bucket = spec.distributed.bucket_bytes as u64 / 4;
            let earlier = if t.accumulation > 1 { 4 * trainable } else { 0 };
            ((held as u64 + bucket).min(trainable), earlier)
        }
        None => (trainable, 0),
    };
    // World-size-invariant training: the worker's pieces, and how many run at once (one per
    // thread), each with its rows' activations.
    let pieces = spec.virtual_shards().map(|v| {
        let local = (v / layout.world.max(1)).max(1);
        (local, layout.threads.clamp(1, local))
    });
    let shards = match pieces {
        // The pieces in flight, the tree's partial sums (log2 of the pieces) and the sum
        // being formed.
        Some((1, _)) => 1,
        Some((local, in_flight)) => (local.ilog2() as usize + in_flight + 1).min(local + 1) as u64,
        None => layout.threads.clamp(1, t.batch_size.max(1)) as u64,
    };
    let averaged = 4 * trainable / share;
    let state_per_value = match t.optimizer {
        OptimizerSpec::Adam { .. } | OptimizerSpec::AdamW { .. } => 8,
        OptimizerSpec::Sgd { momentum, .. } if momentum > 0.0 => 4,
        OptimizerSpec::Sgd { .. } => 0,
    };
    // A preference pair is two rows (chosen, rejected), each the model's sample.
    let dpo = t.objective == Objective::Dpo;
    let rows_per_sample = if dpo { 2 } else { 1 };
    let live_rows = rows_per_sample
        * match pieces {
            Some((local, in_flight)) => t.batch_size / local * in_flight,
            None => t.batch_size,
        };
    let reference = match dpo && spec.model.lora().is_none() && !t.dpo.precompute_reference {
        true => 4 * all,
        false => 0,
    };
    // Passes in flight, each with what it keeps whatever its rows (stacked experts).
    let passes = match pieces {
        Some((_, in_flight)) => in_flight,
        None => layout.threads.clamp(1, t.batch_size.max(1)),
    };
    let per_pass = model.activation_bytes_per_pass(layout.checkpointing) * passes as f64;
    let activations = model
        .activation_bytes_per_sample(layout.checkpointing)
        .map(|per_sample| (per_sample * live_rows as f64 + per_pass) as u64);
    Estimate {
        weights: weights.unwrap_or(4 * all) + params.packed_bytes() as u64,
        gradients: 4 * per_shard * shards + earlier + averaged,
        optimizer: state_per_value * trainable / share,
        reference,
        activations,
        runtime: RUNTIME_BYTES + collective_buffers(spec, layout, trainable),
        batch: t.batch_size,
        positions: spec.model.language().map(|l| l.block_size),
        activations_or_gradients: weights.is_some(),
    }
}

/// Whether `sharding = "full"`'s collectives overlap the passes (`distributed.overlap_comm`,
/// CPU workers only).
fn overlapped(spec: &JobSpec, layout: Layout) -> bool {
    layout.sharding == Sharding::Full && spec.distributed.overlap_comm && !on_gpus(spec)
}

/// Blocks gathered at once when the collectives overlap the passes: the one in use, the one
/// gathered ahead, and the one before, let go once the collectives' thread gets to it.
const BLOCKS_OVERLAPPED: u64 = 3;

/// A worker's parameter bytes with `sharding = "full"` over `world` workers: every frozen
/// parameter and every trainable one outside the blocks (gathered for a whole pass), the
/// largest block's (gathered; [`BLOCKS_OVERLAPPED`] of them when `overlapped`), and its
/// pieces, 1/W of every trainable value. `None`: the model has no blocks to gather one at a
/// time.
fn gathered_weights(model: &dyn Model, world: u64, overlapped: bool) -> Option<u64> {
    let blocks = model.shard_parameters().ok()?;
    let params = model.params();
    let mut trainable = vec![0u64; params.len()];
    for (i, var) in params.trainable() {
        trainable[i] = var.elem_count() as u64;
    }
    let block = |b: &Vec<usize>| b.iter().map(|&i| trainable[i]).sum::<u64>();
    let in_blocks: u64 = blocks.iter().map(block).sum();
    let largest = blocks.iter().map(block).max().unwrap_or(0);
    let all = params.element_count() as u64;
    let trained: u64 = trainable.iter().sum();
    let gathered = largest * if overlapped { BLOCKS_OVERLAPPED } else { 1 };
    Some(4 * (all - in_blocks + gathered + trained / world))
}

/// Whether `spec`'s workers run on GPUs: a CUDA build with `device = "auto"` may find some,
/// counted as if it does.
fn on_gpus(spec: &JobSpec) -> bool {
    match spec.distributed.device {
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => cfg!(feature = "cuda"),
        DeviceChoice::Cpu => false,
    }
}

/// Two buckets' worth of buffers (a bucket and its copy on the wire), when there are
/// collectives to run, and two more of gradients waiting to be reduced when the collectives
/// overlap the passes; world-size-invariant training's tree sum of the ranks' gradient sums.
fn collective_buffers(spec: &JobSpec, layout: Layout, trainable: u64) -> u64 {
    let d = &spec.distributed;
    let collectives = layout.world > 1 || d.always_collectives;
    // NCCL's tree sum all-gathers every rank's sum; tcp's partners sum in place.
    let all_gather = d.backend == Backend::Nccl || (d.backend == Backend::Auto && on_gpus(spec));
    match (collectives, d.world_size_invariant) {
        // The ranks' gradient sums side by side, then each apart.
        (true, true) if all_gather => 2 * layout.world as u64 * 4 * trainable,
        // The rank's sum flattened, then taken apart.
        (true, true) => 2 * 4 * trainable,
        (true, false) => {
            let buckets = if overlapped(spec, layout) { 4 } else { 2 };
            buckets * (spec.distributed.bucket_bytes as u64).min(4 * trainable)
        }
        (false, _) => 0,
    }
}

impl Estimate {
    /// The sum, when every part is known.
    pub fn total(&self) -> Option<u64> {
        let known = self.weights + self.optimizer + self.reference + self.runtime;
        let a = self.activations?;
        Some(match self.activations_or_gradients {
            true => known + a.max(self.gradients),
            false => known + a + self.gradients,
        })
    }

    /// `weights 0.34 GB, gradients 0.68 GB, optimizer 0.68 GB, activations 0.19 GB (batch 1 x
    /// 256 positions), runtime 0.12 GB = 2.02 GB`.
    pub fn describe(&self) -> String {
        let batch = match self.positions {
            Some(t) => format!("batch {} x {t} positions", self.batch),
            None => format!("batch {}", self.batch),
        };
        let activations = match self.activations {
            Some(a) => format!("activations {} ({batch})", gb(a)),
            None => "activations not estimated (the model does not say)".into(),
        };
        let total = match (self.total(), self.activations_or_gradients) {
            (Some(total), false) => format!(" = {}", gb(total)),
            (Some(total), true) => format!(
                " = {} (the activations freed block by block as the gradients form: the larger \
                 counted)",
                gb(total)
            ),
            (None, _) => String::new(),
        };
        let reference = match self.reference {
            0 => String::new(),
            r => format!(", reference {} (a frozen copy)", gb(r)),
        };
        format!(
            "weights {}, gradients {}, optimizer {}{reference}, {activations}, runtime {}{total}",
            gb(self.weights),
            gb(self.gradients),
            gb(self.optimizer),
            gb(self.runtime)
        )
    }
}

pub(crate) mod fit;

#[cfg(test)]
mod tests;
