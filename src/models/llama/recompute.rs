//! `train.activation_checkpointing` for the llama: a training pass that keeps only each decoder
//! layer's input, and in its backward recomputes the layers one at a time, last first, each
//! differentiated alone by autograd, seeded with the gradient the layer above gave its output.
//!
//! The forward and the recomputation run the same code on the same inputs, and every gradient
//! is formed by the ops autograd over the whole model forms it with, in the same order (the
//! tied embedding's lookup gradient is added onto the output projection's, as candle's own
//! backward does), so the weights are bit-identical to a pass that keeps everything (tested on
//! the CPU in f32 and bf16). Peak memory: the layers' inputs, and one layer's activations with
//! its gradients. Any device, precision, packing and LoRA: it is autograd, layer by layer.

use candle_core::{Error, Result, Tensor, Var};

use super::Llama;
use crate::models::packed::{self, Packing};
use crate::models::{Mode, TrainPass};

pub(super) struct Recomputed<'a> {
    model: &'a Llama,
    /// Token ids [n, t].
    ids: Tensor,
    shape: (usize, usize),
    packing: Option<Packing>,
    mode: Mode,
    /// Each layer's input [n·t, hidden], detached: the only activations kept.
    inputs: Vec<Tensor>,
    /// The last layer's output, as a variable: the final norm's and the head's graph start
    /// there.
    last: Var,
    loss: Tensor,
}

impl<'a> Recomputed<'a> {
    /// The forward pass: each layer's graph is dropped as soon as its output is (detached and)
    /// handed to the next layer.
    pub(super) fn forward(
        model: &'a Llama,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Self> {
        let (ids, packing) = packed::split(xs)?;
        let shape = model.check_window(&ids)?;
        let mut inputs = Vec::with_capacity(model.layers.len());
        let x = model.detached_layers(&ids, shape, packing.as_ref(), mode, Some(&mut inputs))?;
        let last = Var::from_tensor(&x)?;
        drop(x);
        let loss = model.loss_of(&model.final_norm(last.as_tensor())?, targets)?;
        Ok(Recomputed {
            model,
            ids,
            shape,
            packing,
            mode: mode.clone(),
            inputs,
            last,
            loss,
        })
    }
}

impl TrainPass for Recomputed<'_> {
    fn loss(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>> {
        let Recomputed {
            model,
            ids,
            shape,
            packing,
            mode,
            mut inputs,
            last,
            loss,
        } = *self;
        let vars: Vec<&Var> = model.params.vars().collect();
        let head = (&loss * scale)?.backward()?;
        let mut grads: Vec<Option<Tensor>> = vars.iter().map(|v| head.get(v).cloned()).collect();
        let missing = || Error::Msg("llama: the loss does not depend on the layers".into());
        let mut upstream = head.get(last.as_tensor()).cloned().ok_or_else(missing)?;
        drop((head, loss, last));
        for layer in model.layers.iter().rev() {
            let input = inputs.pop().ok_or_else(missing)?;
            let x = Var::from_tensor(&input)?;
            drop(input);
            let y = model.block(layer, x.as_tensor(), shape, packing.as_ref(), &mode)?;
            // d(Σ y·upstream)/dy is `upstream` exactly (1·g), so this layer's backward runs
            // on the same gradient as in a whole-model backward.
            let store = (y * &upstream)?.sum_all()?.backward()?;
            for (slot, var) in grads.iter_mut().zip(&vars) {
                if let Some(g) = store.get(var) {
                    *slot = Some(g.clone());
                }
            }
            upstream = store.get(x.as_tensor()).cloned().ok_or_else(missing)?;
        }
        // The lookup's gradient, as candle's backward of `index_select` forms it: added row by
        // row onto what the parameter already has (a tied embedding: the output projection's).
        if !model.params.frozen.contains(&model.embed)
            && let Some(i) = vars
                .iter()
                .position(|v| v.as_tensor().id() == model.embed.as_tensor().id())
        {
            let onto = match grads[i].take() {
                Some(g) => g,
                None => model.embed.as_tensor().zeros_like()?,
            };
            grads[i] = Some(onto.index_add(&ids.flatten_all()?, &upstream, 0)?);
        }
        Ok(grads)
    }
}
