//! The model seam: what the trainer, evaluation, `sample` and the benches call on a network,
//! whatever its family (built-in or a user's). A model gives its logits or its loss, names its
//! parameters ([`Params`]), and may offer a hand-written training pass ([`TrainPass`]) that
//! streams its gradients ([`GradientSink`]) as they are formed.

use candle_core::{Result, Tensor};

use crate::metric::EvalSums;
use crate::params::Params;

/// A network mapping a batch of inputs to logits whose last dimension is the classes (or the
/// vocabulary): images [n, c, h, w] → [n, classes], token windows [n, t] → [n, t, vocab].
pub trait Model: Send + Sync {
    /// The logits for the batch `xs`; `mode` says whether this is training (and with which
    /// seeds for dropout) or evaluation (BatchNorm then uses its running statistics).
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor>;
    /// The trainable parameters (and buffers), in a fixed order.
    fn params(&self) -> &Params;

    /// Mean cross-entropy of the logits for `xs` against integer `targets`, differentiable.
    /// A model may override it to compute the loss without holding all the logits at once.
    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        crate::task::cross_entropy(&self.forward(xs, mode)?, targets)
    }

    /// The terms of the training objective beyond the task's loss that the model logs apart
    /// (a router's load balancing: `aux_loss`), as the train records name them
    /// (`metrics.jsonl`'s `aux_loss`, TensorBoard's `train/aux_loss`). None by default.
    fn loss_terms(&self) -> Vec<String> {
        Vec::new()
    }

    /// [`Model::loss`] and what is logged of it: the objective training differentiates, and
    /// a vector [1 + terms] of the task's loss then each of [`Model::loss_terms`] (detached).
    /// The default: the loss alone.
    fn loss_with_terms(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<(Tensor, Tensor)> {
        let loss = self.loss(xs, targets, mode)?;
        let logged = loss.detach().reshape(1)?;
        Ok((loss, logged))
    }

    /// Σ cross-entropy and the number of targets predicted exactly, for evaluation.
    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        crate::task::loss_sum_and_correct(&self.forward(xs, &Mode::Eval)?, targets)
    }

    /// Each row's summed log-likelihood of its scored targets, `[m]` f32, for inputs and
    /// targets `[m, t]` (targets [`crate::task::IGNORE_TARGET`] where nothing scores): Σ over
    /// the row's scored positions of `log softmax(logits)[target]`, differentiable. What a preference
    /// objective reads of its policy. The default: from [`Model::forward`]'s logits, all of
    /// them held at once; a model may compute it without (the llama's head, row by row).
    fn row_log_likelihoods(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        log_likelihoods(&self.forward(xs, mode)?, targets)
    }

    /// Everything an evaluation adds up for the batch: [`Model::score`]'s sums and the
    /// targets that score (the default), or an objective's own (a preference objective's per
    /// pair, see [`crate::metric::preference_metrics`]).
    fn eval_sums(&self, xs: &Tensor, targets: &Tensor) -> Result<EvalSums> {
        let (loss, correct) = self.score(xs, targets)?;
        Ok(EvalSums {
            loss,
            correct: correct as f64,
            targets: crate::task::scored_targets(targets)? as f64,
            ..EvalSums::default()
        })
    }

    /// Floating-point operations of one sample's training forward and backward passes, by
    /// the usual convention: 2 per multiply-add of the matrix products and convolutions
    /// (forward, weight gradient, input gradient where one is needed), element-wise work
    /// not counted. `bench step` divides the rate it reaches by the machine's measured GEMM
    /// peak. `None`: not known for this model.
    fn train_flops_per_sample(&self) -> Option<f64> {
        None
    }

    /// A training forward pass that computes its own gradients: for a model with a
    /// hand-written backward where that beats autograd (the `gpt` on the CPU in f32).
    /// `None` (the default): the trainer differentiates [`Model::loss`] with autograd.
    /// The pass's gradients must be those autograd would give for the same loss.
    fn train_pass(
        &self,
        _xs: &Tensor,
        _targets: &Tensor,
        _mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        Ok(None)
    }

    /// Bytes a training pass keeps per sample for its backward (activations, and the
    /// backward's own buffers), with or without activation checkpointing: the memory
    /// estimate's share of the batch. `None` (the default): not known for this model.
    fn activation_bytes_per_sample(&self, _checkpointing: bool) -> Option<f64> {
        None
    }

    /// Bytes a training pass keeps whatever its number of samples (copies of weights made for
    /// the pass, such as a mixture's experts stacked for one grouped product), added once per
    /// pass in flight to [`Model::activation_bytes_per_sample`]'s share. 0 (the default): none.
    fn activation_bytes_per_pass(&self, _checkpointing: bool) -> f64 {
        0.0
    }

    /// `train.activation_checkpointing`: from now on a training pass keeps only each block's
    /// input and recomputes the rest of the block in its backward, with the same results bit
    /// for bit (memory for time). `Err`: why this model cannot (the default: it has no
    /// blocks to recompute).
    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        Err("this model does not recompute its activations".into())
    }

    /// `distributed.sharding = "gradients"`: from now on a training pass hands each block's
    /// gradients to [`TrainPass::backward_to`]'s sink as soon as its backward has formed them,
    /// so the trainer can reduce-scatter them while the blocks below are differentiated and
    /// the whole gradient never exists at once. Returns the most gradient values such a pass
    /// holds at a time (the memory estimate's), or `None` (the default) when the model's
    /// gradients all come together at the end of its backward.
    fn stream_gradients(&self) -> Option<usize> {
        None
    }

    /// `distributed.sharding = "full"`: from now on a training pass goes block by block,
    /// calls [`crate::gate::gather`] before each block's forward and again before its backward and
    /// [`crate::gate::release`] after each (for [`crate::gate::Unit::Rest`], around the whole pass), and
    /// hands its gradients over as [`Model::stream_gradients`] says; [`Model::score`] asks
    /// the same way (evaluation runs with the parameters sharded). Returns each block's
    /// parameters, as positions in [`Model::params`]; any other is the rest's. `Err`: why this
    /// model cannot (the default: it has no blocks to gather one at a time).
    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        Err("it names no blocks (Model::shard_parameters)".into())
    }

    /// Whether each row of a batch is computed independently of the others, so a CPU worker
    /// may cut a micro-batch into row shards that run side by side. Not so for BatchNorm
    /// (batch statistics); the default says no for any model with buffers.
    fn rows_independent(&self) -> bool {
        self.params().buffers().next().is_none()
    }

    /// Next-token logits that reuse the keys and values of the positions fed before, for
    /// `sample`. `None` (the default): `sample` runs [`Model::forward`] over the window for
    /// each new token.
    #[doc(hidden)]
    fn kv_decoder(&self) -> Option<&dyn KvDecoder> {
        None
    }
}

