//! DPO through the policy's own training pass (`Model::train_pass`), for what only such a
//! pass does: `train.activation_checkpointing`, whose pass keeps each block's input and
//! recomputes the block in its backward. The DPO loss is a function of each row's summed
//! log-likelihood, and a pass over one row gives exactly that (its mean cross-entropy over the
//! row's scored targets, times −their count). So every row of the batch gets a pass of its own
//! (its row cut to its last scored target), the loss's gradient with respect to each row's
//! log-likelihood is taken on the small graph of [`super::dpo_loss::score`], and each pass's
//! backward runs scaled by it: Σ_r ∂L/∂logp_r · ∇logp_r, the gradient autograd would give over
//! the batch, but for rounding (a row computed alone, not beside the batch's others).

use candle_core::{DType, Result, Tensor, Var};
use ddpjob_seam::{Mode, Model, TrainPass};

use super::dpo::Dpo;
use super::dpo_loss::{LOGGED, score};
use super::logps::row_extents;

/// The passes of a batch's rows and how each one's loss weighs in the DPO loss.
pub(crate) struct RowPasses<'a> {
    /// Each scored row's pass, and ∂L/∂(its mean cross-entropy).
    passes: Vec<(Box<dyn TrainPass + 'a>, f64)>,
    loss: Tensor,
    logged: Tensor,
    /// The policy's parameters: a batch with no scored row still answers for each.
    params: usize,
}

impl Dpo {
    /// The batch's passes, row by row; `None` when the policy has no pass of its own (autograd
    /// over [`Model::loss_with_terms`] then does it all).
    pub(crate) fn row_passes(
        &self,
        xs: &Tensor,
        ys: &Tensor,
        mode: &Mode,
    ) -> Result<Option<RowPasses<'_>>> {
        let (rows, targets, mode) = Self::rows(xs, ys, mode)?;
        let n = xs.dim(0)?;
        let seeds = match &mode {
            Mode::Train { row_seeds } => Some(row_seeds.clone()),
            Mode::Eval => None,
        };
        let extents = row_extents(&targets)?;
        let mut passes = Vec::with_capacity(2 * n);
        let mut logps = vec![0f32; 2 * n];
        for (r, &(scored, len)) in extents.iter().enumerate() {
            if scored == 0 {
                continue;
            }
            let x = rows.narrow(0, r, 1)?.narrow(1, 0, len)?.contiguous()?;
            let y = targets.narrow(0, r, 1)?.narrow(1, 0, len)?.contiguous()?;
            let row_mode = match &seeds {
                Some(s) => Mode::Train {
                    row_seeds: vec![s[r]],
                },
                None => Mode::Eval,
            };
            // Kept until the pairs are scored: nothing large held from each forward.
            let pass =
                ddpjob_seam::row_passes::within(|| self.policy.train_pass(&x, &y, &row_mode));
            let Some(pass) = pass? else {
                return Ok(None);
            };
            let mean = pass.loss().to_dtype(DType::F32)?.to_scalar::<f32>()?;
            logps[r] = -mean * scored as f32;
            passes.push((r, scored, pass));
        }
        let reference = self
            .reference
            .row_logps(self.policy.as_ref(), &rows, &targets)?;
        let lengths: Vec<f32> = extents.iter().map(|&(s, _)| s as f32).collect();
        let device = xs.device();
        let pairs = |v: Vec<f32>| Tensor::from_vec(v, (n, 2), device);
        let policy = Var::from_tensor(&pairs(logps)?)?;
        let scored = score(
            &self.settings,
            policy.as_tensor(),
            &pairs(reference)?,
            &pairs(lengths)?,
        )?;
        let loss = scored.losses.mean_all()?;
        let d_logps = loss.backward()?;
        let d_logps = match d_logps.get(&policy) {
            Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0.0; 2 * n],
        };
        let sums = scored.sums()?;
        let mut logged = vec![loss.to_dtype(DType::F64)?.to_scalar::<f64>()? as f32];
        logged.extend(sums.iter().map(|s| (s / n.max(1) as f64) as f32));
        let logged = Tensor::from_vec(logged, 1 + LOGGED.len(), device)?;
        let passes = passes
            .into_iter()
            // logp_r = −scored_r · loss_r: ∂L/∂loss_r = −scored_r · ∂L/∂logp_r.
            .map(|(r, scored, pass)| (pass, -(scored as f64) * f64::from(d_logps[r])))
            .collect();
        Ok(Some(RowPasses {
            passes,
            loss: loss.detach(),
            logged,
            params: self.policy.params().len(),
        }))
    }
}

impl TrainPass for RowPasses<'_> {
    fn loss(&self) -> &Tensor {
        &self.loss
    }

    fn logged(&self) -> Result<Tensor> {
        Ok(self.logged.clone())
    }

    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>> {
        let mut total: Vec<Option<Tensor>> = vec![None; self.params];
        for (pass, weight) in self.passes {
            let grads = pass.backward(scale * weight)?;
            for (sum, g) in total.iter_mut().zip(grads) {
                *sum = match (sum.take(), g) {
                    (Some(a), Some(b)) => Some((a + b)?),
                    (a, b) => a.or(b),
                };
            }
        }
        Ok(total)
    }
}
