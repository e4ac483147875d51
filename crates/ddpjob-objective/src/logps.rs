//! A completion's log-probability under a language model: Σ over its scored targets of
//! log softmax(logits)[target] (TRL's `per_token_logps.sum(1)` over the completion mask),
//! from the model's logits, differentiable.

use candle_core::{D, DType, Result, Tensor};
use ddpjob_seam::task::IGNORE_TARGET;
use ddpjob_seam::{Mode, Model};

/// Each row's summed log-probability of its scored targets [m] (f32), for inputs and targets
/// [m, t] (targets [`IGNORE_TARGET`] where nothing scores).
pub fn row_logps(model: &dyn Model, xs: &Tensor, ys: &Tensor, mode: &Mode) -> Result<Tensor> {
    let logits = model.forward(xs, mode)?.to_dtype(DType::F32)?;
    let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let ys = ys.to_dtype(DType::U32)?;
    let scored = ys.ne(IGNORE_TARGET)?;
    let safe = scored.where_cond(&ys, &ys.zeros_like()?)?;
    let picked = log_probs.gather(&safe.unsqueeze(D::Minus1)?, D::Minus1)?;
    let picked = picked.squeeze(D::Minus1)?;
    (picked * scored.to_dtype(DType::F32)?)?.sum(D::Minus1)
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
