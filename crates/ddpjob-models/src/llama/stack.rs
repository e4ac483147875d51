//! The llama as a stack of decoder layers (`models::layered`): how activation checkpointing
//! and streamed gradients go through it layer by layer.

use candle_core::{Result, Tensor};

use super::Llama;
use super::moe::Routing;
use crate::GradientSink;
use crate::kit::layered::{SideLoss, Stack, TokenBatch};
use crate::kit::packed;
use crate::{Mode, Params};

impl Stack for Llama {
    type Batch = TokenBatch;
    /// A sparse layer's routing, for the load-balancing loss.
    type Side = Routing;

    fn embed(&self, xs: &Tensor, mode: &Mode) -> Result<(TokenBatch, Tensor)> {
        let (ids, packing) = packed::split(xs)?;
        let shape = self.check_window(&ids)?;
        let x = self.embed_tokens(&ids)?.detach();
        let mode = mode.clone();
        Ok((
            TokenBatch {
                ids,
                shape,
                packing,
                mode,
            },
            x,
        ))
    }

    fn depth(&self) -> usize {
        self.layers.len()
    }

    fn block(&self, i: usize, x: &Tensor, b: &TokenBatch) -> Result<Tensor> {
        self.block(&self.layers[i], x, b.shape, b.packing.as_ref(), &b.mode)
    }

    fn block_with_side(
        &self,
        i: usize,
        x: &Tensor,
        b: &TokenBatch,
    ) -> Result<(Tensor, Option<Routing>)> {
        self.block_routed(&self.layers[i], x, b.shape, b.packing.as_ref(), &b.mode)
    }

    fn side_loss(
        &self,
        sides: &[Option<Routing>],
        _batch: &TokenBatch,
        targets: &Tensor,
    ) -> Result<Option<Box<dyn SideLoss<Routing> + '_>>> {
        let routings: Vec<&Routing> = sides.iter().flatten().collect();
        Ok(self
            .aux_weights(&routings, targets)?
            .map(|aux| Box::new(aux) as Box<dyn SideLoss<Routing>>))
    }

    fn head_loss(&self, last: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_of(&self.final_norm(last)?, targets)
    }

    fn embedding_params(&self) -> Vec<usize> {
        self.params.position(&self.embed).into_iter().collect()
    }

    /// The lookup's gradient, as candle's backward of `index_select` forms it: added row by row
    /// onto what the table already has (a tied embedding: the output projection's).
    fn embedding_backward(
        &self,
        b: &TokenBatch,
        upstream: &Tensor,
        held: Vec<Option<Tensor>>,
        sink: &mut dyn GradientSink,
    ) -> Result<()> {
        let (Some(i), Some(held)) = (self.embedding_params().first().copied(), held.first()) else {
            return Ok(());
        };
        if self.params.frozen().contains(&self.embed) {
            return sink.put(i, held.clone());
        }
        let onto = match held {
            Some(g) => g.clone(),
            None => self.embed.as_tensor().zeros_like()?,
        };
        // Gemma's scaled embedding: the scale's backward first, as autograd's.
        let upstream = match self.embed_scale() {
            Some(scale) => upstream.affine(scale, 0.0)?,
            None => upstream.clone(),
        };
        sink.put(
            i,
            Some(onto.index_add(&b.ids.flatten_all()?, &upstream, 0)?),
        )
    }

    fn params(&self) -> &Params {
        &self.params
    }
}
