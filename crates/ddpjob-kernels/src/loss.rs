//! The loss every task shares: mean cross-entropy of logits against integer targets, with
//! [`IGNORE_TARGET`] positions scoring nothing (PyTorch's `ignore_index`). On f32 CPU tensors
//! and on a GPU it runs the fused row kernels ([`crate::row_cross_entropy`],
//! [`crate::scored_mean`]); elsewhere candle's ops. It lives with the kernels, not the task,
//! because the kernels need its ignored-target convention and must not import a task.

use candle_core::{D, DType, Result as TensorResult, Tensor};

pub use crate::cross_entropy::IGNORE_TARGET;

/// Mean cross-entropy of `logits` [.., classes] against integer `targets` [..], over the
/// targets that are not [`IGNORE_TARGET`] (0 when none is).
/// On a GPU one kernel each way over logits in f32 or bf16 (see
/// `kernels::row_cross_entropy`), and one for the mean (`kernels::scored_mean`).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> TensorResult<Tensor> {
    let classes = logits.dim(D::Minus1)?;
    let (logits, targets) = (logits.reshape(((), classes))?, targets.flatten_all()?);
    if crate::row_cross_entropy_applies(&logits) {
        let targets = targets.to_dtype(DType::U32)?;
        let losses = crate::row_cross_entropy(&logits, &targets)?;
        return crate::scored_mean(&losses, &targets);
    }
    if !may_ignore(&targets)? {
        return candle_nn::loss::cross_entropy(&logits, &targets);
    }
    let (picked, scored) = masked_log_likelihoods(&logits, &targets)?;
    let count = scored.sum_all()?.maximum(1f64)?;
    picked.sum_all()?.neg()?.broadcast_div(&count)
}

/// Whether `targets` may hold [`IGNORE_TARGET`]: read on the CPU, assumed on a device (where
/// reading would wait for it).
fn may_ignore(targets: &Tensor) -> TensorResult<bool> {
    if !targets.device().is_cpu() {
        return Ok(true);
    }
    Ok(targets
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_vec1::<u32>()?
        .contains(&IGNORE_TARGET))
}

/// 1 (u8) where a u32 target scores, 0 where it is [`IGNORE_TARGET`].
fn scoring(targets: &Tensor) -> TensorResult<Tensor> {
    targets.ne(&Tensor::full(
        IGNORE_TARGET,
        targets.shape(),
        targets.device(),
    )?)
}

/// Per target of `targets` [n]: log softmax(`logits` [n, classes]) at the target (0 where
/// ignored), and 1 where it scores, 0 where ignored (f32).
fn masked_log_likelihoods(logits: &Tensor, targets: &Tensor) -> TensorResult<(Tensor, Tensor)> {
    let targets = targets.to_dtype(DType::U32)?;
    let kept = scoring(&targets)?;
    let safe = kept.where_cond(&targets, &targets.zeros_like()?)?;
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let scored = kept.to_dtype(DType::F32)?;
    let picked = log_probs
        .gather(&safe.unsqueeze(1)?, 1)?
        .squeeze(1)?
        .to_dtype(DType::F32)?
        .mul(&scored)?;
    Ok((picked, scored))
}

/// The targets of `targets` that score (are not [`IGNORE_TARGET`]).
pub fn scored_targets(targets: &Tensor) -> TensorResult<usize> {
    if !may_ignore(targets)? {
        return Ok(targets.elem_count());
    }
    let ignore = Tensor::full(IGNORE_TARGET, targets.shape(), targets.device())?;
    let scored = targets.to_dtype(DType::U32)?.ne(&ignore)?;
    Ok(scored.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as usize)
}

/// Σ cross-entropy and the number of exactly predicted targets, for evaluation; targets that
/// are [`IGNORE_TARGET`] count in neither.
pub fn loss_sum_and_correct(logits: &Tensor, targets: &Tensor) -> TensorResult<(f64, usize)> {
    let classes = logits.dim(D::Minus1)?;
    let (logits, targets) = (logits.reshape(((), classes))?, targets.flatten_all()?);
    let (picked, scored) = masked_log_likelihoods(&logits, &targets)?;
    let loss = -picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    let correct = logits
        .argmax(D::Minus1)?
        .eq(&targets.to_dtype(DType::U32)?)?
        .to_dtype(DType::F32)?
        .mul(&scored)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok((loss, correct as usize))
}
