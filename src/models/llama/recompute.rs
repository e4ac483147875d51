//! The llama's training pass layer by layer: `train.activation_checkpointing` keeps only each
//! decoder layer's input and in the backward recomputes the layers one at a time, last first,
//! each differentiated alone by autograd, seeded with the gradient the layer above gave its
//! output; `distributed.sharding = "gradients"` without checkpointing keeps each layer's graph
//! instead and differentiates the layers one at a time the same way. Either hands each layer's
//! gradients over as soon as its backward has formed them.
//!
//! The forward and the recomputation run the same code on the same inputs, and every gradient
//! is formed by the ops autograd over the whole model forms it with, in the same order (the
//! tied embedding's lookup gradient is added onto the output projection's, as candle's own
//! backward does), so the weights are bit-identical to a pass that keeps everything (tested on
//! the CPU in f32 and bf16). Peak memory when recomputing: the layers' inputs, and one layer's
//! activations with its gradients. Any device, precision, packing and LoRA: it is autograd,
//! layer by layer.

use candle_core::{Error, Result, Tensor, Var};

use super::Llama;
use crate::models::packed::{self, Packing};
use crate::models::{CollectedGradients, GradientSink, Mode, TrainPass};

pub(super) struct Recomputed<'a> {
    model: &'a Llama,
    /// Token ids [n, t].
    ids: Tensor,
    shape: (usize, usize),
    packing: Option<Packing>,
    mode: Mode,
    /// What each layer kept for its backward, first layer first.
    layers: Vec<Kept>,
    /// The last layer's output, as a variable: the final norm's and the head's graph start
    /// there.
    last: Var,
    loss: Tensor,
}

/// What one layer keeps for its backward.
enum Kept {
    /// Its input [n·t, hidden], detached: recomputed from it.
    Input(Tensor),
    /// Its input as a variable and its output, with the graph between them.
    Graph { input: Var, output: Tensor },
}

impl<'a> Recomputed<'a> {
    /// The forward pass, each layer apart: its graph is dropped as soon as its output is
    /// (detached and) handed to the next layer when `recompute`, else kept.
    pub(super) fn forward(
        model: &'a Llama,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
        recompute: bool,
    ) -> Result<Self> {
        let (ids, packing) = packed::split(xs)?;
        let shape = model.check_window(&ids)?;
        let mut layers = Vec::with_capacity(model.layers.len());
        let x = match recompute {
            true => {
                let mut inputs = Vec::with_capacity(model.layers.len());
                let x = model.detached_layers(
                    &ids,
                    shape,
                    packing.as_ref(),
                    mode,
                    Some(&mut inputs),
                )?;
                layers.extend(inputs.into_iter().map(Kept::Input));
                x
            }
            false => {
                let mut x = model.embed_tokens(&ids)?.detach();
                for layer in &model.layers {
                    let input = Var::from_tensor(&x)?;
                    let output =
                        model.block(layer, input.as_tensor(), shape, packing.as_ref(), mode)?;
                    x = output.detach();
                    layers.push(Kept::Graph { input, output });
                }
                x
            }
        };
        let last = Var::from_tensor(&x)?;
        drop(x);
        let loss = model.loss_of(&model.final_norm(last.as_tensor())?, targets)?;
        Ok(Recomputed {
            model,
            ids,
            shape,
            packing,
            mode: mode.clone(),
            layers,
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
        let mut all = CollectedGradients::new(self.model.params.len());
        self.backward_to(scale, &mut all)?;
        Ok(all.0)
    }

    /// The final norm's (and an untied output projection's) gradients after the head's
    /// backward, each layer's after its own, last layer first, the embedding's last.
    fn backward_to(self: Box<Self>, scale: f64, sink: &mut dyn GradientSink) -> Result<()> {
        let Recomputed {
            model,
            ids,
            shape,
            packing,
            mode,
            mut layers,
            last,
            loss,
        } = *self;
        let vars: Vec<&Var> = model.params.vars().collect();
        let embed = vars
            .iter()
            .position(|v| v.as_tensor().id() == model.embed.as_tensor().id());
        // Hands over what `store` holds of the parameters, the embedding's kept back: the
        // lookup adds to it last.
        let mut hand_over = |store: &candle_core::backprop::GradStore| -> Result<Option<Tensor>> {
            let mut held = None;
            for (i, var) in vars.iter().enumerate() {
                match (store.get(var), Some(i) == embed) {
                    (Some(g), true) => held = Some(g.clone()),
                    (Some(g), false) => sink.put(i, Some(g.clone()))?,
                    (None, _) => {}
                }
            }
            Ok(held)
        };
        let head = (&loss * scale)?.backward()?;
        let mut embed_grad = hand_over(&head)?;
        let missing = || Error::Msg("llama: the loss does not depend on the layers".into());
        let mut upstream = head.get(last.as_tensor()).cloned().ok_or_else(missing)?;
        drop((head, loss, last));
        for layer in model.layers.iter().rev() {
            let (x, y) = match layers.pop().ok_or_else(missing)? {
                Kept::Input(input) => {
                    let x = Var::from_tensor(&input)?;
                    drop(input);
                    let y = model.block(layer, x.as_tensor(), shape, packing.as_ref(), &mode)?;
                    (x, y)
                }
                Kept::Graph { input, output } => (input, output),
            };
            // d(Σ y·upstream)/dy is `upstream` exactly (1·g), so this layer's backward runs
            // on the same gradient as in a whole-model backward.
            let store = (y * &upstream)?.sum_all()?.backward()?;
            if let Some(g) = hand_over(&store)? {
                embed_grad = Some(g);
            }
            upstream = store.get(x.as_tensor()).cloned().ok_or_else(missing)?;
        }
        // The lookup's gradient, as candle's backward of `index_select` forms it: added row by
        // row onto what the parameter already has (a tied embedding: the output projection's).
        if let Some(i) = embed {
            if model.params.frozen.contains(&model.embed) {
                return sink.put(i, embed_grad);
            }
            let onto = match embed_grad {
                Some(g) => g,
                None => model.embed.as_tensor().zeros_like()?,
            };
            sink.put(i, Some(onto.index_add(&ids.flatten_all()?, &upstream, 0)?))?;
        }
        Ok(())
    }
}
