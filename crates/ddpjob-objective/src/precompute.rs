//! `train.dpo.precompute_reference`: the reference's log-probability of every completion of
//! both splits, computed once before training (TRL's `precompute_ref_log_probs`) and kept in
//! the job directory, so training holds one model and runs one forward pass less per row. Rank
//! r scores pairs r, r + W, ...; one all-reduce of the values (each in its own slot, zeros
//! elsewhere: exact) gives every rank all of them.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use ddpjob_seam::Model;
use ddpjob_seam::task::{DataError, Task};

use super::reference::{Reference, ReferenceTable, row_keys};

/// Pairs scored at once.
const PAIRS_AT_ONCE: usize = 8;

/// Why the table could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PrecomputeError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error("{0}")]
    Collective(String),
}

/// The table of `reference`'s log-probabilities of every completion of `task`'s pairs
/// (`policy` is the model adapters-off runs), this rank (`rank` of `world`) scoring its share
/// and `all_reduce` summing a buffer over the ranks; saved at `path` by the caller.
pub fn precompute(
    reference: &Reference,
    policy: &dyn Model,
    task: &dyn Task,
    device: &Device,
    (rank, world): (usize, usize),
    all_reduce: &mut dyn FnMut(&mut [f64]) -> std::result::Result<(), String>,
    path: PathBuf,
) -> std::result::Result<ReferenceTable, PrecomputeError> {
    let batches = task.batches(device)?;
    let splits = [task.train_len(), task.eval_len()];
    let load =
        |split: usize, pairs: &[usize]| -> std::result::Result<(Tensor, Tensor), DataError> {
            let (xs, ys) = match split {
                0 => batches.train(0, pairs)?,
                _ => batches.eval(pairs)?,
            };
            let (n, t) = (xs.dim(0)?, xs.dim(2)?);
            Ok((xs.reshape((2 * n, t))?, ys.reshape((2 * n, t))?))
        };
    // Two values a pair, training's then validation's.
    let offsets = [0, 2 * splits[0]];
    let mut values = vec![0.0f64; 2 * (splits[0] + splits[1])];
    for (split, &len) in splits.iter().enumerate() {
        let mine: Vec<usize> = (rank..len).step_by(world.max(1)).collect();
        for chunk in mine.chunks(PAIRS_AT_ONCE) {
            let (xs, ys) = load(split, chunk)?;
            let logps = reference.row_logps(policy, &xs, &ys)?;
            for (k, &pair) in chunk.iter().enumerate() {
                let at = offsets[split] + 2 * pair;
                values[at] = f64::from(logps[2 * k]);
                values[at + 1] = f64::from(logps[2 * k + 1]);
            }
        }
    }
    if world > 1 {
        all_reduce(&mut values).map_err(PrecomputeError::Collective)?;
    }
    let mut table = HashMap::new();
    for (split, &len) in splits.iter().enumerate() {
        let all: Vec<usize> = (0..len).collect();
        for chunk in all.chunks(PAIRS_AT_ONCE) {
            let (xs, ys) = load(split, chunk)?;
            for (k, key) in row_keys(&xs, &ys)?.into_iter().enumerate() {
                if let Some(key) = key {
                    let at = offsets[split] + 2 * chunk[0] + k;
                    table.insert(key, values[at] as f32);
                }
            }
        }
    }
    Ok(ReferenceTable::new(table, path))
}