/// A language model that generates with a KV cache (see [`Model::kv_decoder`]).
#[doc(hidden)]
pub trait KvDecoder {
    /// Feeds `tokens` after the positions in `cache` and returns the f32 logits [vocab] of the
    /// last one, without dropout; an error past the window (the caller starts a new cache).
    fn forward_cached(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor>;
}

/// The forward half of a training step whose backward the model computes itself (see
/// [`Model::train_pass`]).
pub trait TrainPass {
    /// The mean loss of the pass (a scalar, as [`Model::loss`] returns it).
    fn loss(&self) -> &Tensor;
    /// What is logged of the loss, as [`Model::loss_with_terms`] gives it: [1 + terms].
    fn logged(&self) -> Result<Tensor> {
        self.loss().detach().reshape(1)
    }
    /// The gradient of `scale` · loss for each parameter, in [`Model::params`] order (`None`
    /// for one the loss does not depend on).
    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>>;

    /// [`TrainPass::backward`], each gradient handed to `sink` as soon as it is final (see
    /// [`Model::stream_gradients`]). The default hands them all over at the end, in order.
    fn backward_to(self: Box<Self>, scale: f64, sink: &mut dyn GradientSink) -> Result<()> {
        hand_over_all(self.backward(scale)?, sink)
    }
}

/// Hands every gradient of `grads` (one per parameter, in order) to `sink`.
pub fn hand_over_all(
    grads: impl IntoIterator<Item = Option<Tensor>>,
    sink: &mut dyn GradientSink,
) -> Result<()> {
    for (index, grad) in grads.into_iter().enumerate() {
        sink.put(index, grad)?;
    }
    Ok(())
}

/// Where [`TrainPass::backward_to`] hands each parameter's gradient once nothing more will be
/// added to it.
pub trait GradientSink {
    /// The gradient of `scale` · loss for the parameter at `index` ([`Model::params`] order),
    /// `None` when the loss does not depend on it. Each index at most once; one never handed
    /// over has none.
    fn put(&mut self, index: usize, grad: Option<Tensor>) -> Result<()>;
}

/// The gradients a pass hands over, by parameter: how a streaming pass's
/// [`TrainPass::backward`] is its [`TrainPass::backward_to`] collected.
pub struct CollectedGradients(Vec<Option<Tensor>>);

impl CollectedGradients {
    /// The gradients of `params` parameters that `backward_to` hands to its sink.
    pub fn of(
        params: usize,
        backward_to: impl FnOnce(&mut dyn GradientSink) -> Result<()>,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut all = CollectedGradients(vec![None; params]);
        backward_to(&mut all)?;
        Ok(all.0)
    }
}

impl GradientSink for CollectedGradients {
    fn put(&mut self, index: usize, grad: Option<Tensor>) -> Result<()> {
        let slot = self.0.get_mut(index).ok_or_else(|| {
            candle_core::Error::Msg(format!("a gradient for parameter {index} of fewer"))
        })?;
        *slot = grad;
        Ok(())
    }
}

/// Σ over each row's scored targets of `log softmax(logits)[target]`: logits `[m, t, vocab]`
/// (any float type, summed in f32), targets `[m, t]` → `[m]` (see
/// [`Model::row_log_likelihoods`]).
pub fn log_likelihoods(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    use candle_core::{D, DType};
    let logits = logits.to_dtype(DType::F32)?;
    // The max only steadies the exponentials: its gradient would cancel, so none is taken.
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let log_probs = shifted.broadcast_sub(&log_sum)?;
    let ys = targets.to_dtype(DType::U32)?;
    let scored = ys.ne(crate::task::IGNORE_TARGET)?;
    let safe = scored.where_cond(&ys, &ys.zeros_like()?)?;
    let picked = log_probs.gather(&safe.unsqueeze(D::Minus1)?, D::Minus1)?;
    (picked.squeeze(D::Minus1)? * scored.to_dtype(DType::F32)?)?.sum(D::Minus1)
}

/// [`Model::train_flops_per_sample`] of a chain of products whose forward passes cost
/// `forward[i]` operations per sample: each costs as much again for its weight gradient and
/// for its input gradient, except the first, whose input is data.
pub fn chain_train_flops(forward: &[f64]) -> f64 {
    3.0 * forward.iter().sum::<f64>() - forward.first().copied().unwrap_or(0.0)
}

/// How a forward pass runs: evaluation, or training with the seeds of its random choices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Evaluation: no dropout, running statistics.
    Eval,
    /// One seed per batch row, derived from (job seed, epoch, sample index): a row's dropout
    /// masks depend on which sample it is, never on the rank or the batch it landed in, so
    /// 2 workers × B/2 draw exactly the masks 1 worker × B draws, and a resumed run redraws
    /// them bit for bit.
    Train {
        /// The seed of each row of the batch, in order.
        row_seeds: Vec<u64>,
    },
}

