//! The linear layer every family builds from: `y = x·Wᵀ + b` as torch's `nn.Linear`, with an
//! optional LoRA adapter beside it (PEFT's, its input dropped out by row seeds as the model's
//! own dropout is), one fused op for f32 on the CPU (frozen base and adapter together), the
//! compute dtype's products elsewhere. Made by [`super::ParamBuilder::linear`].

use candle_core::{DType, Result, Tensor, Var};

use super::lora::Adapter;
use crate::{FrozenSet, Mode};
use ddpjob_kernels as kernels;
use ddpjob_kernels::dropout::{self, Dropout};
use ddpjob_seam::adapters;

/// `y = x·Wᵀ + b` for x [m, in], W [out, in] as torch's `nn.Linear`; without bias, `b` is a
/// constant zero vector (so the fused CPU kernel applies either way).
pub(crate) struct Linear {
    pub(crate) weight: Var,
    pub(crate) bias: Option<Var>,
    pub(crate) zeros: Tensor,
    pub(crate) frozen: FrozenSet,
    /// A LoRA adapter beside it (`[model.lora]`).
    pub(crate) adapter: Option<Adapter>,
    /// Its position among the model's linear layers: its adapter's dropout site.
    pub(crate) index: usize,
}

/// The first dropout site of LoRA adapters' inputs, past the model's own sites.
const LORA_DROPOUT_SITES: usize = 1 << 20;

impl Linear {
    pub(crate) fn bias_or_zeros(&self) -> &Tensor {
        self.bias.as_ref().map_or(&self.zeros, |b| b.as_tensor())
    }

    /// The layer in evaluation (no adapter dropout).
    pub(crate) fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        self.forward_mode(x, compute, &Mode::Eval)
    }

    /// The layer, its LoRA adapter's input dropped out in training (masks keyed by each
    /// row's seed and this layer's own site, as the model's dropout is); the base alone while
    /// this thread's adapters are off (a preference objective's reference, see
    /// `ddpjob_seam::adapters`).
    pub(crate) fn forward_mode(&self, x: &Tensor, compute: DType, mode: &Mode) -> Result<Tensor> {
        let adapter = self.adapter.as_ref().filter(|_| !adapters::are_off());
        let bias = self
            .bias
            .as_ref()
            .map_or_else(|| self.zeros.clone(), |b| self.frozen.as_input(b));
        let weight = self.frozen.as_input(&self.weight);
        if let Some(adapter) = adapter
            && compute == DType::F32
            && kernels::applies(x)
            && self.frozen.contains(&self.weight)
        {
            // The frozen base and its adapter as one op (see `kernels::lora_linear`).
            let dropout = match mode {
                Mode::Train { row_seeds } if adapter.dropout > 0.0 && !row_seeds.is_empty() => {
                    Some(kernels::AdapterDropout {
                        row_seeds: row_seeds.clone(),
                        site: LORA_DROPOUT_SITES + self.index,
                        p: adapter.dropout,
                        mask: dropout::mask,
                    })
                }
                _ => None,
            };
            let ab = (
                &self.frozen.as_input(&adapter.a),
                &self.frozen.as_input(&adapter.b),
            );
            return kernels::lora_linear(x, &weight, &bias, ab, adapter.scale, dropout);
        }
        let y = if compute == DType::F32 && kernels::applies(x) {
            kernels::linear(x, &weight, &bias, false)?
        } else {
            let y = x
                .to_dtype(compute)?
                .matmul(&weight.to_dtype(compute)?.t()?)?;
            match &self.bias {
                Some(_) => y.broadcast_add(&bias.to_dtype(compute)?)?,
                None => y,
            }
        };
        let Some(adapter) = adapter else {
            return Ok(y);
        };
        let dropout = match mode {
            Mode::Train { row_seeds } if adapter.dropout > 0.0 && !row_seeds.is_empty() => {
                let row_len = x.elem_count() / row_seeds.len();
                Dropout::new(row_seeds, adapter.dropout, row_len)
            }
            _ => None,
        };
        let dropped = match dropout {
            Some(d) => d.apply(x, LORA_DROPOUT_SITES + self.index)?,
            None => x.clone(),
        };
        y + adapter.forward(&dropped, compute, &self.frozen)?
    }

    /// The fused q, k, v projection (no adapter) as three products by the thirds of its
    /// weight and bias, in the compute dtype: each [m, out / 3] (see `attention::of_parts`).
    pub(crate) fn forward_thirds(&self, x: &Tensor, compute: DType) -> Result<[Tensor; 3]> {
        let weight = self.frozen.as_input(&self.weight).to_dtype(compute)?;
        let bias = match &self.bias {
            Some(b) => Some(self.frozen.as_input(b).to_dtype(compute)?),
            None => None,
        };
        let (x, third) = (x.to_dtype(compute)?, weight.dim(0)? / 3);
        let product = |i: usize| -> Result<Tensor> {
            let y = x.matmul(&weight.narrow(0, i * third, third)?.t()?)?;
            match &bias {
                Some(b) => y.broadcast_add(&b.narrow(0, i * third, third)?),
                None => Ok(y),
            }
        };
        Ok([product(0)?, product(1)?, product(2)?])
    }

    /// Which gradients its backward forms: none for what is frozen.
    pub(crate) fn wanted(&self) -> kernels::Wanted {
        kernels::Wanted {
            input: true,
            weight: !self.frozen.contains(&self.weight),
            bias: self.bias.as_ref().is_some_and(|b| !self.frozen.contains(b)),
        }
    }
}
