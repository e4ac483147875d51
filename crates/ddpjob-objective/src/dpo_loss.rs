//! DPO's arithmetic on a batch of pairs, given each completion's summed log-probability under
//! the policy and under the reference (Rafailov et al. 2023; TRL 1.16's `DPOTrainer.
//! _compute_loss`): the log-ratios, the loss of each pair for `train.dpo.loss`, and what is
//! logged of them with TRL's names. Tensors [pairs, 2] (chosen, rejected); the policy's
//! carry the gradient, the reference's are constants.

use candle_core::{D, DType, Result, Tensor};
use ddpjob_spec::DpoLoss;

/// `[train.dpo]` as the loss reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoSettings {
    pub beta: f64,
    pub loss: DpoLoss,
    pub label_smoothing: f64,
}

/// What is logged of a training step, in this order (TRL's names; each the mean over the
/// step's pairs): the train records' `metrics`, TensorBoard's `train/<name>`.
pub const LOGGED: [&str; 6] = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
];

/// A batch of pairs scored: each pair's loss `[n]` (differentiable in the policy) and, detached,
/// the rewards β·(logp_θ − logp_ref) `[n, 2]` and the policy's log-probabilities `[n, 2]`.
pub struct Scored {
    pub losses: Tensor,
    pub rewards: Tensor,
    pub logps: Tensor,
}

/// log σ(x), exact and finite for any x: −ln(1 + e^−x) where x ≥ 0, x − ln(1 + e^x) below,
/// each branch's argument held to its own side (beyond ±80, where only the other branch is
/// read), so neither overflows and the gradient is σ(−x) everywhere. Not the usual stable form
/// min(x, 0) − ln(1 + e^−|x|) on purpose: its kinks at 0 give autograd gradients (min's 1/2
/// and |x|'s +1 at a tie) that add to 1 instead of σ(−0) = 1/2, and at the first step, policy
/// = reference, x is exactly 0 for most pairs.
fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let above = x.maximum(-80.0)?;
    let below = x.minimum(80.0)?;
    let from_above = (above.neg()?.exp()? + 1.0)?.log()?.neg()?;
    let from_below = (&below - (below.exp()? + 1.0)?.log()?)?;
    x.ge(0.0)?.where_cond(&from_above, &from_below)
}

/// The pairs' losses. `policy` and `reference`: summed log-probabilities `[n, 2]`; `lengths`:
/// each completion's scored tokens `[n, 2]` (IPO's per-token means).
pub fn score(
    s: &DpoSettings,
    policy: &Tensor,
    reference: &Tensor,
    lengths: &Tensor,
) -> Result<Scored> {
    let ratios = (policy - reference)?; // [n, 2]: chosen's and rejected's log-ratio
    let column = |t: &Tensor, i: usize| t.narrow(D::Minus1, i, 1)?.squeeze(D::Minus1);
    let delta = (column(&ratios, 0)? - column(&ratios, 1)?)?;
    let beta = s.beta;
    let losses = match s.loss {
        DpoLoss::Sigmoid => {
            let d = (&delta * beta)?;
            let eps = s.label_smoothing;
            let kept = (log_sigmoid(&d)? * -(1.0 - eps))?;
            match eps {
                0.0 => kept,
                _ => (kept - (log_sigmoid(&d.neg()?)? * eps)?)?,
            }
        }
        DpoLoss::Ipo => {
            let per_token = (&ratios / lengths.maximum(1.0)?)?;
            let d = (column(&per_token, 0)? - column(&per_token, 1)?)?;
            (d - 1.0 / (2.0 * beta))?.sqr()?
        }
        DpoLoss::Hinge => (1.0 - (&delta * beta)?)?.relu()?,
    };
    Ok(Scored {
        losses,
        rewards: (ratios.detach() * beta)?,
        logps: policy.detach(),
    })
}

