//! Training passes that go block by block through autograd: `train.activation_checkpointing`
//! keeps only each block's input and in the backward recomputes the blocks one at a time,
//! last first, each differentiated alone, seeded with the gradient the block above gave its
//! output; `distributed.sharding = "gradients"` without checkpointing keeps each block's graph
//! apart instead and differentiates the blocks one at a time the same way. Either hands each
//! block's gradients over as soon as its backward has formed them
//! ([`TrainPass::backward_to`]).
//!
//! The forward and the recomputation run the same code on the same inputs, and every gradient
//! is formed by the ops autograd over the whole model forms it with, in the same order (a
//! table the head and the embedding both read gets the embedding's gradient added onto the
//! head's, as candle's backward adds it), so the weights are bit-identical to a pass that keeps
//! everything (tested for the llama and the gpt, f32 and bf16, packed rows and LoRA). Peak
//! memory when recomputing: the blocks' inputs, and one block's activations with its
//! gradients. Any device, precision, packing and LoRA: it is autograd, block by block.
//!
//! A block may leave something for a loss term of the model's own beside the head's (a
//! router's choices, for a mixture of experts' load balancing: [`Stack::Side`]): once every
//! block has run, the model makes the term ([`Stack::side_loss`]) as a sum of one share per
//! block, and each block's backward differentiates its own share with its output.
//!
//! Each block's parameters are asked for ([`gate::gather`]) before its forward and again
//! before its backward, and let go after each; the rest's from the start of the forward to
//! the end of the backward: what `distributed.sharding = "full"` needs (see `ddpjob_seam::gate`).

use candle_core::backprop::GradStore;
use candle_core::{Error, Result, Tensor, Var};

use crate::gate::{self, Unit};
use crate::{CollectedGradients, GradientSink, Mode, Params, TrainPass};

/// A model as a layered pass sees it: an embedding stage, blocks over a residual stream, a
/// head that ends in the loss.
pub trait Stack: Sync {
    /// What the blocks and the embedding's backward need of the batch (shape, packing,
    /// dropout seeds, token ids).
    type Batch: Send + Sync;
    /// What a block's forward leaves for a loss term of the model's own ([`Stack::side_loss`]);
    /// `()` for a model without one.
    type Side: Side;

    /// The batch's setup, and the embedding stage's output for it (the residual stream the
    /// first block reads), detached.
    fn embed(&self, xs: &Tensor, mode: &Mode) -> Result<(Self::Batch, Tensor)>;
    /// The number of blocks.
    fn depth(&self) -> usize;
    /// Block `i` over the residual stream `x`.
    fn block(&self, i: usize, x: &Tensor, batch: &Self::Batch) -> Result<Tensor>;
    /// Block `i` and its side: by default [`Stack::block`] alone.
    fn block_with_side(
        &self,
        i: usize,
        x: &Tensor,
        batch: &Self::Batch,
    ) -> Result<(Tensor, Option<Self::Side>)> {
        Ok((self.block(i, x, batch)?, None))
    }
    /// The model's own loss term, once every block has run (their sides, first block first):
    /// `None` (the default) for none.
    fn side_loss(
        &self,
        _sides: &[Option<Self::Side>],
        _batch: &Self::Batch,
        _targets: &Tensor,
    ) -> Result<Option<Box<dyn SideLoss<Self::Side> + '_>>> {
        Ok(None)
    }
    /// The mean loss from the last block's output.
    fn head_loss(&self, last: &Tensor, targets: &Tensor) -> Result<Tensor>;
    /// Positions (in [`Stack::params`]) of the parameters the embedding stage reads: the head's
    /// gradients for them are held back until the embedding's backward adds to them.
    fn embedding_params(&self) -> Vec<usize>;
    /// The embedding stage's backward from `upstream` (the gradient of its output): every
    /// gradient of the parameters [`Stack::embedding_params`] names, `held[k]` (what the head
    /// gave the k-th of them) added to, handed to `sink`.
    fn embedding_backward(
        &self,
        batch: &Self::Batch,
        upstream: &Tensor,
        held: Vec<Option<Tensor>>,
        sink: &mut dyn GradientSink,
    ) -> Result<()>;
    fn params(&self) -> &Params;
}

