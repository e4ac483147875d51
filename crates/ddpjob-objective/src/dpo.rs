//! The DPO objective as a [`Model`] the trainer drives like any other: a batch is pairs
//! (inputs and targets `[pairs, 2, t]`, see `ddpjob-data`'s pairs), its loss the mean over the
//! pairs of DPO's loss of the policy's log-probabilities against the reference's, its logged
//! terms TRL's (`rewards/margins`, ...), its evaluation sums those `preference_metrics`
//! reads. Everything else (parameters, sampling, the memory estimate) is the policy's, so a
//! checkpoint, `export` and `sample` of a DPO job are the policy's. Differentiated by
//! autograd over the policy's logits.

use candle_core::{DType, Result, Tensor};
use ddpjob_seam::metric::{EvalSums, pair_sums};
use ddpjob_seam::{KvDecoder, Mode, Model, Params, TrainPass};

use super::dpo_loss::{DpoSettings, LOGGED, Scored, score};
use super::logps::{row_extents, row_logps};
use super::reference::Reference;

/// The policy being tuned, its reference and `[train.dpo]`.
pub struct Dpo {
    pub policy: Box<dyn Model>,
    pub reference: Reference,
    pub settings: DpoSettings,
}

/// A pair's second row's dropout seed, from its pair's: the two rows draw apart.
fn rejected_seed(seed: u64) -> u64 {
    seed ^ 0xD90_7E3E_C7ED
}

impl Dpo {
    /// Pairs `[n, 2, t]` as rows `[2n, t]` (chosen, rejected, chosen, ...), the mode's seeds one
    /// per row.
    pub(crate) fn rows(xs: &Tensor, ys: &Tensor, mode: &Mode) -> Result<(Tensor, Tensor, Mode)> {
        let &[n, 2, t] = xs.dims() else {
            candle_core::bail!(
                "the DPO objective takes pairs [n, 2, t], not {:?}: train.objective = \"dpo\" \
                 needs the data read as pairs",
                xs.dims()
            );
        };
        let mode = match mode {
            Mode::Train { row_seeds } => Mode::Train {
                row_seeds: (row_seeds.iter())
                    .flat_map(|&s| [s, rejected_seed(s)])
                    .collect(),
            },
            Mode::Eval => Mode::Eval,
        };
        Ok((xs.reshape((2 * n, t))?, ys.reshape((2 * n, t))?, mode))
    }

    /// The pairs of `xs`, `ys` scored: the policy's log-probabilities (differentiable in
    /// training), the reference's, the completions' lengths; and which pairs score at all (a
    /// pair whose targets are all ignored is an evaluation's padding).
    fn score_pairs(&self, xs: &Tensor, ys: &Tensor, mode: &Mode) -> Result<(Scored, Vec<bool>)> {
        let (rows, targets, mode) = Self::rows(xs, ys, mode)?;
        let n = xs.dim(0)?;
        let device = xs.device();
        let policy = row_logps(self.policy.as_ref(), &rows, &targets, &mode)?;
        let policy = match mode {
            Mode::Eval => policy.detach(),
            Mode::Train { .. } => policy,
        };
        let reference = self
            .reference
            .row_logps(self.policy.as_ref(), &rows, &targets)?;
        let extents = row_extents(&targets)?;
        let lengths: Vec<f32> = extents.iter().map(|&(scored, _)| scored as f32).collect();
        let real = extents
            .chunks(2)
            .map(|p| p[0].0 > 0 && p[1].0 > 0)
            .collect();
        let pairs = |v: Vec<f32>| Tensor::from_vec(v, (n, 2), device);
        let scored = score(
            &self.settings,
            &policy.reshape((n, 2))?,
            &pairs(reference)?,
            &pairs(lengths)?,
        )?;
        Ok((scored, real))
    }
}

