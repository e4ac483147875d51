//! A completion's log-probability under a language model: Σ over its scored targets of
//! log softmax(logits)[target] (TRL's `per_token_logps.sum(1)` over the completion mask),
//! differentiable, as the model computes it (`Model::row_log_likelihoods`); and where each
//! row's scored targets end.

use candle_core::{DType, Result, Tensor};
use ddpjob_seam::task::IGNORE_TARGET;
use ddpjob_seam::{Mode, Model};

/// Each row's summed log-probability of its scored targets `[m]` (f32), for inputs and targets
/// `[m, t]` (targets [`IGNORE_TARGET`] where nothing scores): the model's
/// [`Model::row_log_likelihoods`].
pub fn row_logps(model: &dyn Model, xs: &Tensor, ys: &Tensor, mode: &Mode) -> Result<Tensor> {
    model.row_log_likelihoods(xs, ys, mode)
}

/// Each row's scored targets and the length it needs (its last scored target's position + 1;
/// 0 when none scores), read on the host.
pub fn row_extents(ys: &Tensor) -> Result<Vec<(usize, usize)>> {
    let rows = ys.to_dtype(DType::U32)?.to_vec2::<u32>()?;
    Ok(rows
        .iter()
        .map(|row| {
            let scored = row.iter().filter(|&&y| y != IGNORE_TARGET).count();
            let len = row
                .iter()
                .rposition(|&y| y != IGNORE_TARGET)
                .map_or(0, |p| p + 1);
            (scored, len)
        })
        .collect())
}