impl Scored {
    /// [`LOGGED`]'s sums over the pairs (f64 on the host): Σ rewards chosen, rejected,
    /// pairs ranked right, margins, log-probabilities chosen and rejected.
    pub fn sums(&self) -> Result<[f64; 6]> {
        let rewards = self.rewards.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let logps = self.logps.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let mut sums = [0.0; 6];
        for (r, l) in rewards.iter().zip(&logps) {
            let add = [
                r[0],
                r[1],
                f64::from(u8::from(r[0] > r[1])),
                r[0] - r[1],
                l[0],
                l[1],
            ];
            sums.iter_mut().zip(add).for_each(|(s, a)| *s += a);
        }
        Ok(sums)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    fn pairs(v: &[[f32; 2]]) -> Tensor {
        let flat: Vec<f32> = v.iter().flatten().copied().collect();
        Tensor::from_vec(flat, (v.len(), 2), &Device::Cpu).unwrap()
    }

    fn settings(loss: DpoLoss, eps: f64) -> DpoSettings {
        DpoSettings {
            beta: 0.1,
            loss,
            label_smoothing: eps,
        }
    }

    /// Pair 0: policy (-10, -14), reference (-12, -12): log-ratios +2 and -2, Δ = 4, βΔ = 0.4.
    /// Pair 1: policy (-5, -3), reference (-4, -4): log-ratios -1 and +1, Δ = -2, βΔ = -0.2.
    fn batch() -> (Tensor, Tensor, Tensor) {
        (
            pairs(&[[-10.0, -14.0], [-5.0, -3.0]]),
            pairs(&[[-12.0, -12.0], [-4.0, -4.0]]),
            pairs(&[[4.0, 2.0], [1.0, 5.0]]),
        )
    }

    fn close(got: &Tensor, want: &[f64]) {
        let got = got.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() < 1e-6 * w.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn the_sigmoid_loss_and_rewards_by_hand() {
        let (p, r, l) = batch();
        let s = score(&settings(DpoLoss::Sigmoid, 0.0), &p, &r, &l).unwrap();
        // -ln σ(0.4) = ln(1 + e^-0.4) = 0.5130153; -ln σ(-0.2) = ln(1 + e^0.2) = 0.7981389.
        close(&s.losses, &[0.513_015_3, 0.798_138_9]);
        let sums = s.sums().unwrap();
        // Rewards β·ratio: (0.2, -0.2) and (-0.1, 0.1); one pair ranked right.
        let want = [0.1, -0.1, 1.0, 0.2, -15.0, -17.0];
        for (g, w) in sums.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{sums:?}");
        }
    }

    #[test]
    fn label_smoothing_mixes_in_the_flipped_pair() {
        let (p, r, l) = batch();
        let s = score(&settings(DpoLoss::Sigmoid, 0.25), &p, &r, &l).unwrap();
        // 0.75·ln(1 + e^-0.4) + 0.25·ln(1 + e^0.4) = 0.75·0.5130153 + 0.25·0.9130153.
        // 0.75·ln(1 + e^0.2) + 0.25·ln(1 + e^-0.2) = 0.75·0.7981389 + 0.25·0.5981389.
        close(&s.losses, &[0.613_015_3, 0.748_138_9]);
    }

    #[test]
    fn ipo_and_hinge_by_hand() {
        let (p, r, l) = batch();
        let ipo = score(&settings(DpoLoss::Ipo, 0.0), &p, &r, &l).unwrap();
        // Per-token ratios: 2/4 - (-2/2) = 1.5 and -1/1 - 1/5 = -1.2; 1/(2β) = 5.
        close(
            &ipo.losses,
            &[(1.5f64 - 5.0).powi(2), (-1.2f64 - 5.0).powi(2)],
        );
        let hinge = score(&settings(DpoLoss::Hinge, 0.0), &p, &r, &l).unwrap();
        close(&hinge.losses, &[0.6, 1.2]);
    }

    #[test]
    fn the_gradient_at_a_tie_is_half_beta() {
        // Policy = reference: Δ = 0 exactly, d/dchosen of -ln σ(βΔ) = -β/2.
        let p = candle_core::Var::from_tensor(&pairs(&[[-3.0, -4.0]])).unwrap();
        let s = score(
            &settings(DpoLoss::Sigmoid, 0.0),
            &p,
            &pairs(&[[-3.0, -4.0]]),
            &pairs(&[[1.0, 1.0]]),
        )
        .unwrap();
        let g = s.losses.sum_all().unwrap().backward().unwrap();
        let g = g.get(&p).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g, [[-0.05, 0.05]]);
        // Far out, finite: a pair ranked right by 2000 nats, and wrong by as much (a loss of
        // 200 nats, its gradient still β).
        let far = score(
            &settings(DpoLoss::Sigmoid, 0.0),
            &pairs(&[[0.0, -2000.0], [-2000.0, 0.0]]),
            &pairs(&[[0.0, 0.0], [0.0, 0.0]]),
            &pairs(&[[1.0, 1.0], [1.0, 1.0]]),
        )
        .unwrap();
        let v = far.losses.to_vec1::<f32>().unwrap();
        assert!(v[0] < 1e-30 && (v[1] - 200.0).abs() < 1e-3, "{v:?}");
        let p = candle_core::Var::from_tensor(&pairs(&[[-2000.0, 0.0]])).unwrap();
        let wrong = score(
            &settings(DpoLoss::Sigmoid, 0.0),
            &p,
            &pairs(&[[0.0, 0.0]]),
            &pairs(&[[1.0, 1.0]]),
        )
        .unwrap();
        let g = wrong.losses.sum_all().unwrap().backward().unwrap();
        let g = g.get(&p).unwrap().to_vec2::<f32>().unwrap();
        assert!(
            (g[0][0] + 0.1).abs() < 1e-6 && (g[0][1] - 0.1).abs() < 1e-6,
            "{g:?}"
        );
    }

    #[test]
    fn the_gradient_flows_to_the_policy_alone() {
        let (p, r, l) = batch();
        let p = candle_core::Var::from_tensor(&p).unwrap();
        let s = score(&settings(DpoLoss::Sigmoid, 0.0), &p, &r, &l).unwrap();
        let grads = s.losses.sum_all().unwrap().backward().unwrap();
        let g = grads.get(&p).unwrap().to_vec2::<f32>().unwrap();
        // d/dchosen of -ln σ(βΔ) = -β(1 - σ(βΔ)); the rejected's the opposite.
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let g0 = -0.1 * (1.0 - sig(0.4));
        assert!((g[0][0] as f64 - g0).abs() < 1e-6 && (g[0][1] as f64 + g0).abs() < 1e-6);
        assert!(grads.get(&r).is_none());
    }
}
