//! Evaluation on the evaluation split: each rank takes an unpadded shard, sums of loss and
//! correct predictions per target are all-reduced, so every target counts exactly once.

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

/// Evaluates on the samples of `task`'s evaluation split that `batches` serves, or on
/// `batches_limit` batches of them spread evenly over it (the same ones every time).
pub fn evaluate(
    model: &dyn Model,
    task: &dyn Task,
    batches: &dyn BatchSource,
    comm: &dyn Communicator,
    batch_size: usize,
    batches_limit: Option<usize>,
    shards: Option<&ShardPool>,
) -> Result<EvalResult, TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let eval_len = task.eval_len();
    let picked = batches_limit.map_or(eval_len, |b| (b * batch_size).min(eval_len));
    let index = |j: usize| j * eval_len / picked.max(1);
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
    let samples = sums[2].max(1.0);
    Ok(EvalResult {
        loss: sums[0] / samples,
        accuracy: sums[1] / samples,
        samples: sums[2] as usize,
        metrics: task.metrics(),
    })
}
