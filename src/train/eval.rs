//! Evaluation on the test split: each rank takes an unpadded shard, sums of loss and correct
//! predictions are all-reduced, so every test sample counts exactly once.

use crate::comm::Communicator;
use crate::data::Batches;
use crate::models::{Model, loss_sum_and_correct};

use super::TrainError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: usize,
}

/// Evaluates on the `test_len` samples of the test split that `batches` serves.
pub fn evaluate(
    model: &dyn Model,
    batches: &Batches,
    test_len: usize,
    comm: &dyn Communicator,
    batch_size: usize,
) -> Result<EvalResult, TrainError> {
    let n = test_len;
    let (rank, world) = (comm.rank(), comm.world_size());
    let shard: Vec<usize> = (rank..n).step_by(world).collect();
    let mut sums = [0.0f64; 3];
    for chunk in shard.chunks(batch_size) {
        let (xs, ys) = batches.test(chunk)?;
        let logits = model.forward(&xs)?;
        let (loss, correct) = loss_sum_and_correct(&logits, &ys)?;
        sums[0] += loss;
        sums[1] += correct as f64;
        sums[2] += chunk.len() as f64;
    }
    comm.all_reduce_sum_f64(&mut sums)?;
    let samples = sums[2].max(1.0);
    Ok(EvalResult {
        loss: sums[0] / samples,
        accuracy: sums[1] / samples,
        samples: sums[2] as usize,
    })
}
