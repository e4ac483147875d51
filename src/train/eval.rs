//! Evaluation on the evaluation split: each rank takes an unpadded shard, sums of loss and
//! correct predictions per target are all-reduced, so every target counts exactly once. In
//! world-size-invariant training every batch is scored alone on one thread and the batches'
//! sums are added in batch order on every rank: the same metrics, bit for bit, on any number
//! of workers.

use candle_core::Tensor;

use crate::comm::Communicator;
use crate::models::Model;
use crate::task::{BatchSource, Metric, Task};

use super::TrainError;
use super::shards::ShardPool;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    pub loss: f64,
    pub accuracy: f64,
    /// Targets scored (samples for a classifier, tokens for a language model).
    pub samples: usize,
    /// What the task reports of it (see [`Task::metrics`]).
    pub metrics: &'static [Metric],
}

impl EvalResult {
    /// The value of `metric` when the task declares it.
    pub fn get(&self, metric: Metric) -> Option<f64> {
        self.metrics
            .contains(&metric)
            .then(|| metric.value(self.loss, self.accuracy))
    }

    pub fn perplexity(&self) -> Option<f64> {
        self.get(Metric::Perplexity)
    }

    /// `val loss 1.6527, perplexity 5.221, next-token accuracy 45.12%`.
    pub fn describe(&self) -> String {
        Metric::describe_all(self.metrics, self.loss, self.accuracy)
    }
}

/// How a rank's evaluation batches use its threads.
#[derive(Debug, Clone, Copy)]
pub enum EvalThreads<'a> {
    /// Each batch's rows cut over the pool's threads (whole without one).
    Rows(Option<&'a ShardPool>),
    /// World-size-invariant: every batch of the split (the same batches whatever the world
    /// size) scored alone on one thread, a rank's batches side by side on its threads when
    /// `cpu`, each batch's sums kept apart until every rank has them all.
    Pieces { cpu: bool },
}

/// Evaluates on the samples of `task`'s evaluation split that `batches` serves, or on
/// `batches_limit` batches of them spread evenly over it (the same ones every time).
pub fn evaluate(
    model: &dyn Model,
    task: &dyn Task,
    batches: &dyn BatchSource,
    comm: &dyn Communicator,
    (batch_size, batches_limit): (usize, Option<usize>),
    threads: EvalThreads<'_>,
) -> Result<EvalResult, TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let eval_len = task.eval_len();
    let picked = batches_limit.map_or(eval_len, |b| (b * batch_size).min(eval_len));
    let index = |j: usize| j * eval_len / picked.max(1);
    let shards = match threads {
        EvalThreads::Rows(shards) => shards,
        EvalThreads::Pieces { cpu } => {
            let all: Vec<usize> = (0..picked).map(index).collect();
            let pieces: Vec<&[usize]> = all.chunks(batch_size.max(1)).collect();
            let sums = in_pieces(model, batches, comm, &pieces, cpu)?;
            return Ok(result(task, sums));
        }
    };
    let shard: Vec<usize> = (rank..picked).step_by(world).map(index).collect();
    let mut sums = [0.0f64; 3];
    for chunk in shard.chunks(batch_size) {
        let (xs, ys) = batches.eval(chunk)?;
        let ranges = super::shards::ranges(shards, chunk.len());
        let part = |i: usize| -> candle_core::Result<[f64; 3]> {
            let r = &ranges[i];
            let (xs, ys) = (
                xs.narrow(0, r.start, r.len())?,
                ys.narrow(0, r.start, r.len())?,
            );
            let (loss, correct) = model.score(&xs, &ys)?;
            let scored = crate::task::scored_targets(&ys)?;
            Ok([loss, correct as f64, scored as f64])
        };
        let parts = match shards {
            Some(pool) if ranges.len() > 1 => pool.run(ranges.len(), part),
            _ => vec![part(0)],
        };
        for part in parts {
            for (sum, v) in sums.iter_mut().zip(part?) {
                *sum += v;
            }
        }
    }
    comm.all_reduce_sum_f64(&mut sums)?;
    Ok(result(task, sums))
}

/// Sums of loss, correct predictions and scored targets over `pieces` (the split's batches),
/// rank r scoring pieces r, r + W, ...: each piece alone on one thread, its three sums in its
/// own slots of a buffer that is zero elsewhere on every other rank (so the all-reduce adds
/// only zeros to them: exact), then added in piece order, the same on every rank.
fn in_pieces(
    model: &dyn Model,
    batches: &dyn BatchSource,
    comm: &dyn Communicator,
    pieces: &[&[usize]],
    cpu: bool,
) -> Result<[f64; 3], TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mine: Vec<usize> = (rank..pieces.len()).step_by(world).collect();
    let side_by_side = if cpu { rayon::current_num_threads() } else { 1 };
    let mut slots = vec![0.0f64; 3 * pieces.len()];
    for group in mine.chunks(side_by_side.max(1)) {
        let loaded = group
            .iter()
            .map(|&p| batches.eval(pieces[p]))
            .collect::<Result<Vec<(Tensor, Tensor)>, _>>()?;
        let score = |i: usize| -> candle_core::Result<[f64; 3]> {
            let (xs, ys) = &loaded[i];
            let (loss, correct) = model.score(xs, ys)?;
            let scored = crate::task::scored_targets(ys)?;
            Ok([loss, correct as f64, scored as f64])
        };
        for (&p, sums) in
            group
                .iter()
                .zip(super::invariant::one_thread_each(group.len(), cpu, score))
        {
            slots[3 * p..3 * p + 3].copy_from_slice(&sums?);
        }
    }
    if world > 1 {
        comm.all_reduce_sum_f64(&mut slots)?;
    }
    let mut sums = [0.0f64; 3];
    for piece in slots.chunks_exact(3) {
        for (sum, v) in sums.iter_mut().zip(piece) {
            *sum += v;
        }
    }
    Ok(sums)
}

fn result(task: &dyn Task, sums: [f64; 3]) -> EvalResult {
    let samples = sums[2].max(1.0);
    EvalResult {
        loss: sums[0] / samples,
        accuracy: sums[1] / samples,
        samples: sums[2] as usize,
        metrics: task.metrics(),
    }
}