/// What a block leaves for a side loss (see [`Stack::Side`]).
pub trait Side: Send + Sync + Sized {
    /// The same without its graph (kept while the pass recomputes the block in its backward).
    fn detach(&self) -> Self;
}

impl Side for () {
    fn detach(&self) -> Self {}
}

/// A loss term of a model's own, a sum over its blocks of one share each (see
/// [`Stack::side_loss`]).
pub trait SideLoss<S>: Send + Sync {
    /// Block's share of the term, differentiable through what `side` holds.
    fn share(&self, side: &S) -> Result<Tensor>;
    /// The term's weight in the training objective (0: logged only).
    fn coef(&self) -> f64;
}

/// What the blocks of a language model's pass need of its batch (a [`Stack::Batch`]).
pub struct TokenBatch {
    /// The token ids, as the model's embedding reads them.
    pub ids: Tensor,
    /// (n, t): windows and positions.
    pub shape: (usize, usize),
    pub packing: Option<super::packed::Packing>,
    /// Training (with the rows' dropout seeds) or evaluation.
    pub mode: Mode,
}

pub struct Layered<'a, S: Stack> {
    model: &'a S,
    batch: S::Batch,
    /// What each block kept for its backward, first block first.
    blocks: Vec<KeptBlock<S::Side>>,
    /// The last block's output, as a variable: the head's graph starts there.
    last: Var,
    /// The head's loss.
    head: Tensor,
    /// The head's loss plus the side term's weighted (the objective), and both as logged
    /// ([head, side] when there is a side term).
    loss: Tensor,
    logged: Tensor,
    /// The side term's weight, when it is in the objective: each block's backward adds its
    /// share.
    side_coef: Option<f64>,
    side_loss: Option<Box<dyn SideLoss<S::Side> + 'a>>,
}

/// What one block keeps for its backward.
enum Kept {
    /// Its input, detached: recomputed from it.
    Input(Tensor),
    /// Its input as a variable and its output, with the graph between them.
    Graph { input: Var, output: Tensor },
}

/// What one block keeps, with its side (detached when the block is recomputed).
struct KeptBlock<S> {
    kept: Kept,
    side: Option<S>,
}

impl<'a, S: Stack> Layered<'a, S> {
    /// The forward pass, each block apart: its graph is dropped as soon as its output is
    /// (detached and) handed to the next block when `recompute`, else kept.
    pub fn forward(
        model: &'a S,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
        recompute: bool,
    ) -> Result<Self> {
        gate::gather(Unit::Rest)?;
        let (batch, mut x) = model.embed(xs, mode)?;
        let mut blocks = Vec::with_capacity(model.depth());
        for i in 0..model.depth() {
            gate::gather(Unit::Block(i))?;
            let block = match recompute {
                true => {
                    let (y, side) = model.block_with_side(i, &x, &batch)?;
                    let input = std::mem::replace(&mut x, y.detach());
                    KeptBlock {
                        kept: Kept::Input(input),
                        side: side.map(|s| s.detach()),
                    }
                }
                false => {
                    let input = Var::from_tensor(&x)?;
                    let (output, side) = model.block_with_side(i, input.as_tensor(), &batch)?;
                    x = output.detach();
                    KeptBlock {
                        kept: Kept::Graph { input, output },
                        side,
                    }
                }
            };
            blocks.push(block);
            gate::release(Unit::Block(i))?;
        }
        let last = Var::from_tensor(&x)?;
        drop(x);
        let head = model.head_loss(last.as_tensor(), targets)?;
        let sides: Vec<Option<S::Side>> = blocks.iter_mut().map(|b| b.side.take()).collect();
        let side_loss = model.side_loss(&sides, &batch, targets)?;
        let (mut loss, mut logged) = (head.clone(), head.detach().reshape(1)?);
        let mut side_coef = None;
        if let Some(side) = &side_loss {
            let mut total: Option<Tensor> = None;
            for s in sides.iter().flatten() {
                let share = side.share(s)?.detach();
                total = Some(match total {
                    Some(t) => (t + share)?,
                    None => share,
                });
            }
            let term = match total {
                Some(t) => t,
                None => head.zeros_like()?,
            };
            logged = Tensor::cat(&[&logged, &term.reshape(1)?], 0)?;
            if side.coef() != 0.0 {
                loss = (&head + (term * side.coef())?)?;
                side_coef = Some(side.coef());
            }
        }
        // Kept with its graph, a block's side goes back to it for the backward.
        for (block, side) in blocks.iter_mut().zip(sides) {
            block.side = side;
        }
        Ok(Layered {
            model,
            batch,
            blocks,
            last,
            head,
            loss,
            logged,
            side_coef,
            side_loss,
        })
    }
}

