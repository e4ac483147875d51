//! The gpt as a stack of blocks (`models::layered`): activation checkpointing and streamed
//! gradients where the hand-written pass does not run (a GPU, bf16, LoRA, packed rows).

use candle_core::{Result, Tensor, Var};

use super::{Gpt, lookup, one_hot_applies};
use crate::kit::layered::{Stack, TokenBatch};
use crate::{GradientSink, Mode, Params};

impl Stack for Gpt {
    type Batch = TokenBatch;
    type Side = ();

    fn embed(&self, xs: &Tensor, mode: &Mode) -> Result<(TokenBatch, Tensor)> {
        let (ids, packing, shape) = self.window(xs)?;
        let dropout = self.dropout(mode, shape)?;
        let tokens = lookup(&self.params.frozen().as_input(&self.wte), &ids)?;
        let x = self.embedded(&tokens, shape, packing.as_ref(), dropout.as_ref())?;
        let batch = TokenBatch {
            ids,
            shape,
            packing,
            mode: mode.clone(),
        };
        Ok((batch, x.detach()))
    }

    fn depth(&self) -> usize {
        self.blocks.len()
    }

    fn block(&self, i: usize, x: &Tensor, b: &TokenBatch) -> Result<Tensor> {
        let dropout = self.dropout(&b.mode, b.shape)?;
        let packing = b.packing.as_ref();
        self.block_forward(i, x, b.shape, packing, &b.mode, dropout.as_ref())
    }

    fn head_loss(&self, last: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_of(last, targets)
    }

    /// The token table (which the head reads too) and the position table.
    fn embedding_params(&self) -> Vec<usize> {
        [&self.wte, &self.wpe]
            .into_iter()
            .filter_map(|table| self.params.position(table))
            .collect()
    }

    /// The embedding stage differentiated alone, its token lookup's gradient added onto what
    /// the head gave the tied table as candle's backward adds it: row by row (`index_add`)
    /// after a lookup by index, at once after a one-hot product (a GPU's small vocabulary).
    fn embedding_backward(
        &self,
        b: &TokenBatch,
        upstream: &Tensor,
        held: Vec<Option<Tensor>>,
        sink: &mut dyn GradientSink,
    ) -> Result<()> {
        let frozen = self.params.frozen();
        let table = frozen.as_input(&self.wte);
        let by_index = !frozen.contains(&self.wte) && !one_hot_applies(&table, table.dim(0)?);
        let tokens = lookup(&table, &b.ids)?;
        // After a lookup by index the tokens' own gradient is what candle adds row by row.
        let tokens = match by_index {
            true => Var::from_tensor(&tokens.detach())?.as_tensor().clone(),
            false => tokens,
        };
        let dropout = self.dropout(&b.mode, b.shape)?;
        let x = self.embedded(&tokens, b.shape, b.packing.as_ref(), dropout.as_ref())?;
        let store = (x * upstream)?.sum_all()?.backward()?;
        let vars: Vec<&Var> = self.params.vars().collect();
        for (&i, held) in self.embedding_params().iter().zip(held) {
            let var = vars[i];
            let grad = if by_index && var.as_tensor().id() == self.wte.as_tensor().id() {
                let d_tokens = store.get(&tokens).ok_or_else(|| {
                    candle_core::Error::Msg("gpt: the loss does not depend on the tokens".into())
                })?;
                let onto = match held {
                    Some(g) => g,
                    None => var.as_tensor().zeros_like()?,
                };
                Some(onto.index_add(&b.ids, d_tokens, 0)?)
            } else {
                match (held, store.get(var).cloned()) {
                    (Some(held), Some(own)) => Some((held + own)?),
                    (held, own) => held.or(own),
                }
            };
            sink.put(i, grad)?;
        }
        Ok(())
    }

    fn params(&self) -> &Params {
        &self.params
    }
}