impl Model for Dpo {
    /// The policy's logits (`sample`, and anything that reads a language model's).
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.policy.forward(xs, mode)
    }

    fn params(&self) -> &Params {
        self.policy.params()
    }

    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        Ok(self.loss_with_terms(xs, targets, mode)?.0)
    }

    fn loss_terms(&self) -> Vec<String> {
        LOGGED.iter().map(|s| s.to_string()).collect()
    }

    /// The mean loss over the pairs, and [loss, then [`LOGGED`]'s means].
    fn loss_with_terms(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<(Tensor, Tensor)> {
        let (scored, _) = self.score_pairs(xs, targets, mode)?;
        let loss = scored.losses.mean_all()?;
        let n = xs.dim(0)?.max(1) as f64;
        let sums = scored.sums()?;
        let mut logged = vec![loss.detach().to_dtype(DType::F64)?.to_scalar::<f64>()?];
        logged.extend(sums.iter().map(|s| s / n));
        let logged: Vec<f32> = logged.iter().map(|&v| v as f32).collect();
        let logged = Tensor::from_vec(logged, 1 + LOGGED.len(), xs.device())?;
        Ok((loss, logged))
    }

    /// Σ loss and the pairs ranked right (see [`Model::eval_sums`]).
    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        let sums = self.eval_sums(xs, targets)?;
        Ok((sums.loss, sums.correct as usize))
    }

    /// Per pair that scores: its loss, whether it is ranked right, and the pair sums
    /// `preference_metrics` reads; the pairs are the targets.
    fn eval_sums(&self, xs: &Tensor, targets: &Tensor) -> Result<EvalSums> {
        let (scored, real) = self.score_pairs(xs, targets, &Mode::Eval)?;
        let losses = scored.losses.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let rewards = scored.rewards.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let logps = scored.logps.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let mut sums = EvalSums::default();
        for i in (0..real.len()).filter(|&i| real[i]) {
            sums.loss += losses[i];
            sums.correct += f64::from(u8::from(rewards[i][0] > rewards[i][1]));
            sums.targets += 1.0;
            sums.extra[pair_sums::REWARD_CHOSEN] += rewards[i][0];
            sums.extra[pair_sums::REWARD_REJECTED] += rewards[i][1];
            sums.extra[pair_sums::LOGPS_CHOSEN] += logps[i][0];
            sums.extra[pair_sums::LOGPS_REJECTED] += logps[i][1];
        }
        Ok(sums)
    }

    /// Two rows a pair, and the reference's forward of each (a third of a training pass)
    /// unless it was computed before.
    fn train_flops_per_sample(&self) -> Option<f64> {
        let row = self.policy.train_flops_per_sample()?;
        let reference = match self.reference {
            Reference::Table(_) => 0.0,
            _ => row / 3.0,
        };
        Some(2.0 * (row + reference))
    }

    /// A row's: the memory estimate counts two rows a pair (it knows the objective).
    fn activation_bytes_per_sample(&self, checkpointing: bool) -> Option<f64> {
        self.policy.activation_bytes_per_sample(checkpointing)
    }

    fn activation_bytes_per_pass(&self, checkpointing: bool) -> f64 {
        self.policy.activation_bytes_per_pass(checkpointing)
    }

    /// The policy's recomputing pass, run a row at a time (see `row_passes`); not for a
    /// policy whose loss has terms of its own (a mixture's load balancing), which a row's pass
    /// would mix into its log-likelihood.
    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        if !self.policy.loss_terms().is_empty() {
            return Err(
                "train.objective = \"dpo\" recomputes a row at a time through the \
                        model's own pass, whose loss here has terms besides the log-likelihood \
                        (a mixture's load balancing)"
                    .into(),
            );
        }
        self.policy.checkpoint_activations()
    }

    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        let passes = self.row_passes(xs, targets, mode)?;
        Ok(passes.map(|p| Box::new(p) as Box<dyn TrainPass + '_>))
    }

    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        Err(
            "train.objective = \"dpo\" differentiates its loss with autograd over the whole \
             pass, which needs every parameter at once; use sharding = \"optimizer\" or \
             \"gradients\""
                .into(),
        )
    }

    fn rows_independent(&self) -> bool {
        self.policy.rows_independent()
    }

    fn kv_decoder(&self) -> Option<&dyn KvDecoder> {
        self.policy.kv_decoder()
    }
}