impl<S: Stack> TrainPass for Layered<'_, S> {
    fn loss(&self) -> &Tensor {
        &self.loss
    }

    fn logged(&self) -> Result<Tensor> {
        Ok(self.logged.clone())
    }

    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>> {
        CollectedGradients::of(self.model.params().len(), |sink| {
            self.backward_to(scale, sink)
        })
    }

    /// The head's gradients after its backward (those of the embedding stage's parameters
    /// held back), each block's after its own, last block first, the embedding stage's last.
    fn backward_to(self: Box<Self>, scale: f64, sink: &mut dyn GradientSink) -> Result<()> {
        let Layered {
            model,
            batch,
            mut blocks,
            last,
            head,
            side_coef,
            side_loss,
            ..
        } = *self;
        let vars: Vec<&Var> = model.params().vars().collect();
        let embedding = model.embedding_params();
        let mut held: Vec<Option<Tensor>> = vec![None; embedding.len()];
        let mut hand_over = |store: &GradStore| -> Result<()> {
            for (i, var) in vars.iter().enumerate() {
                let Some(g) = store.get(var) else { continue };
                match embedding.iter().position(|&e| e == i) {
                    Some(k) => held[k] = Some(g.clone()),
                    None => sink.put(i, Some(g.clone()))?,
                }
            }
            Ok(())
        };
        let head_grads = (&head * scale)?.backward()?;
        hand_over(&head_grads)?;
        let missing = || Error::Msg("the loss does not depend on the blocks".into());
        let mut upstream = head_grads
            .get(last.as_tensor())
            .cloned()
            .ok_or_else(missing)?;
        drop((head_grads, head, last));
        for i in (0..model.depth()).rev() {
            gate::gather(Unit::Block(i))?;
            let block = blocks.pop().ok_or_else(missing)?;
            let (x, y, side) = match block.kept {
                Kept::Input(input) => {
                    let x = Var::from_tensor(&input)?;
                    drop(input);
                    let (y, side) = match side_coef {
                        Some(_) => model.block_with_side(i, x.as_tensor(), &batch)?,
                        None => (model.block(i, x.as_tensor(), &batch)?, None),
                    };
                    (x, y, side)
                }
                Kept::Graph { input, output } => (input, output, block.side),
            };
            // d(Σ y·upstream)/dy is `upstream` exactly (1·g), so this block's backward runs
            // on the same gradient as in a whole-model backward.
            let mut seed = (y * &upstream)?.sum_all()?;
            if let (Some(coef), Some(side), Some(loss)) = (side_coef, &side, &side_loss) {
                seed = (seed + (loss.share(side)? * (coef * scale))?)?;
            }
            let store = seed.backward()?;
            hand_over(&store)?;
            upstream = store.get(x.as_tensor()).cloned().ok_or_else(missing)?;
            drop(store);
            gate::release(Unit::Block(i))?;
        }
        model.embedding_backward(&batch, &upstream, held, sink)?;
        gate::release(Unit::Rest)
    }
}

/// The parameters of each of `depth` blocks, as positions in `params`: those whose names
/// start with `prefix(i)` (what [`super::Model::shard_parameters`] returns).
pub fn blocks_by_name(
    params: &Params,
    depth: usize,
    prefix: impl Fn(usize) -> String,
) -> Vec<Vec<usize>> {
    (0..depth)
        .map(|i| {
            let prefix = prefix(i);
            let names = params.iter().map(|(name, _)| name).enumerate();
            names
                .filter(|(_, name)| name.starts_with(&prefix))
                .map(|(position, _)| position)
                .collect()
        })
        .collect()
}