impl Mode {
    /// Whether this is a training pass.
    pub fn is_train(&self) -> bool {
        matches!(self, Mode::Train { .. })
    }
}

/// Keys and values of the positions fed so far to a language model's [`KvDecoder::forward_cached`], per layer, each
/// [1, n_head, t, head_dim].
#[derive(Default)]
pub struct KvCache {
    /// Each layer's (keys, values), for the model that fills them.
    #[doc(hidden)]
    pub layers: Vec<(Tensor, Tensor)>,
}

impl KvCache {
    /// Positions cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Forgets every position (a new sequence).
    pub fn clear(&mut self) {
        self.layers.clear();
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A boxed model is a model (what a builder returns when it picks among several).
impl Model for Box<dyn Model> {
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.as_ref().forward(xs, mode)
    }

    fn params(&self) -> &Params {
        self.as_ref().params()
    }

    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.as_ref().loss(xs, targets, mode)
    }

    fn loss_terms(&self) -> Vec<String> {
        self.as_ref().loss_terms()
    }

    fn loss_with_terms(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<(Tensor, Tensor)> {
        self.as_ref().loss_with_terms(xs, targets, mode)
    }

    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        self.as_ref().score(xs, targets)
    }

    fn eval_sums(&self, xs: &Tensor, targets: &Tensor) -> Result<EvalSums> {
        self.as_ref().eval_sums(xs, targets)
    }

    fn row_log_likelihoods(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.as_ref().row_log_likelihoods(xs, targets, mode)
    }

    fn train_flops_per_sample(&self) -> Option<f64> {
        self.as_ref().train_flops_per_sample()
    }

    fn rows_independent(&self) -> bool {
        self.as_ref().rows_independent()
    }

    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        self.as_ref().checkpoint_activations()
    }

    fn activation_bytes_per_sample(&self, checkpointing: bool) -> Option<f64> {
        self.as_ref().activation_bytes_per_sample(checkpointing)
    }

    fn activation_bytes_per_pass(&self, checkpointing: bool) -> f64 {
        self.as_ref().activation_bytes_per_pass(checkpointing)
    }

    fn stream_gradients(&self) -> Option<usize> {
        self.as_ref().stream_gradients()
    }

    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        self.as_ref().shard_parameters()
    }

    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        self.as_ref().train_pass(xs, targets, mode)
    }

    fn kv_decoder(&self) -> Option<&dyn KvDecoder> {
        self.as_ref().kv_decoder()
    }
}
